#!/usr/bin/env bash
# GPT-2 (124M, random weights from its config; nothing downloaded) through --hf on a GPU: the ROCm
# guide's rocm-after plan against saturate's tuned plan, each trained the same steps, tokens/s from
# train --json. Run by bench/gpu_session.sh (section hf); needs transformers.
set -euo pipefail
dir=${HF_DIR:-/tmp/gpt2-124m}
python3 - "$dir" <<'PY'
import sys
from transformers import GPT2Config
GPT2Config(n_positions=1024, n_embd=768, n_layer=12, n_head=12).save_pretrained(sys.argv[1])
PY
common=(--hf "$dir" --steps "${HF_STEPS:-30}" --log-every 10 --eval-every 1000 --no-progress --log-to csv)
python3 -m saturate train "${common[@]}" --plan rocm-after --run-dir /tmp/hf-rocm --json > /tmp/hf-rocm.json
python3 -m saturate tune --hf "$dir" --budget "${HF_TUNE_SECONDS:-150}"
python3 -m saturate train "${common[@]}" --run-dir /tmp/hf-tuned --json > /tmp/hf-tuned.json
python3 - <<'PY'
import json
a, b = (json.load(open(f"/tmp/hf-{n}.json")) for n in ("rocm", "tuned"))
for name, r in (("rocm-after", a), ("tuned", b)):
    print(name, json.dumps(r)[:1500])
PY
