cd /tmp/wtX
for s in 1 2; do
  PYTHONPATH=/tmp/wtX/src python3 bench/real_scripts.py run --condition bursty --seed $s --cases run_clm,word_lm_adamw,lightning,nanogpt --verbs run --timeout 600 --out /tmp/exp/run-bursty-s$s > /tmp/exp/run-bursty-s$s.log 2>&1
done
echo DONE
