"""Five well-known public training scripts under `saturate doctor|tune|run -- CMD`, run as their authors wrote them
(only what running offline on a CPU needs is changed; each change is listed in CASES[...].notes).

Each script gets a working copy in its own git repository under --root (default /tmp/real), prepared data
committed (force-added where the project's .gitignore lists it), so `git status --porcelain --ignored` after a
command shows exactly what that command left. For every script, four commands, the folder reset to its commit
(`git clean -fdx` + `git checkout .`) before each:

* plain: the command itself — wall time and the files it left (the reference for `saturate run`);
* doctor: `saturate doctor --json -- CMD` — verdict, first fix line, syncs and their sites, phases; must leave nothing;
* tune: `saturate tune --json --trial-steps 4 --trial-seconds 3 --out LOGDIR -- CMD` — overrides, edits, ratio;
  must leave nothing (--out keeps tune's own overrides.json/tune.json with the logs, not in the script's folder);
* run: `saturate run --json --trial-steps 4 --trial-seconds 3 -- CMD` — applied overrides, side-by-side ratio,
  full-run steps; must leave what the plain run left.

Every command is bounded by --timeout (900 s). Logs: OUT/<case>-<verb>.stdout|.stderr; OUT/results.json (merged
across invocations, so one case can be rerun); OUT/table.md.

    python bench/real_scripts.py prepare                       # fetch-free: reads the mirrors given below
    PYTHONPATH=src python bench/real_scripts.py run --out bench/results/cpu-2026-11-26-real
    PYTHONPATH=src python bench/real_scripts.py run --cases nanogpt --verbs plain,doctor --out ...
    python bench/real_scripts.py table --out bench/results/cpu-2026-11-26-real
    PYTHONPATH=src python bench/real_scripts.py run --condition bursty --seed 0 --verbs doctor,tune,run --out ...

--condition starts the shared seeded neighbour (../shared/tools/neighbour.py) in its own session for the whole run
of the commands, so every verb meets the same load profile; `quiet` (the default) starts none.

The sources are bare git directories (as the `fetch` tool or `git clone --bare` leaves them):
--nanogpt-git (karpathy/nanoGPT), --examples-git (pytorch/examples), --lightning-git (Lightning-AI/pytorch-lightning),
--transformers-git + --transformers-commit (a huggingface/transformers history holding run_clm.py at that commit).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PY = sys.executable
MIRRORS = Path("/work/.mirror")
TRIAL = ["--trial-steps", "4", "--trial-seconds", "3"]
VERBS = ("plain", "doctor", "tune", "run")


# --------------------------------------------------------------------------------------------------------------------
# preparation


def sh(cmd: list[str] | str, cwd: Path | None = None, **kw: Any) -> str:
    shell = isinstance(cmd, str)
    return subprocess.run(cmd, cwd=cwd, shell=shell, check=True, text=True, capture_output=True, **kw).stdout


def export(git_dir: Path, rev: str, paths: list[str], dest: Path, strip: str = "") -> None:
    """`git archive` of `paths` at `rev` into dest, the leading `strip` folder removed."""
    dest.mkdir(parents=True, exist_ok=True)
    n = strip.rstrip("/").count("/") + 1 if strip else 0
    arch = subprocess.run(["git", "--git-dir", str(git_dir), "archive", rev, *paths], check=True, capture_output=True)
    subprocess.run(["tar", "-x", f"--strip-components={n}", "-C", str(dest)], input=arch.stdout, check=True)


def commit_all(folder: Path, message: str, force: list[str] = ()) -> None:
    if not (folder / ".git").exists():
        sh(["git", "init", "-q"], cwd=folder)
    sh(["git", "add", "-A"], cwd=folder)
    if force:
        sh(["git", "add", "-f", *force], cwd=folder)
    sh(["git", "-c", "user.name=bench", "-c", "user.email=bench@local", "commit", "-qm", message], cwd=folder)


def english_text(n_chars: int) -> str:
    """~English prose found on every machine: the docstrings of the Python standard library, in a fixed order."""
    std = Path(sysconfig.get_paths()["stdlib"])
    out, n = [], 0
    for p in sorted(std.rglob("*.py")):
        if "test" in p.parts or "site-packages" in p.parts:
            continue
        try:
            tree = ast.parse(p.read_text())
        except Exception:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                d = ast.get_docstring(node)
                if d and len(d) > 80:
                    out.append(d)
                    n += len(d)
        if n > n_chars:
            break
    return "\n\n".join(out)[:n_chars]


def rev(git_dir: Path, r: str = "HEAD") -> str:
    return sh(["git", "--git-dir", str(git_dir), "rev-parse", "--short", r]).strip()


def prep_nanogpt(dest: Path, a: argparse.Namespace) -> str:
    export(a.nanogpt_git, "HEAD", [], dest)
    d = dest / "data" / "shakespeare_char"
    (d / "input.txt").write_text(english_text(1_100_000))  # prepare.py downloads only when input.txt is missing
    sh([PY, "prepare.py"], cwd=d)
    commit_all(dest, f"nanoGPT {rev(a.nanogpt_git)} + offline data",
               force=[f"data/shakespeare_char/{f}" for f in ("input.txt", "train.bin", "val.bin", "meta.pkl")])
    return rev(a.nanogpt_git)


def gpt2_folder_code(folder: str, context: int, shape: str) -> str:
    """Python that trains a 2000-token byte-level BPE on ./train.txt and saves it with a GPT-2 config of `shape`
    ("n_layer=2, n_embd=64, n_head=2") as a local Transformers folder (also bench/peers.py's)."""
    return f"""
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import GPT2Config, PreTrainedTokenizerFast
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train(["train.txt"], trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|endoftext|>"],
          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                               unk_token="<|endoftext|>", model_max_length={context})
fast.save_pretrained("{folder}")
GPT2Config({shape}, n_positions={context}, vocab_size=len(fast), bos_token_id=fast.bos_token_id,
           eos_token_id=fast.eos_token_id).save_pretrained("{folder}")
"""


def prep_clm(dest: Path, a: argparse.Namespace) -> str:
    dest.mkdir(parents=True, exist_ok=True)
    src = sh(["git", "--git-dir", str(a.transformers_git), "show",
              f"{a.transformers_commit}:examples/pytorch/language-modeling/run_clm.py"])
    (dest / "run_clm.py").write_text(src)
    text = english_text(400_000)
    (dest / "train.txt").write_text(text)
    subprocess.run([PY, "-c", gpt2_folder_code("tiny-gpt2", 1024, "n_layer=2, n_embd=64, n_head=2")], cwd=dest,
                   check=True, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    commit_all(dest, f"run_clm.py at transformers {a.transformers_commit[:10]} + tiny GPT-2 config/tokenizer + text")
    return a.transformers_commit[:10]


WT2 = "word_language_model/data/wikitext-2"


def wikitext2_train(examples_git: Path) -> bytes:
    """pytorch/examples' wikitext-2 train.txt (10 MB), or — where the snapshot lacks that blob, as the fetched one
    does — its valid.txt followed by its test.txt (2.4 MB, the same corpus's text)."""
    got = subprocess.run(["git", "--git-dir", str(examples_git), "show", f"HEAD:{WT2}/train.txt"], capture_output=True)
    if got.returncode == 0:
        return got.stdout
    return b"".join(subprocess.run(["git", "--git-dir", str(examples_git), "show", f"HEAD:{WT2}/{f}"], check=True,
                                   capture_output=True).stdout for f in ("valid.txt", "test.txt"))


def prep_wlm(dest: Path, a: argparse.Namespace) -> str:
    export(a.examples_git, "HEAD", [f"word_language_model/{f}" for f in ("main.py", "data.py", "model.py",
           "generate.py", "README.md", "requirements.txt", "data/wikitext-2/README", "data/wikitext-2/valid.txt",
           "data/wikitext-2/test.txt")], dest, strip="word_language_model")
    (dest / "data" / "wikitext-2" / "train.txt").write_bytes(wikitext2_train(a.examples_git))
    commit_all(dest, f"pytorch/examples {rev(a.examples_git)} word_language_model (train.txt: see notes)")
    return rev(a.examples_git)


LIGHTNING_EDITS = [
    ("self.model = Transformer(vocab_size=vocab_size)",
     "self.model = Transformer(vocab_size=vocab_size, ninp=64, nhid=64)"),
    ("trainer = L.Trainer(gradient_clip_val=0.25, max_epochs=20)",
     "trainer = L.Trainer(gradient_clip_val=0.25, max_epochs=1, limit_train_batches=300, limit_val_batches=10,\n"
     "                        limit_test_batches=10)"),
]


def apply_edits(path: Path, edits: list[tuple[str, str]]) -> None:
    """The offline/CPU adaptations of a fetched script, each one replacing text that must be there."""
    text = path.read_text()
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    path.write_text(text)


def prep_lightning(dest: Path, a: argparse.Namespace) -> str:
    export(a.lightning_git, "HEAD", ["examples/pytorch/basics/transformer.py"], dest, strip="examples/pytorch/basics")
    commit_all(dest, f"Lightning {rev(a.lightning_git)} examples/pytorch/basics/transformer.py as is")
    apply_edits(dest / "transformer.py", LIGHTNING_EDITS)
    # WikiText2() downloads pytorch/examples' word_language_model/data/wikitext-2/train.txt to ./data/wikitext-2.txt
    # unless the file is there
    (dest / "data").mkdir(exist_ok=True)
    (dest / "data" / "wikitext-2.txt").write_bytes(wikitext2_train(a.examples_git))
    commit_all(dest, "small model, 300 steps, 10 val/test batches; WikiText2's file placed in ./data")
    return rev(a.lightning_git)


DDP_EDITS = [
    ("    torch.cuda.set_device(int(os.environ[\"LOCAL_RANK\"]))\n    init_process_group(backend=\"nccl\")",
     "    init_process_group(backend=\"gloo\")"),
    ("self.model = model.to(self.gpu_id)", "self.model = model"),
    ("self.model = DDP(self.model, device_ids=[self.gpu_id])", "self.model = DDP(self.model)"),
    ("loc = f\"cuda:{self.gpu_id}\"", "loc = \"cpu\""),
    ("            source = source.to(self.gpu_id)\n            targets = targets.to(self.gpu_id)\n", ""),
]


def prep_ddp(dest: Path, a: argparse.Namespace) -> str:
    base = "distributed/ddp-tutorial-series"
    export(a.examples_git, "HEAD", [f"{base}/multigpu_torchrun.py", f"{base}/datautils.py"], dest, strip=base)
    commit_all(dest, f"pytorch/examples {rev(a.examples_git)} ddp-tutorial-series as is")
    apply_edits(dest / "multigpu_torchrun.py", DDP_EDITS)
    commit_all(dest, "CPU: gloo backend, no set_device/.to(gpu_id)/device_ids, snapshot mapped to cpu")
    return rev(a.examples_git)


# --------------------------------------------------------------------------------------------------------------------
# the five


@dataclass
class Case:
    name: str
    script: str
    command: list[str]
    prepare: Callable[[Path, argparse.Namespace], str]
    env: dict[str, str] = field(default_factory=dict)
    notes: str = ""


CASES = {c.name: c for c in [
    Case("nanogpt", "karpathy/nanoGPT train.py + config/train_shakespeare_char.py",
         [PY, "train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--n_layer=2",
          "--n_head=2", "--n_embd=64", "--block_size=64", "--batch_size=8", "--max_iters=300", "--eval_interval=100",
          "--eval_iters=5", "--log_interval=50"],
         prep_nanogpt,
         notes="code unchanged; data/shakespeare_char/input.txt written locally (1.1 MB of the Python standard "
               "library's docstrings) so prepare.py (unchanged) skips its download; small model and CPU by command-"
               "line flags; prepared data force-committed (nanoGPT's .gitignore lists *.bin, *.pkl, input.txt)"),
    Case("run_clm", "huggingface/transformers examples/pytorch/language-modeling/run_clm.py (Trainer)",
         [PY, "run_clm.py", "--config_name", "tiny-gpt2", "--tokenizer_name", "tiny-gpt2", "--train_file",
          "train.txt", "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "8", "--max_steps",
          "200", "--output_dir", "out", "--do_train", "--block_size", "64", "--use_cpu"],
         prep_clm, env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
         notes="code unchanged (the newest upstream run_clm.py in the fetched history, transformers commit 0419ff881d "
               "of 2025-10-09, check_min_version 4.57.0.dev0; installed transformers is 5.24.0); model from scratch "
               "from a local GPT2Config(n_layer=2, n_embd=64, n_head=2) and a 2000-token byte-level BPE trained locally "  # noqa: E501
               "(tokenizers) saved with PreTrainedTokenizerFast; --train_file 400 kB of stdlib docstrings; "
               "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1; datasets' cache is in ~/.cache (outside the folder)"),
    Case("word_lm", "pytorch/examples word_language_model/main.py (manual p.data.add_ update)",
         [PY, "main.py", "--emsize", "32", "--nhid", "32", "--epochs", "1"],
         prep_wlm,
         notes="unchanged, its bundled wikitext-2, except that the fetched snapshot lacks train.txt's 10 MB blob: "
               "train.txt is its valid.txt followed by its test.txt; CPU is its default (no --accel); no --use-optimizer, so "  # noqa: E501
               "weights are updated by hand (p.data.add_) with no torch.optim step"),
    Case("word_lm_adamw", "pytorch/examples word_language_model/main.py --model Transformer --use-optimizer",
         [PY, "main.py", "--model", "Transformer", "--use-optimizer", "--lr", "0.001", "--emsize", "32", "--nhid",
          "32", "--epochs", "1"],
         prep_wlm,
         notes="as word_lm, run as its README's AdamW line (`--model Transformer --use-optimizer --lr 0.001`, "
               "without --accel: the CPU), smaller: AdamW (not fused) steps the weights"),
    Case("lightning", "Lightning-AI/pytorch-lightning examples/pytorch/basics/transformer.py",
         [PY, "transformer.py"],
         prep_lightning, env={"PL_DISABLE_FORK": "1"},
         notes="two edits: Transformer(..., ninp=64, nhid=64) and Trainer(max_epochs=1, limit_train_batches=300, "
               "limit_val_batches=10, limit_test_batches=10) in place of max_epochs=20; WikiText2's download "
               "(pytorch/examples' wikitext-2 train.txt; absent from the fetched snapshot, so its valid.txt + test.txt) placed at ./data/wikitext-2.txt so it is skipped; "  # noqa: E501
               "PL_DISABLE_FORK=1"),
    Case("ddp", "pytorch/examples distributed/ddp-tutorial-series/multigpu_torchrun.py (torchrun, 2 processes)",
         [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "multigpu_torchrun.py", "100",
          "10"],
         prep_ddp,
         notes="CPU: gloo for nccl, no torch.cuda.set_device, no .to(gpu_id) for model and batches, DDP without "
               "device_ids, snapshot loaded with map_location='cpu'; snapshot.pt every 10 epochs and resume-from-"
               "snapshot kept; 100 epochs of 32 steps per rank; `torchrun` invoked as python -m torch.distributed.run"),
]}


# --------------------------------------------------------------------------------------------------------------------
# running


def git_status(folder: Path) -> list[str]:
    return [x for x in sh(["git", "status", "--porcelain", "--ignored"], cwd=folder).splitlines() if x.strip()]


def reset(folder: Path) -> None:
    sh(["git", "clean", "-fdxq"], cwd=folder)
    sh(["git", "checkout", "-q", "."], cwd=folder)
    left = git_status(folder)
    assert not left, f"{folder} not clean after reset: {left}"


def saturate_argv(verb: str, case: Case, out: Path) -> list[str]:
    base = [PY, "-m", "saturate", verb, "--json"]
    if verb == "tune":
        base += TRIAL + ["--out", str(out / f"{case.name}-tune")]
    elif verb == "run":
        base += TRIAL
    return base + ["--", *case.command]


def run_one(case: Case, verb: str, folder: Path, out: Path, timeout: float) -> dict[str, Any]:
    reset(folder)
    argv = case.command if verb == "plain" else saturate_argv(verb, case, out)
    env = {**os.environ, **case.env}
    stdout_p, stderr_p = out / f"{case.name}-{verb}.stdout", out / f"{case.name}-{verb}.stderr"
    t0 = time.perf_counter()
    timed_out = False
    with open(stdout_p, "w") as so, open(stderr_p, "w") as se:
        p = subprocess.Popen(argv, cwd=folder, env=env, stdout=so, stderr=se, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(p.pid, 15)
            try:
                rc = p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                rc = p.wait()
    wall = time.perf_counter() - t0
    rec: dict[str, Any] = {
        "case": case.name, "verb": verb, "cwd": str(folder),
        "command": " ".join(f"{k}={v}" for k, v in case.env.items()) + (" " if case.env else "")
        + " ".join(shlex.quote(x.replace(PY, "python")) for x in argv),
        "returncode": rc, "timed_out": timed_out, "wall_s": round(wall, 1), "git_status_after": git_status(folder),
        "stderr_tail": stderr_p.read_text(errors="replace").splitlines()[-15:],
    }
    if verb == "plain":
        rec["stdout_tail"] = stdout_p.read_text(errors="replace").splitlines()[-8:]
    else:
        text = stdout_p.read_text(errors="replace")
        try:
            rec["json"] = json.loads(text[text.index("{"):]) if "{" in text else None
        except ValueError as e:
            rec["json"] = None
            rec["json_error"] = f"{e}; stdout head: {text[:300]!r}"
    reset(folder)
    return rec


def machine() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(Exception):
        cpu = next(x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                   if x.startswith("model name"))
    import torch
    return {"cpu": cpu, "vcpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform()}


def load(out: Path) -> dict[str, Any]:
    p = out / "results.json"
    return json.loads(p.read_text()) if p.exists() else {"runs": {}}


def save(out: Path, data: dict[str, Any]) -> None:
    (out / "results.json").write_text(json.dumps(data, indent=1, default=str))


# --------------------------------------------------------------------------------------------------------------------
# the table


def fmt_ratio(d: dict[str, Any] | None) -> str:
    if not d:
        return "—"
    if isinstance(d.get("text"), str):
        return d["text"]
    r = next((d[k] for k in ("median", "ratio", "speedup") if isinstance(d.get(k), (int, float))), None)
    lo = next((d[k] for k in ("min", "low", "lo") if isinstance(d.get(k), (int, float))), None)
    hi = next((d[k] for k in ("max", "high", "hi") if isinstance(d.get(k), (int, float))), None)
    if isinstance(r, (int, float)):
        s = f"{r:.2f}×"
        if isinstance(lo, (int, float)) and isinstance(hi, (int, float)):
            s += f" [{lo:.2f}, {hi:.2f}]"
        extra = [f"{k} {d[k]}" for k in ("verdict", "rounds", "pairs") if k in d]
        return s + (f" ({', '.join(extra)})" if extra else "")
    return json.dumps(d)[:80]


def cell(s: Any, n: int = 160) -> str:
    s = str(s).replace("|", "\\|").replace("\n", " ")
    return s if len(s) <= n else s[: n - 1] + "…"


def files_left(rec: dict[str, Any], plain: dict[str, Any] | None) -> str:
    left = rec.get("git_status_after") or []
    if rec["verb"] == "plain":
        return "; ".join(left) or "nothing"
    if rec["verb"] == "run" and plain is not None:
        if rec["returncode"] != 0 and not rec.get("json"):
            return (("nothing" if not left else "; ".join(left)) + " (stopped before any full run; the plain run left "
                    + ("; ".join(plain.get("git_status_after") or []) or "nothing") + ")")
        same = sorted(left) == sorted(plain.get("git_status_after") or [])
        return ("same as plain: " if same else "DIFFERS from plain: ") + ("; ".join(left) or "nothing")
    return ("clean" if not left else "LEFT: " + "; ".join(left))


def summarize(rec: dict[str, Any]) -> dict[str, str]:
    """outcome, fix/edit, overrides, ratio for one record (verb-specific JSON fields)."""
    j = rec.get("json") or {}
    lines = [x for x in rec.get("stderr_tail") or [] if x.strip()]
    tail = next((x for x in reversed(lines) if x.startswith("saturate")), lines[-1] if lines else "")
    status = "" if rec["returncode"] == 0 else f"rc={rec['returncode']}{' (timeout)' if rec['timed_out'] else ''}: "
    v = rec["verb"]
    if v == "plain":
        return {"outcome": f"{status or 'ok, '}{rec['wall_s']} s", "fix": "", "overrides": "", "ratio": ""}
    if not j:
        return {"outcome": f"{status}{tail}", "fix": "", "overrides": "", "ratio": ""}
    if v == "doctor":
        m = j.get("measurements") or {}
        fixes = j.get("fixes") or []
        fix = fixes[0].get("title", "") if fixes else "(no fix)"
        step = m.get("step_s") or 0
        phases = ", ".join(f"{k} {100 * x / step:.0f}%" for k, x in (m.get("phases") or {}).items()
                           if step and x / step >= 0.005)
        written = (j.get("script") or {}).get("written")
        out = (f"{status}{j.get('verdict')}; {m.get('steps')} steps of {1000 * step:.1f} ms: {phases}; "
               f"syncs/step {m.get('syncs_per_step')}, sites {json.dumps(m.get('syncs_by_site'))}"
               + (f"; its writes: {json.dumps(written)}" if written else ""))
        return {"outcome": out, "fix": fix, "overrides": "", "ratio": ""}
    if v == "tune":
        trials = j.get("trials") or []
        conf = j.get("confirmation")
        if conf:
            ratio = "confirmation " + fmt_ratio(conf)
        elif len(trials) > 1:
            ratio = "best trial " + fmt_ratio({"ratio": j.get("speedup")}) + " (unconfirmed)"
        else:
            ratio = "— (only the script as written ran)"
        return {"outcome": f"{status}{'kept' if j.get('overrides') else 'nothing kept'}; {len(trials)} trial(s)"
                           + ("" if j.get("paired") else f"; not paired: {j.get('not_paired_because')}"),
                "fix": "; ".join(j.get("edits") or []) or "(no edit)", "overrides": json.dumps(j.get("overrides")),
                "ratio": ratio}
    full = j.get("full_run") or {}
    secs = full.get("seconds")
    return {"outcome": f"{status}applied={j.get('applied')}; full run rc={full.get('returncode')}, "
                       f"{full.get('optimizer_steps')} optimizer steps in "
                       f"{secs if not isinstance(secs, float) else round(secs, 1)} s"
                       + (f"; {j['reason']}" if j.get("reason") else ""),
            "fix": "", "overrides": json.dumps(j.get("overrides")),
            "ratio": "side by side " + fmt_ratio(j["side_by_side"]) if (j.get("side_by_side") or {}).get("text")
            else fmt_ratio(j.get("speedup"))}


CONDITION_TEXT = {
    "quiet": "Load: none started (quiet; nothing else of ours ran on the machine).",
    **{p: f"Load: the shared neighbour, profile `{p}`, started for the whole run of the commands (seed in "
          "results.json)." for p in ("bursty", "steady", "spiky")},
}


def table(out: Path) -> str:
    data = load(out)
    runs = data["runs"]
    lines = [f"# `saturate doctor|tune|run -- CMD` on five public training scripts ({data.get('date', '?')})", "",
             f"Machine: {data.get('machine', {}).get('cpu')}, {data.get('machine', {}).get('vcpus')} vCPUs, "
             f"torch {data.get('machine', {}).get('torch')}, Python {data.get('machine', {}).get('python')}; no GPU. "
             + CONDITION_TEXT.get(data.get("condition", ""), "Load: not recorded."), "",
             f"saturate: {data.get('saturate', '?')}, run as `PYTHONPATH=<worktree>/src python -m saturate …` from "
             "each script's folder; every command bounded at 900 s; the folder reset to its commit "
             "(`git clean -fdx`, `git checkout .`) before and after each; 'files left' is `git status --porcelain "
             "--ignored` right after the command.", "",
             "| script | verb | outcome/verdict | fix or edit line | overrides | measured ratio (interval) | "
             "files left vs plain run |", "|---|---|---|---|---|---|---|"]
    for name in CASES:
        plain = runs.get(f"{name}/plain")
        for verb in VERBS:
            rec = runs.get(f"{name}/{verb}")
            if rec is None:
                continue
            s = summarize(rec)
            lines.append(f"| {name} | {verb} | {cell(s['outcome'], 400)} | {cell(s['fix'], 300)} | "
                         f"{cell(s['overrides'])} | {cell(s['ratio'])} | {cell(files_left(rec, plain), 300)} |")
    lines += ["", "## Scripts, sources and adaptations", ""]
    for name, c in CASES.items():
        src = data.get("sources", {}).get(name, "?")
        lines.append(f"* **{name}** — {c.script} @ {src}: {c.notes}.")
    lines += ["", "## Exact commands (run in each script's folder)", ""]
    for name in CASES:
        for verb in VERBS:
            rec = runs.get(f"{name}/{verb}")
            if rec:
                lines.append(f"* {name}/{verb}: `{rec['command']}` — rc {rec['returncode']}, {rec['wall_s']} s")
    obs = out / "observations.md"  # written by hand after reading the logs
    if obs.exists():
        lines += ["", obs.read_text().rstrip()]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["prepare", "run", "table"])
    ap.add_argument("--root", type=Path, default=Path("/tmp/real"))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu-real")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--verbs", default=",".join(VERBS))
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--condition", choices=["quiet", "bursty", "steady", "spiky"], default="quiet")
    ap.add_argument("--seed", type=int, default=0, help="the neighbour's seed (with --condition other than quiet)")
    ap.add_argument("--nanogpt-git", type=Path, default=MIRRORS / "karpathy+nanoGPT" / "repo")
    ap.add_argument("--examples-git", type=Path, default=MIRRORS / "pytorch+examples" / "repo")
    ap.add_argument("--lightning-git", type=Path, default=MIRRORS / "Lightning-AI+pytorch-lightning" / "repo")
    ap.add_argument("--transformers-git", type=Path, default=MIRRORS / "feisenyu+transformers_4573" / "repo")
    ap.add_argument("--transformers-commit", default="0419ff881d",
                    help="an upstream commit (Remove `local_rank` arg from `TrainingArguments`, #41382)")
    a = ap.parse_args()
    a.out = a.out.resolve()
    cases = [CASES[c] for c in a.cases.split(",") if c]
    a.out.mkdir(parents=True, exist_ok=True)
    if a.action == "prepare":
        data = load(a.out)
        for c in cases:
            dest = a.root / c.name
            if (dest / ".git").exists():
                print(f"{c.name}: {dest} exists, kept")
                continue
            data.setdefault("sources", {})[c.name] = c.prepare(dest, a)
            print(f"{c.name}: prepared in {dest} ({data['sources'][c.name]})")
        save(a.out, data)
        return 0
    if a.action == "run":
        data = load(a.out)
        data["date"] = time.strftime("%Y-%m-%d")
        data["machine"] = machine()
        here = Path(__file__).resolve().parent.parent
        with contextlib.suppress(Exception):
            data["saturate"] = "commit " + sh(["git", "rev-parse", "--short", "HEAD"], cwd=here).strip() + f" ({here})"
        from _harness import neighbour  # imports torch and saturate: only a run needs them
        data["condition"], data["seed"] = a.condition, a.seed
        load_ctx = contextlib.nullcontext() if a.condition == "quiet" else neighbour(a.condition, a.seed, 7200.0)
        with load_ctx:
            for c in cases:
                for verb in a.verbs.split(","):
                    print(f"{time.strftime('%H:%M:%S')} {c.name} {verb} …", flush=True)
                    rec = run_one(c, verb, a.root / c.name, a.out, a.timeout)
                    data["runs"][f"{c.name}/{verb}"] = rec
                    save(a.out, data)
                    print(f"   rc={rec['returncode']} {rec['wall_s']} s left={rec['git_status_after']}", flush=True)
    (a.out / "table.md").write_text(table(a.out))
    print((a.out / "table.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
