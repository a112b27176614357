#!/usr/bin/env bash
# Everything the foundation checks on a GPU, in calls of the device tool (or by hand on any CUDA
# machine), each section under its own time limit and logged to $OUT. From the repository root:
#
#   bash bench/gpu_session.sh                 # every section, in order (about 25 minutes)
#   bash bench/gpu_session.sh tests small     # some sections
#
# A session is lent 15 minutes of device time in all (2026-11-27), the machine's start included, and one
# call runs at most 600 s: the first call is `bash bench/gpu_session.sh env newtests informed` (timeout_s
# 560: about 30 + 90 + 330 s), the second, while time is left, `nanogpt` (timeout_s 360, carrying .gl/nanogpt:
# see its section), then `tuner124` or `script_tune`.
#
# Sections: env tests newtests informed small mfu profile tuner tuner124 doctor fsdp hf nanogpt script script_tune
# train.
# The lent image has torch but not every dependency (tomli-w is missing there): carry wheels in
# .whl/ as the device README explains; they are installed to /tmp/site first when present.
set -uo pipefail
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src:$PWD/bench:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export SATURATE_CACHE=${SATURATE_CACHE:-/tmp/saturate-cache}
out=${OUT:-/tmp/saturate-gpu}
mkdir -p "$out"
sections=${*:-env tests small mfu profile tuner doctor fsdp hf script train}
start=$SECONDS

section() {  # section NAME LIMIT_S COMMAND...: run under a limit, log to $out/NAME.log, say how it ended
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s, at $((SECONDS - start))s)"
  timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-25}" "$out/$name.log"
  echo "== $name: exit $rc after $((SECONDS - start))s"
}

for s in $sections; do
  case $s in
    env)
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv
      python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
      section probe 120 python3 -m saturate probe ;;
    tests)
      TAIL=40 section pytest_gpu 420 python3 -m pytest -q -m gpu ${TESTS:-tests} --ignore=tests/test_layout.py \
        -p no:cacheprovider --timeout 150 -rfEs ;;
    newtests)  # only the GPU tests of what was built since the last GPU session (a short call's first check)
      TAIL=15 section pytest_gpu_new ${NEWTESTS_LIMIT:-90} python3 -m pytest -q -m gpu tests/engine/test_grow_gpu.py \
        -p no:cacheprovider --timeout 80 -rfEs ;;
    informed)  # issue 30: gpt-small's informed plan (its micro-batch grown from its first steps) against the tuned
      section informed_gpt_small ${INFORMED_LIMIT:-330} python3 bench/informed_vs_tuned.py --preset gpt-small \
        --device cuda --budget ${BUDGET_INFORMED:-150} --rounds 2 --steps 8 --warmup 3 --json "$out/informed_gpt_small.json" ;;
    small)  # gpt-small as the repo trains it (byte vocabulary), compile vs eager
      section gpu_small 300 python3 bench/gpu_small.py --rounds 2 --steps 20 --warmup 10 --json "$out/gpu_small.json" ;;
    mfu)  # the GPT-2 124M shape nanoGPT and llm.c report (vocabulary 50257 padded to 50304)
      section mfu_124m 300 python3 bench/gpu_small.py --vocab 50257 --micro ${MICRO:-16} --rounds ${ROUNDS:-2} \
        --steps 20 --warmup 10 \
        --json "$out/mfu_124m.json" ;;
    profile)  # where the tuned-shape step's GPU time goes, and which SDPA backend runs
      section gpu_profile 240 python3 bench/gpu_profile.py --micro ${MICRO:-16} --json "$out/gpu_profile.json" ;;
    tuner)
      section tuner ${TUNER_LIMIT:-330} python3 bench/tuner.py --preset gpt-small --device cuda --no-grid --rounds 2 --steps 10 \
        --warmup 3 ${TUNER_ARGS:-} --json "$out/tuner_gpu.json" ;;
    tuner124)  # the GPT-2 124M shape (vocabulary 50257 -> 50304) with saturate tune choosing the plan, against a6000-after
      section tuner_124m ${TUNER124_LIMIT:-330} python3 bench/tuner.py --preset gpt-small --vocab 50257 --device cuda \
        --no-grid --no-naive --budget ${BUDGET124:-150} --rounds 2 --steps 8 --warmup 3 --json "$out/tuner_124m.json" ;;
    doctor)  # constructed GPU cases: the top fix's predicted gain against its measured gain after applying it
      section doctor_predictions 420 python3 bench/doctor_predictions.py --device cuda --rounds 2 \
        --json "$out/doctor_predictions.json" ;;
    fsdp)
      section fsdp_offload 120 python3 -m saturate train --preset gpt-medium --plan bench/plans/fsdp_offload.toml \
        --steps 6 --log-every 2 --eval-every 1000 --run-dir /tmp/fsdp-run --no-progress ;;
    hf)
      # ts-lstm against the time-series guide's plans, then GPT-2 124M through --hf against rocm-after
      section hf 540 python3 bench/timeseries.py --hf-gpt2 --device cuda --budget 120 --rounds 2 \
        --json "$out/timeseries_gpu.json" ;;
    nanogpt)  # issue 32: nanoGPT's own train.py, GPT-2 124M config, --compile=False as written; prepared here with
      # `python3 bench/real_scripts.py prepare --cases nanogpt && cp -r /tmp/real/nanogpt .gl/nanogpt` and carried
      # (device tool: carry [".whl", ".gl/nanogpt"]); shakespeare_char's data (offline), wandb off, 20 eval batches
      if [ ! -f .gl/nanogpt/train.py ]; then echo "nanogpt: .gl/nanogpt missing (see the comment above)"; else
        NANO="python3 train.py config/train_gpt2.py --compile=False --dataset=shakespeare_char --wandb_log=False"
        NANO="$NANO --eval_iters=20 --max_iters=${NANOGPT_ITERS:-2000}"
        section nanogpt_doctor 150 bash -c "cd .gl/nanogpt && python3 -m saturate doctor -- $NANO"
        section nanogpt_tune 200 bash -c "cd .gl/nanogpt && python3 -m saturate tune --json -- $NANO"
      fi ;;
    script)
      section doctor_script 150 python3 -m saturate doctor -- python3 examples/scripts/gpt_pretrain/train.py --max-steps 5000 ;;
    script_tune)  # tune -- CMD on guide 1's script twice: paired on the GPU, the two tunings should agree
      section tune_script_1 200 python3 -m saturate tune --json -- python3 examples/scripts/gpt_pretrain/train.py --max-steps 3000
      section tune_script_2 200 python3 -m saturate tune --json -- python3 examples/scripts/gpt_pretrain/train.py --max-steps 3000 ;;
    train)
      section train_tuned 660 python3 -m saturate train --preset gpt-small --plan bench/plans/tuned_h100_gpt_small.toml \
        --minutes ${TRAIN_MINUTES:-10} --run-dir /tmp/tuned-run --no-progress --json ;;
    *) echo "unknown section: $s"; exit 2 ;;
  esac
done
