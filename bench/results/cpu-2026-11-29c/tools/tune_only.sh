#!/bin/bash
# saturate run on the peers' 2000-step job until its tuning is written; prints the compile-related decisions
SRC=${1:-/work/main/src}; TAG=${2:-x}
cd /tmp/peers
C=/tmp/exp30/cache-$TAG; rm -rf $C
RD=/tmp/exp30/run-$TAG; rm -rf $RD
HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false SATURATE_CACHE=$C TORCHINDUCTOR_CACHE_DIR=$C/inductor PYTHONPATH=$SRC \
  python3 -m saturate run --hf gpt-peer --data train.txt --param seq_len=128 --param lr=2e-3 --param warmup_steps=20 \
  --effective-batch 32 --steps 2000 --run-dir $RD --no-progress > /tmp/exp30/out-$TAG.txt 2>&1 &
P=$!
while [ ! -f $RD/tune/tune.json ] && kill -0 $P 2>/dev/null; do sleep 2; done
kill $P; wait $P 2>/dev/null
python3 - "$RD" <<'PY'
import json, sys
d = json.load(open(sys.argv[1] + "/tune/tune.json"))
for x in d["decisions"]:
    if x.split(":")[0] in ("micro-batch", "fused optimizer", "compile", "budget", "precision"): print(" ", x[:260])
for t in d["trials"]: print("  ", t.get("stage"), t.get("status"), t.get("compile_s") and round(t["compile_s"], 1), round(t.get("seconds") or 0, 1), t.get("samples_per_s") and round(t["samples_per_s"], 1), t.get("steps"))
PY
