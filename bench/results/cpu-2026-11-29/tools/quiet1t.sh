cd /tmp/wtX
for r in 1 2; do
 for t in 2 1; do
  if [ $t = 1 ]; then export OMP_NUM_THREADS=1; else unset OMP_NUM_THREADS; fi
  PYTHONPATH=/tmp/wtX/src python3 bench/real_scripts.py run --condition quiet --cases nanogpt,run_clm,word_lm_adamw,lightning --verbs doctor --timeout 300 --out /tmp/exp/q-t$t-r$r > /tmp/exp/q-t$t-r$r.log 2>&1
 done
done
echo DONE
