#!/bin/bash
# Quiet bare references for the real scripts' tuned settings (2026-11-28): each command as written and with the
# setting written in by hand, no saturate in the process, alternating, 3 rounds. run_clm: its own train_runtime;
# Lightning: the whole command's wall time (start-up included, the same on both sides).
# Folders: copies of bench/real_scripts.py's prepared ones in /tmp/ref (lightning_bf16: precision='bf16-mixed').
ALLOC="MALLOC_MMAP_THRESHOLD_=134217728 MALLOC_TRIM_THRESHOLD_=789890688"
CLM="python3 run_clm.py --config_name tiny-gpt2 --tokenizer_name tiny-gpt2 --train_file train.txt --max_steps 200 \
 --output_dir out --do_train --block_size 64 --use_cpu"
for round in 1 2 3; do
  for mb in "1 8" "2 4" "8 1"; do
    set -- $mb
    cd /tmp/ref/run_clm && rm -rf out
    rt=$(HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $CLM --per_device_train_batch_size $1 --gradient_accumulation_steps $2 \
         2>&1 | grep -o "train_runtime *= *[0-9:.]*" | tail -1)
    echo "round $round run_clm ${1}x${2}: $rt"
  done
  for side in "lightning|" "lightning|$ALLOC" "lightning_bf16|$ALLOC"; do
    dir=${side%%|*}; env=${side#*|}
    cd /tmp/ref/$dir && rm -rf lightning_logs
    t0=$(date +%s.%N); env PL_DISABLE_FORK=1 $env python3 transformer.py > /dev/null 2>&1; t1=$(date +%s.%N)
    echo "round $round $dir [${env:-as written}]: $(echo "$t1 - $t0" | bc) s"
  done
done
