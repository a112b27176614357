cd /tmp/wtX
for s in 0 1 2; do
  PYTHONPATH=/tmp/wtX/src python3 bench/real_scripts.py run --condition steady --seed $s --cases nanogpt,run_clm,word_lm_adamw,lightning --verbs doctor --timeout 300 --out /tmp/exp/doc3-steady-s$s > /tmp/exp/doc3-steady-s$s.log 2>&1
done
for s in 9 10 11; do
  PYTHONPATH=/tmp/wtX/src python3 bench/real_scripts.py run --condition bursty --seed $s --cases nanogpt,run_clm,word_lm_adamw,lightning --verbs doctor --timeout 300 --out /tmp/exp/doc3-bursty-s$s > /tmp/exp/doc3-bursty-s$s.log 2>&1
done
echo DONE
