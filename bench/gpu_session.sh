#!/usr/bin/env bash
# Everything the foundation checks on a GPU, in one call of the device tool (or by hand on any
# CUDA machine), ending with compact tables. From the repository root:
#
#   bash bench/gpu_session.sh
#
# The lent H200 image has torch but not every dependency (tomli-w is missing there): carry wheels
# in .whl/ as the device README explains; they are installed to /tmp/site first when present.
set -uo pipefail
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
out=${OUT:-/tmp/saturate-gpu}
mkdir -p "$out"

echo "== probe"; python3 -m saturate probe 2>&1 | tee "$out/probe.txt"
echo "== gpu tests"; python3 -m pytest -q -m gpu tests 2>&1 | tee "$out/pytest_gpu.log" | tail -8
echo "== engine overhead (cuda)"; python3 bench/engine_overhead.py --device cuda --json "$out/overhead.json" 2>&1 | tail -12
echo "== gpt-small bf16 + compile"; python3 bench/gpu_small.py --json "$out/gpu_small.json" 2>&1 | tail -20
echo "== tuner: gpt-small tuned vs naive and a6000-after"
python3 bench/tuner.py --preset gpt-small --device cuda --no-grid --rounds 2 --steps 10 --warmup 3 \
  --json "$out/tuner_gpu.json" 2>&1 | tail -40
