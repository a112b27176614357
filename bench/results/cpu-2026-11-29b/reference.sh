#!/bin/bash
# Quiet bare references (2026-11-29, twenty-sixth session) for settings the sweep kept or applied that earlier
# references lacked: no saturate in the process, alternating, 3 rounds, the scripts' own timings.
# word_lm_adamw (pytorch/examples word_language_model, its README's AdamW line, smaller): as written; host allocator
# + AdamW(fused=True); host allocator + bf16 autocast around the forward and loss; all three (the edits
# `tune -- CMD` prints), in copies of
# bench/real_scripts.py's prepared /tmp/real/word_lm_adamw under /tmp/ref; the epoch time the script prints.
# run_clm (Transformers Trainer): micro-batch x accumulation 1x8 (as written), 2x4, 4x2, 8x1; its train_runtime.
ALLOC="MALLOC_MMAP_THRESHOLD_=134217728 MALLOC_TRIM_THRESHOLD_=789890688"
CMD="python3 main.py --model Transformer --use-optimizer --lr 0.001 --emsize 32 --nhid 32 --epochs 1"
CLM="python3 run_clm.py --config_name tiny-gpt2 --tokenizer_name tiny-gpt2 --train_file train.txt --max_steps 200 \
 --output_dir out --do_train --block_size 64 --use_cpu"
for round in 1 2 3; do
  for side in "word_lm_adamw|" "word_lm_adamw_fused|$ALLOC" "word_lm_adamw_bf16|$ALLOC" \
              "word_lm_adamw_all|$ALLOC"; do
    dir=${side%%|*}; env=${side#*|}
    cd /tmp/ref/$dir && rm -f model.pt
    t=$(env $env $CMD 2>/dev/null | grep -o "end of epoch *1 | time: *[0-9.]*s")
    echo "round $round $dir [${env:-as written}]: $t"
  done
  for mb in "1 8" "2 4" "4 2" "8 1"; do
    set -- $mb
    cd /tmp/ref/run_clm && rm -rf out
    rt=$(HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $CLM --per_device_train_batch_size $1 --gradient_accumulation_steps $2 \
         2>&1 | grep -o "train_runtime *= *[0-9:.]*" | tail -1)
    echo "round $round run_clm ${1}x${2}: $rt"
  done
done
