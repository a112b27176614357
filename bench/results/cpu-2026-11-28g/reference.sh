#!/bin/bash
# Quiet bare reference (2026-11-28, twenty-fourth session): pytorch/examples' word_language_model as its README's
# AdamW line (bench/real_scripts.py's word_lm_adamw), as written and with the host allocator thresholds alone,
# no saturate in the process, alternating, 3 rounds; the script's own epoch time.
# Folder: a copy of bench/real_scripts.py's prepared /tmp/real/word_lm_adamw in /tmp/ref.
ALLOC="MALLOC_MMAP_THRESHOLD_=134217728 MALLOC_TRIM_THRESHOLD_=789890688"
CMD="python3 main.py --model Transformer --use-optimizer --lr 0.001 --emsize 32 --nhid 32 --epochs 1"
for round in 1 2 3; do
  for env in "" "$ALLOC"; do
    cd /tmp/ref/word_lm_adamw && rm -f model.pt
    t=$(env $env $CMD 2>/dev/null | grep -o "end of epoch *1 | time: *[0-9.]*s")
    echo "round $round word_lm_adamw [${env:-as written}]: $t"
  done
done
