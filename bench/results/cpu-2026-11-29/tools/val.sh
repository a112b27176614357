# nanoGPT as written under the steady neighbour: its own ms per iteration on torch's 2 threads and on one, alternated.
cd /tmp/real/nanogpt
setsid python3 /work/shared/tools/neighbour.py --profile steady --seed 0 --duration 900 --log /tmp/exp/val-neighbour.jsonl > /dev/null 2>&1 &
NB=$!
sleep 5
for r in 1 2; do
  for t in 2 1; do
    git clean -fdxq -e data; git checkout -q .
    if [ $t = 1 ]; then export OMP_NUM_THREADS=1; else unset OMP_NUM_THREADS; fi
    echo "== round $r threads $t"
    /usr/bin/time -f "wall %e s" python3 train.py config/train_shakespeare_char.py --device=cpu --compile=False --n_layer=2 --n_head=2 --n_embd=64 --block_size=64 --batch_size=8 --max_iters=60 --eval_interval=1000 --eval_iters=5 --log_interval=5 2>&1 | grep -E "^iter|wall"
  done
done
kill -- -$NB 2>/dev/null; kill $NB 2>/dev/null
git clean -fdxq -e data; git checkout -q .
echo DONE
