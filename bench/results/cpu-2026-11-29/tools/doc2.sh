cd /tmp/wtX
for s in 0 1 2; do
  PYTHONPATH=/tmp/wtX/src python3 bench/real_scripts.py run --condition steady --seed $s --cases nanogpt --verbs doctor --timeout 300 --out /tmp/exp/doc2-steady-s$s > /tmp/exp/doc2-steady-s$s.log 2>&1
done
PYTHONPATH=/tmp/wtX/src python3 bench/real_scripts.py run --condition bursty --seed 8 --cases nanogpt --verbs doctor --timeout 300 --out /tmp/exp/doc2-bursty-s8 > /tmp/exp/doc2-bursty-s8.log 2>&1
echo DONE
