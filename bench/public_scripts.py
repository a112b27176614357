"""Five more public training scripts under `saturate doctor|tune|run -- CMD` (issue 61), with what `run` applied timed
again by hand: bench/real_scripts.py's method (its helpers imported, not copied), on scripts saturate had not met.

The five, each adapted only to run offline on a 2-core CPU in a minute or two (every change in CASES[...].notes):

* chargpt — karpathy/minGPT projects/chargpt/chargpt.py, a small GPT by its own `--model.*`/`--trainer.*` flags;
* patchtst — thuml/Time-Series-Library run.py --model PatchTST, long-term forecast on a synthetic ETTh1.csv;
* clm_no_trainer — transformers examples/pytorch/language-modeling/run_clm_no_trainer.py under `accelerate launch
  --num_processes 1 --cpu`, a tiny GPT-2 from a local config and tokenizer (real_scripts.gpt2_folder_code);
* time_seq — pytorch/examples time_sequence_prediction/train.py (LBFGS with a closure; its generate_sine_wave.py);
* reinforce — pytorch/examples reinforcement_learning/reinforce.py (REINFORCE on gymnasium's CartPole-v1, Adam).

Each script gets a git folder under --root (default /tmp/public), prepared data committed, so `git status
--porcelain --ignored` after a command shows what the command left. Per script, the folder reset before and after
each: plain, `doctor --json`, `tune --json --trial-steps 4 --trial-seconds 3 --out OUT/<case>-tune`, `run --json
--trial-steps 4 --trial-seconds 3` (real_scripts.run_one), and, beside what real_scripts records:

* /tmp: the entries named pymp-*, saturate-*, torchelastic_* before and after each command (new ones are listed);
* ab: where `run` applied overrides, the script as written (A) and with the same change made by hand (B), plain
  runs without saturate, alternating A B B A A B (where `run` applied nothing but tune kept settings, those, said
  so); B is tune's edit.diff (`git apply`, when tune kept the same
  loader/optimizer/split settings `run` applied), else those keywords set by hand at every DataLoader(...) /
  Adam(...)/AdamW(...) call of the folder's .py files; threads as `import torch; torch.set_num_threads(N)` put at
  the top of the entry script; host_alloc as glibc's MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ in the
  environment; configurator flags appended. The ratio is the median of the three per-pair A/B wall-time ratios.

    python bench/public_scripts.py prepare
    python bench/public_scripts.py run --wait-quiet 600 --out bench/results/cpu-2026-12-02d
    python bench/public_scripts.py run --cases chargpt --verbs plain,doctor --out ...
    python bench/public_scripts.py run --cases chargpt --verbs ab --out ...    # A/B from the recorded run
    python bench/public_scripts.py table --out bench/results/cpu-2026-12-02d

--wait-quiet S waits, before each command, up to S seconds for other processes to leave the CPUs (under 0.25 of a
core busy); each record holds the load around it and the commit saturate's src/ was at.

Logs: OUT/<case>-<verb>.stdout|.stderr (cut to their first and last 100 kB past 200 kB), OUT/<case>-ab-<n><A|B>.*;
OUT/results.json (merged across invocations); OUT/table.md.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import real_scripts as rs  # noqa: E402

PY = rs.PY
BIN = Path(PY).parent
MIRRORS = rs.MIRRORS
VERBS = ("plain", "doctor", "tune", "run", "ab")
TMP_PREFIXES = ("pymp-", "saturate-", "torchelastic_")
LOG_LIMIT = 200_000
AB_ORDER = "ABBAAB"


# --------------------------------------------------------------------------------------------------------------------
# preparation


def prep_chargpt(dest: Path, a: argparse.Namespace) -> str:
    rs.export(a.mingpt_git, "HEAD", [], dest)
    (dest / "input.txt").write_text(rs.english_text(1_000_000))  # chargpt.py reads ./input.txt
    rs.commit_all(dest, f"minGPT {rs.rev(a.mingpt_git)} + input.txt (stdlib docstrings)")
    return rs.rev(a.mingpt_git)


ETT_COLUMNS = ("HUFL", "HULL", "MUFL", "MULL", "LUFL", "LULL", "OT")
ETT_ROWS = 17420  # ETTh1.csv's own length; Dataset_ETT_hour reads fixed borders up to row 14400


def ett_csv(rows: int = ETT_ROWS, seed: int = 0) -> str:
    """An ETTh1-format CSV: hourly dates from 2016-07-01, seven columns of daily and weekly sines plus noise."""
    import numpy as np
    import pandas as pd
    rng = np.random.default_rng(seed)
    t = np.arange(rows, dtype=np.float64)
    cols = {}
    for i, c in enumerate(ETT_COLUMNS):
        level, amp = 5.0 + 3 * i, 2.0 + 0.5 * i
        cols[c] = (level + amp * np.sin(2 * np.pi * t / 24 + i) + 0.5 * amp * np.sin(2 * np.pi * t / 168 + 2 * i)
                   + 0.002 * t + rng.normal(0, 0.3 * amp, rows)).round(3)
    df = pd.DataFrame({"date": pd.date_range("2016-07-01 00:00:00", periods=rows, freq="h")
                       .strftime("%Y-%m-%d %H:%M:%S"), **cols})
    return df.to_csv(index=False)


def prep_patchtst(dest: Path, a: argparse.Namespace) -> str:
    rs.export(a.tsl_git, "HEAD", [], dest)
    d = dest / "dataset" / "ETT-small"  # the README's ./dataset/ETT-small/ (its .gitignore lists /dataset/)
    d.mkdir(parents=True, exist_ok=True)
    (d / "ETTh1.csv").write_text(ett_csv())
    rs.commit_all(dest, f"Time-Series-Library {rs.rev(a.tsl_git)} + synthetic dataset/ETT-small/ETTh1.csv",
                  force=["dataset/ETT-small/ETTh1.csv"])
    return rs.rev(a.tsl_git)


CLM_EDITS = [("if accelerator.distributed_type == DistributedType.TPU:",
              "if accelerator.distributed_type == DistributedType.XLA:")]


def prep_clm_no_trainer(dest: Path, a: argparse.Namespace) -> str:
    dest.mkdir(parents=True, exist_ok=True)
    src = rs.sh(["git", "--git-dir", str(a.transformers_git), "show",
                 f"{a.transformers_commit}:examples/pytorch/language-modeling/run_clm_no_trainer.py"])
    (dest / "run_clm_no_trainer.py").write_text(src)
    (dest / "train.txt").write_text(rs.english_text(400_000))
    subprocess.run([PY, "-c", rs.gpt2_folder_code("tiny-gpt2", 1024, "n_layer=2, n_embd=64, n_head=2")], cwd=dest,
                   check=True, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    rs.commit_all(dest, f"run_clm_no_trainer.py at transformers {a.transformers_commit[:10]} as is + tiny GPT-2 + text")
    rs.apply_edits(dest / "run_clm_no_trainer.py", CLM_EDITS)
    rs.commit_all(dest, "DistributedType.TPU -> DistributedType.XLA (accelerate 1.16 has no TPU member)")
    return a.transformers_commit[:10]


def prep_time_seq(dest: Path, a: argparse.Namespace) -> str:
    base = "time_sequence_prediction"
    rs.export(a.examples_git, "HEAD", [f"{base}/{f}" for f in ("train.py", "generate_sine_wave.py", "README.md",
                                                                "requirements.txt")], dest, strip=base)
    rs.commit_all(dest, f"pytorch/examples {rs.rev(a.examples_git)} time_sequence_prediction as is")
    rs.apply_edits(dest / "generate_sine_wave.py", [("\nL = 1000\n", "\nL = 200\n")])
    rs.sh([PY, "generate_sine_wave.py"], cwd=dest)  # writes traindata.pt, as its README says
    rs.commit_all(dest, "generate_sine_wave.py: sequences of 200 samples (L = 200 for 1000) + its traindata.pt")
    return rs.rev(a.examples_git)


def prep_reinforce(dest: Path, a: argparse.Namespace) -> str:
    base = "reinforcement_learning"
    rs.export(a.examples_git, "HEAD", [f"{base}/{f}" for f in ("reinforce.py", "README.md", "requirements.txt")],
              dest, strip=base)
    rs.commit_all(dest, f"pytorch/examples {rs.rev(a.examples_git)} reinforcement_learning/reinforce.py as is")
    return rs.rev(a.examples_git)


# --------------------------------------------------------------------------------------------------------------------
# the five


# 100 in cpu-2026-12-02d; 400 from cpu-2026-12-02f: once its split is tried, a trial at 8 x 1 ran the 100 steps out
# before its pairs of windows (the script's startup is ~20 s of a 34-s plain run)
CLM_STEPS = os.environ.get("CLM_STEPS", "400")


@dataclass
class Case(rs.Case):
    entry: str = ""  # the file that trains (where B's torch.set_num_threads goes)


ACCELERATE = str(BIN / "accelerate")
HF_OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

CASES = {c.name: c for c in [
    Case("chargpt", "karpathy/minGPT projects/chargpt/chargpt.py (mingpt Trainer, AdamW, DataLoader 4 workers)",
         [PY, "projects/chargpt/chargpt.py", "--model.model_type=None", "--model.n_layer=2", "--model.n_head=2",
          "--model.n_embd=64", "--data.block_size=64", "--trainer.device=cpu", "--trainer.max_iters=600"],
         prep_chargpt, env={"PYTHONPATH": "."}, entry="projects/chargpt/chargpt.py",
         notes="code unchanged; input.txt written locally (1 MB of the Python standard library's docstrings) at the "
               "folder's root, the script run from there as `python projects/chargpt/chargpt.py` with PYTHONPATH=. "
               "(for the README's `pip install -e .`: the folder's own mingpt imported, nothing installed); small "
               "model, context and length by its CfgNode flags (--model.model_type=None --model.n_layer=2 "
               "--model.n_head=2 --model.n_embd=64 --data.block_size=64 --trainer.max_iters=600), CPU by "
               "--trainer.device=cpu; its Trainer's num_workers=4, batch 64, pin_memory=True and the sample + "
               "out/chargpt/model.pt every 500 iterations kept"),
    Case("patchtst", "thuml/Time-Series-Library run.py --model PatchTST (long_term_forecast, Adam, 2 workers)",
         [PY, "-u", "run.py", "--task_name", "long_term_forecast", "--is_training", "1", "--root_path",
          "./dataset/ETT-small/", "--data_path", "ETTh1.csv", "--model_id", "ETTh1_96_96", "--model", "PatchTST",
          "--data", "ETTh1", "--features", "M", "--seq_len", "96", "--label_len", "48", "--pred_len", "96",
          "--e_layers", "1", "--d_layers", "1", "--factor", "3", "--enc_in", "7", "--dec_in", "7", "--c_out", "7",
          "--des", "Exp", "--n_heads", "2", "--itr", "1", "--d_model", "128", "--d_ff", "256", "--train_epochs", "1",
          "--num_workers", "2", "--no_use_gpu"],
         prep_patchtst, entry="run.py",
         notes="code unchanged; dataset/ETT-small/ETTh1.csv written locally: ETTh1's columns (date, HUFL, HULL, MUFL, "
               "MULL, LUFL, LULL, OT) and its length, 17,420 hourly rows from 2016-07-01 (Dataset_ETT_hour cuts "
               "train/val/test at fixed rows up to 14,400, so fewer rows cannot run), daily and weekly sines plus "
               "Gaussian noise (numpy seed 0), force-committed (.gitignore lists /dataset/); the flags of "
               "scripts/long_term_forecast/ETT_script/PatchTST_ETTh1.sh's first run, smaller (--d_model 128 --d_ff "
               "256 for 512/2048), one epoch (--train_epochs 1) and the README quick test's --num_workers 2 (the "
               "default is 10), CPU by --no_use_gpu; installed for it from PyPI: pandas, scikit-learn, einops, sktime, "
               "patool, reformer-pytorch, local-attention, datasets (torch left as it was)"),
    Case("clm_no_trainer", "huggingface/transformers examples/pytorch/language-modeling/run_clm_no_trainer.py "
         "(accelerate launch, 1 × 8 accumulation)",
         [ACCELERATE, "launch", "--num_processes", "1", "--cpu", "run_clm_no_trainer.py", "--config_name",
          "tiny-gpt2", "--tokenizer_name", "tiny-gpt2", "--train_file", "train.txt", "--per_device_train_batch_size",
          "1", "--gradient_accumulation_steps", "8", "--max_train_steps", CLM_STEPS, "--block_size", "64",
          "--output_dir", "out"],
         prep_clm_no_trainer, env=HF_OFFLINE, entry="run_clm_no_trainer.py",
         notes="one line changed: `DistributedType.TPU` to `DistributedType.XLA` (accelerate 1.16 has no TPU member: "
               "AttributeError at that line as written), else transformers commit 0419ff881d's (the run_clm.py "
               "case's); under `accelerate launch "
               "--num_processes 1 --cpu` (accelerate 1.16.0, its console script); model from scratch from a local "
               "GPT2Config(n_layer=2, n_embd=64, n_head=2) and a 2000-token byte-level BPE trained locally "
               "(real_scripts.gpt2_folder_code), --train_file 400 kB of stdlib docstrings, --block_size 64, "
               f"--max_train_steps {CLM_STEPS} of 1 × 8 micro-batches, --output_dir out; HF_HUB_OFFLINE=1 "
               "HF_DATASETS_OFFLINE=1; datasets 5.2.0 installed from PyPI; its cache is in ~/.cache (outside the "
               "folder)"),
    Case("time_seq", "pytorch/examples time_sequence_prediction/train.py (LBFGS with a closure)",
         [PY, "train.py", "--steps", "10"],
         prep_time_seq, env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}, entry="train.py",
         notes="train.py unchanged; traindata.pt made by its generate_sine_wave.py with one constant changed, "
               "L = 200 for L = 1000 (100 sine waves of 200 samples, not 1000: one closure evaluation, 97 sequences "
               "through two LSTMCells step by step and back, took 2.4-25 s at 1000 on this machine), committed; "
               "--steps 10 (default 15; each LBFGS step is up to 20 closure evaluations); "
               "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 because its torch.load('traindata.pt') of a "
               "numpy array fails under torch 2.6+'s weights_only default; it writes predict<N>.pdf per step"),
    Case("reinforce", "pytorch/examples reinforcement_learning/reinforce.py (CartPole-v1, Adam per episode)",
         [PY, "reinforce.py"],
         prep_reinforce, entry="reinforce.py",
         notes="code and command unchanged (its README's `python reinforce.py`, seed 543): it trains until the "
               "running reward passes CartPole-v1's threshold of 475; gymnasium 1.4.0 installed from PyPI (its "
               "requirements' gymnasium[classic-control] without pygame: CartPole needs no rendering)"),
]}


# --------------------------------------------------------------------------------------------------------------------
# running


def tmp_entries() -> set[str]:
    with contextlib.suppress(OSError):
        return {p for p in os.listdir("/tmp") if p.startswith(TMP_PREFIXES)}
    return set()


def truncate(path: Path, limit: int = LOG_LIMIT) -> None:
    if path.exists() and path.stat().st_size > limit:
        data = path.read_bytes()
        half = limit // 2
        path.write_bytes(data[:half] + f"\n…[{len(data) - limit} bytes cut]…\n".encode() + data[-half:])


def busy_others() -> list[str]:
    """Processes not of this harness using over 20 % of a core right now (ps's lifetime average): the load."""
    mine = {os.getpid(), os.getppid()}
    rows = subprocess.run(["ps", "-eo", "pid,ppid,pcpu,etimes,args", "--sort=-pcpu"], capture_output=True,
                          text=True).stdout.splitlines()[1:]
    out = []
    for r in rows:
        pid, ppid, pcpu, etimes, args = r.split(None, 4)
        if float(pcpu) < 20 or int(pid) in mine or int(ppid) in mine:
            continue
        out.append(f"{pid} {pcpu}% {etimes}s {args[:120]}")
    return out[:5]


def cores_busy(seconds: float = 3.0) -> float:
    """Cores busy (all processes) over `seconds`, from /proc/stat: called with nothing of ours running."""
    def sample() -> tuple[int, int]:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(f), f[3] + f[4]  # all, idle + iowait
    (a0, i0), _ = sample(), time.sleep(seconds)
    a1, i1 = sample()
    return (os.cpu_count() or 1) * (1 - (i1 - i0) / max(1, a1 - a0))


def wait_quiet(limit_s: float) -> dict[str, Any]:
    """Wait (up to `limit_s`) until other processes keep under 0.25 of a core busy: others' tests share this machine."""
    t0, busy = time.monotonic(), cores_busy()
    while busy > 0.25 and time.monotonic() - t0 < limit_s:
        print(f"   waiting: {busy:.2f} cores busy ({'; '.join(busy_others()) or '?'})", flush=True)
        time.sleep(30)
        busy = cores_busy()
    return {"waited_s": round(time.monotonic() - t0, 1), "cores_busy_at_start": round(busy, 2)}


WAIT_S = 0.0  # set by --wait-quiet


def src_commit(here: Path) -> str:
    """The commit saturate's src/ was at (editable install: each command runs the tree as it is then)."""
    with contextlib.suppress(Exception):
        head = rs.sh(["git", "log", "-1", "--format=%h", "--", "src"], cwd=here).strip()
        dirty = rs.sh(["git", "status", "--porcelain", "src"], cwd=here).strip()
        return head + (" + uncommitted src changes" if dirty else "")
    return "?"


def run_verb(case: Case, verb: str, folder: Path, out: Path, timeout: float) -> dict[str, Any]:
    quiet = wait_quiet(WAIT_S) if WAIT_S else {}
    src = src_commit(Path(__file__).resolve().parent.parent)
    before, load0, others = tmp_entries(), os.getloadavg(), busy_others()
    rec = rs.run_one(case, verb, folder, out, timeout)
    after = tmp_entries()
    rec["tmp_new"], rec["tmp_gone"] = sorted(after - before), sorted(before - after)
    rec["load"] = {"loadavg_before": load0, "loadavg_after": os.getloadavg(), "others_before": others,
                   "others_after": busy_others(), **quiet}
    rec["saturate_src"] = {"before": src, "after": src_commit(Path(__file__).resolve().parent.parent)}
    for s in ("stdout", "stderr"):
        truncate(out / f"{case.name}-{verb}.{s}")
    return rec


def timed(argv: list[str], cwd: Path, env: dict[str, str], timeout: float, log: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    with open(log.with_suffix(".stdout"), "w") as so, open(log.with_suffix(".stderr"), "w") as se:
        p = subprocess.Popen(argv, cwd=cwd, env=env, stdout=so, stderr=se, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            rc = p.wait()
    wall = time.perf_counter() - t0
    for s in (".stdout", ".stderr"):
        truncate(log.with_suffix(s))
    tail = [x for x in log.with_suffix(".stdout").read_text(errors="replace").splitlines() if x.strip()][-2:]
    return {"rc": rc, "wall_s": round(wall, 2), "stdout_tail": tail}


# --- B: the change `run` applied, made by hand


def _offsets(src: bytes) -> list[int]:
    starts, n = [0], 0
    for line in src.splitlines(keepends=True):
        n += len(line)
        starts.append(n)
    return starts


def set_call_keywords(path: Path, names: tuple[str, ...], kwargs: dict[str, Any]) -> int:
    """Every call in `path` whose callee's last name is in `names` given `kwargs` (a keyword it has replaced, else
    added before the closing parenthesis); the number of calls changed."""
    src = path.read_bytes()
    tree = ast.parse(src)
    at = _offsets(src)
    changes: list[tuple[int, int, bytes]] = []
    calls = 0
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in names):
            continue
        calls += 1
        end = at[node.end_lineno - 1] + node.end_col_offset - 1  # the ')'
        inner = src[at[node.lineno - 1] + node.col_offset:end].rstrip()
        for k, v in kwargs.items():
            kw = next((x for x in node.keywords if x.arg == k), None)
            if kw is not None:
                v0 = at[kw.value.lineno - 1] + kw.value.col_offset
                changes.append((v0, at[kw.value.end_lineno - 1] + kw.value.end_col_offset, repr(v).encode()))
            else:
                sep = b"" if inner.endswith((b"(", b",")) else b", "
                changes.append((end, end, sep + f"{k}={v!r}".encode()))
                inner = b","  # the next one added follows this one
    for a, b, text in sorted(changes, key=lambda c: c[0], reverse=True):
        src = src[:a] + text + src[b:]
    if changes:
        path.write_bytes(src)
    return calls


def set_threads_at_top(path: Path, n: int) -> None:
    """`import torch; torch.set_num_threads(n)` as the entry script's first statement (after `from __future__`)."""
    lines = path.read_text().splitlines(keepends=True)
    tree = ast.parse("".join(lines))
    after = max((s.end_lineno for s in tree.body if isinstance(s, ast.ImportFrom) and s.module == "__future__"),
                default=0)
    lines.insert(after, f"import torch; torch.set_num_threads({n})  # B: saturate run's threads override, by hand\n")
    path.write_text("".join(lines))


def b_plan(case: Case, over: dict[str, Any], runs: dict[str, Any], folder: Path, out: Path) -> dict[str, Any]:
    """What B changes, from the overrides `over` (and tune's edit.diff where it holds the same settings)."""
    plan: dict[str, Any] = {"overrides": over, "how": [], "diff": None, "keywords": [], "threads": None, "env": {},
                            "args": [], "not_reproduced": []}
    tj = (runs.get(f"{case.name}/tune") or {}).get("json") or {}
    diff = out / f"{case.name}-tune" / "edit.diff"
    in_diff = ("loader", "optimizer", "train_loader", "flags")
    wanted = {k: over[k] for k in in_diff if over.get(k)}
    tuned = {k: (tj.get("overrides") or {}).get(k) for k in wanted}
    if wanted and diff.exists() and tuned == wanted:
        rs.reset(folder)
        chk = subprocess.run(["git", "apply", "--check", str(diff)], cwd=folder, capture_output=True, text=True)
        if chk.returncode == 0:
            plan["diff"] = str(diff)
            plan["how"].append(f"git apply {diff.name} (tune's, for {', '.join(wanted)})")
            wanted = {}
        else:
            plan["how"].append(f"tune's edit.diff does not apply: {chk.stderr.strip()[:300]}")
    elif wanted:
        plan["how"].append("tune's edit.diff " + ("holds other settings" if diff.exists() else "absent")
                           + f" (tune kept {json.dumps(tuned)})")
    if wanted.get("loader"):
        plan["keywords"].append(["DataLoader", dict(wanted.pop("loader"))])
    if (wanted.get("optimizer") or {}).get("fused"):
        plan["keywords"].append(["Adam|AdamW", {"fused": True}])
        wanted.pop("optimizer")
    if wanted.get("flags"):
        plan["args"] = [f"--{k}={v}" for k, v in wanted.pop("flags").items()]
        plan["how"].append("appended to the command: " + " ".join(plan["args"]))
    for k in wanted:
        plan["not_reproduced"].append(f"{k}: {json.dumps(wanted[k])}")
    for names, kw in plan["keywords"]:
        plan["how"].append(f"{', '.join(f'{k}={v!r}' for k, v in kw.items())} at every {names}(...) call of the "
                           "folder's .py files")
    if over.get("threads"):
        plan["threads"] = over["threads"]
        plan["how"].append(f"`import torch; torch.set_num_threads({over['threads']})` at the top of {case.entry}")
    if over.get("host_alloc"):
        from saturate.engine.host_alloc import child_env  # the thresholds saturate gives a child, as variables
        plan["env"] = child_env(dict(os.environ))
        plan["how"].append("environment " + " ".join(f"{k}={v}" for k, v in plan["env"].items()))
    for k in ("tf32", "bf16_autocast", "compile", "trainer", "lightning"):
        if over.get(k):
            plan["not_reproduced"].append(f"{k}: {json.dumps(over[k])}")
    return plan


def make_b(case: Case, plan: dict[str, Any], folder: Path) -> list[str]:
    rs.reset(folder)
    if plan["diff"]:
        rs.sh(["git", "apply", plan["diff"]], cwd=folder)
    touched = []
    for names, kw in plan["keywords"]:
        for f in rs.sh(["git", "ls-files", "*.py"], cwd=folder).split():
            with contextlib.suppress(SyntaxError):
                if set_call_keywords(folder / f, tuple(names.split("|")), kw):
                    touched.append(f)
    if plan["threads"]:
        set_threads_at_top(folder / case.entry, plan["threads"])
    return touched


def run_ab(case: Case, runs: dict[str, Any], folder: Path, out: Path, timeout: float) -> dict[str, Any]:
    j = (runs.get(f"{case.name}/run") or {}).get("json") or {}
    rec: dict[str, Any] = {"case": case.name, "verb": "ab", "returncode": 0, "timed_out": False, "wall_s": 0.0,
                           "git_status_after": [], "stderr_tail": [], "tmp_new": [], "tmp_gone": []}
    tuned = ((runs.get(f"{case.name}/tune") or {}).get("json") or {}).get("overrides")
    if j.get("applied") and j.get("overrides"):
        over, rec["source"] = j["overrides"], "what run applied"
    elif j and tuned:  # run applied nothing: time what tune kept, said so
        over = tuned
        rec["source"] = (f"tune's kept settings (run applied nothing: {j.get('reason') or j.get('withheld')})")
    else:
        rec["skipped"] = (f"run applied nothing (applied={j.get('applied')}, overrides={json.dumps(j.get('overrides'))}"
                          f"{'; ' + j['reason'] if j.get('reason') else ''}) and tune kept nothing"
                          if j else "no run record")
        return rec
    plan = b_plan(case, over, runs, folder, out)
    rec["plan"] = plan
    if plan["not_reproduced"]:
        rec["note"] = "B lacks " + "; ".join(plan["not_reproduced"])
    if not (plan["diff"] or plan["keywords"] or plan["threads"] or plan["env"] or plan["args"]):
        rec["skipped"] = "nothing of what run applied could be made by hand: " + "; ".join(plan["not_reproduced"])
        return rec
    before, t0 = tmp_entries(), time.perf_counter()
    rec["load"] = {"loadavg_before": os.getloadavg(), "others_before": busy_others()}
    rounds: list[dict[str, Any]] = []
    for i, kind in enumerate(AB_ORDER):
        argv = list(case.command)
        env = {**os.environ, **case.env}
        if kind == "B":
            touched = make_b(case, plan, folder)
            rec.setdefault("b_diff", rs.sh(["git", "diff"], cwd=folder)[:6000])
            rec.setdefault("b_files", touched)
            argv += plan["args"]
            env.update(plan["env"])
        else:
            rs.reset(folder)
        quiet = wait_quiet(WAIT_S) if WAIT_S else {}
        r = timed(argv, folder, env, timeout, out / f"{case.name}-ab-{i + 1}{kind}.log")
        r["kind"] = kind
        r["loadavg_after"], r["others_after"] = os.getloadavg(), busy_others()
        r.update(quiet)
        rounds.append(r)
        print(f"   ab {i + 1}{kind}: rc={r['rc']} {r['wall_s']} s", flush=True)
        rs.reset(folder)
    rec["rounds"] = rounds
    a = [r["wall_s"] for r in rounds if r["kind"] == "A"]
    b = [r["wall_s"] for r in rounds if r["kind"] == "B"]
    ratios = [x / y for x, y in zip(a, b, strict=True)]  # pairs in order: (A1, B2), (A4, B3), (A5, B6)
    rec["ratios"] = [round(x, 3) for x in ratios]
    rec["ab"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": len(ratios)}
    rec["returncode"] = max(r["rc"] for r in rounds)
    rec["wall_s"] = round(time.perf_counter() - t0, 1)
    after = tmp_entries()
    rec["tmp_new"], rec["tmp_gone"] = sorted(after - before), sorted(before - after)
    rec["command"] = " ".join(case.command).replace(PY, "python")
    return rec


# --------------------------------------------------------------------------------------------------------------------
# the table


def saturate_ratio(rec: dict[str, Any]) -> str:
    return rs.summarize(rec)["ratio"] if rec.get("json") else "—"


def ab_cell(rec: dict[str, Any] | None) -> str:
    if rec is None:
        return "not run"
    if rec.get("skipped"):
        return "— (" + rec["skipped"].split(";")[0] + (")" if "(" in rec["skipped"].split(";")[0] else "") + (
            "; tune kept nothing)" if rec["skipped"].endswith("tune kept nothing") else ")")
    ab = rec["ab"]
    s = (f"{ab['median']:.2f}× [{ab['min']:.2f}, {ab['max']:.2f}] (A/B per pair {rec['ratios']}; A "
         f"{[r['wall_s'] for r in rec['rounds'] if r['kind'] == 'A']} s, B "
         f"{[r['wall_s'] for r in rec['rounds'] if r['kind'] == 'B']} s; B = {'; '.join(rec['plan']['how'])}; "
         f"of {rec.get('source', 'what run applied')})")
    if rec.get("note"):
        s += f"; {rec['note']}"
    if rec["returncode"]:
        s += f"; a round exited {rec['returncode']}"
    return s


def tmp_cell(rec: dict[str, Any]) -> str:
    new = rec.get("tmp_new") or []
    if not new:
        return "clean"
    logs = all(x.startswith("saturate-trials-") for x in new)
    return "NEW: " + ", ".join(new) + (" (its trial logs, kept by design: script/scratch.py)" if logs else "")


def load_cell(rec: dict[str, Any]) -> str:
    ld = rec.get("load")
    if not ld:
        return "not recorded"
    after = ld.get("loadavg_after") or (rec.get("rounds") or [{}])[-1].get("loadavg_after")
    others = sorted({" ".join(x.split()[4:7]) for x in ld.get("others_before", []) + ld.get("others_after", [])})
    return (f"{ld['loadavg_before'][0]:.1f}→{after[0]:.1f}" if after else f"{ld['loadavg_before'][0]:.1f}") + (
        "; others: " + ", ".join(others) if others else "")


def table(out: Path) -> str:
    data = rs.load(out)
    runs = data["runs"]
    m = data.get("machine", {})
    lines = [f"# `saturate doctor|tune|run -- CMD` on five more public training scripts ({data.get('date', '?')})", "",
             f"Machine: {m.get('cpu')}, {m.get('vcpus')} vCPUs, torch {m.get('torch')}, Python {m.get('python')}; "
             "no GPU; nothing else of ours ran during the commands.", "",
             f"saturate: {data.get('saturate', '?')}, run as `python -m saturate …` from each script's folder; every "
             "command bounded at 900 s; the folder reset to its commit before and after each; 'folder' is `git "
             "status --porcelain --ignored` right after the command; '/tmp' lists pymp-*, saturate-*, torchelastic_* "
             "entries that were not there before it. Under `run`, 'A/B by hand' is the script as written against "
             "the change `run` applied made by hand, plain runs alternating A B B A A B, the median of the three "
             "A/B wall-time ratios [min, max].", "",
             "| script | verb | rc, wall | outcome / verdict | fix or edit line | overrides | saturate's ratio | "
             "A/B by hand | folder | /tmp | load (1-min average) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in CASES:
        plain = runs.get(f"{name}/plain")
        keys = [f"{name}/{v}" for v in VERBS[:4]] + sorted((k for k in runs if k.startswith(f"{name}/") and "@" in k
                                                             and not k.split("/")[1].startswith("ab")),
                                                            key=lambda k: VERBS.index(k.split("/")[1].split("@")[0]))
        for key in keys:
            verb = key.split("/", 1)[1]
            rec = runs.get(key)
            if rec is None:
                lines.append(f"| {name} | {verb} | not run | | | | | | | | |")
                continue
            s = rs.summarize(rec)
            ab = ab_cell(runs.get(f"{name}/ab")) if verb == "run" else ""
            if "@" in verb:
                verb = f"{verb.split('@')[0]} (superseded: {rec.get('note') or 'src ' + verb.split('@')[1]})"
            lines.append(f"| {name} | {verb} | {rec['returncode']}{' (timeout)' if rec['timed_out'] else ''}, "
                         f"{rec['wall_s']} s | {rs.cell(s['outcome'], 400)} | {rs.cell(s['fix'], 300)} | "
                         f"{rs.cell(s['overrides'])} | {rs.cell(s['ratio'])} | {rs.cell(ab, 600)} | "
                         f"{rs.cell(rs.files_left(rec, plain), 300)} | {rs.cell(tmp_cell(rec))} | "
                         f"{rs.cell(load_cell(rec))} |")
        ab = runs.get(f"{name}/ab")
        if ab and not ab.get("skipped"):
            lines.append(f"| {name} | ab | {ab['returncode']}, {ab['wall_s']} s | 6 plain runs | | | | "
                         f"{rs.cell(ab_cell(ab), 600)} | {rs.cell(rs.files_left(ab, plain), 300)} | "
                         f"{rs.cell(tmp_cell(ab))} | {rs.cell(load_cell(ab))} |")
    lines += ["", "## Scripts, sources and adaptations", ""]
    for name, c in CASES.items():
        lines.append(f"* **{name}** — {c.script} @ {data.get('sources', {}).get(name, '?')}: {c.notes}.")
    lines += ["", "## Exact commands (run in each script's folder)", ""]
    for name in CASES:
        for verb in VERBS[:4]:
            rec = runs.get(f"{name}/{verb}")
            if rec:
                lines.append(f"* {name}/{verb}: `{rec['command']}` — rc {rec['returncode']}, {rec['wall_s']} s")
    obs = out / "observations.md"
    if obs.exists():
        lines += ["", obs.read_text().rstrip()]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["prepare", "run", "table"])
    ap.add_argument("--root", type=Path, default=Path("/tmp/public"))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu-public")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--verbs", default=",".join(VERBS))
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--wait-quiet", type=float, default=0, metavar="S",
                    help="before each command, wait up to S seconds for the other processes to leave the CPUs")
    ap.add_argument("--mingpt-git", type=Path, default=MIRRORS / "karpathy+minGPT" / "repo")
    ap.add_argument("--tsl-git", type=Path, default=MIRRORS / "thuml+Time-Series-Library" / "repo")
    ap.add_argument("--examples-git", type=Path, default=MIRRORS / "pytorch+examples" / "repo")
    ap.add_argument("--transformers-git", type=Path, default=MIRRORS / "feisenyu+transformers_4573" / "repo")
    ap.add_argument("--transformers-commit", default="0419ff881d")
    a = ap.parse_args()
    global WAIT_S
    WAIT_S = a.wait_quiet
    a.out = a.out.resolve()
    cases = [CASES[c] for c in a.cases.split(",") if c]
    a.out.mkdir(parents=True, exist_ok=True)
    data = rs.load(a.out)
    if a.action == "prepare":
        for c in cases:
            dest = a.root / c.name
            if (dest / ".git").exists():
                print(f"{c.name}: {dest} exists, kept")
                continue
            data.setdefault("sources", {})[c.name] = c.prepare(dest, a)
            print(f"{c.name}: prepared in {dest} ({data['sources'][c.name]})")
        rs.save(a.out, data)
        return 0
    if a.action == "run":
        data["date"] = time.strftime("%Y-%m-%d")
        data["machine"] = rs.machine()
        here = Path(__file__).resolve().parent.parent
        with contextlib.suppress(Exception):
            data["saturate"] = "commit " + rs.sh(["git", "rev-parse", "--short", "HEAD"], cwd=here).strip() + (
                " + uncommitted changes" if rs.sh(["git", "status", "--porcelain", "src"], cwd=here).strip() else "")
        for c in cases:
            for verb in a.verbs.split(","):
                print(f"{time.strftime('%H:%M:%S')} {c.name} {verb} …", flush=True)
                folder = a.root / c.name
                if verb == "ab":
                    rec = run_ab(c, data["runs"], folder, a.out, a.timeout)
                else:
                    rec = run_verb(c, verb, folder, a.out, a.timeout)
                data["runs"][f"{c.name}/{verb}"] = rec
                rs.save(a.out, data)
                print(f"   rc={rec['returncode']} {rec['wall_s']} s left={rec['git_status_after']} "
                      f"tmp+={rec['tmp_new']}{' ' + rec['skipped'] if rec.get('skipped') else ''}", flush=True)
    (a.out / "table.md").write_text(table(a.out))
    print((a.out / "table.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
