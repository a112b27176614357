#!/usr/bin/env bash
# Install saturate (editable) into the current Python environment.
#
# An installed torch is used as it is: a CUDA or ROCm build you installed stays. Only where no
# torch is installed at all does this install torch==2.13.0 (on a machine whose pip resolves it
# to a local CPU wheel, that is the CPU build), so pip never pulls gigabytes of CUDA wheels
# behind your back. `--dev` adds the test and lint tools. pip's output is shown (a line per package),
# so a slow download is visibly progressing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=""
if [ "${1:-}" = "--dev" ]; then extras="[dev]"; fi

if "$PY" -c "import torch" 2>/dev/null; then
  version=$("$PY" -c "import torch; print(torch.__version__)")
  if ! "$PY" -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 4))"; then
    echo "setup: torch $version is installed but saturate needs torch >= 2.4; upgrade it for your CUDA/ROCm first" >&2
    exit 1
  fi
  echo "setup: [1/2] using the installed torch $version"
else
  echo "setup: [1/2] no torch installed; installing torch==2.13.0 (for a GPU, install your CUDA/ROCm build of torch first)"
  "$PY" -m pip install --progress-bar on "torch==2.13.0"
fi
echo "setup: [2/2] installing saturate${extras:+ with $extras} and its dependencies (pip's own lines follow) …"
"$PY" -m pip install --progress-bar on -e ".${extras}"
echo "setup: saturate installed ($("$PY" -c 'import saturate; print(saturate.__version__)' 2>/dev/null || echo '?'))"
