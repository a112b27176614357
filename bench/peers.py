"""saturate run against what its peers' users run (issue 30): time to a trained model, everything included.

One GPT-2-shaped job — 4 layers × 4 heads × 256 wide, context 128, effective batch 32, AdamW (lr 2e-3, 20
warm-up steps), the same text and the same locally trained 2000-token BPE — run to N optimizer steps by:

  hf-fp32      a Transformers Trainer script as most people write it: fp32, 8 × 4
  hf-bf16      the same with `bf16=True` (what a user who knows to turn it on does)
  hf-auto      `auto_find_batch_size=True` from 32 × 1, bf16, 2 loader workers
  lightning    a LightningModule around the same model: `Tuner.scale_batch_size` (power, from 2, up to the job's
               32: max_trials 5), `precision="bf16-mixed"`
  saturate     `python -m saturate run --hf DIR --data train.txt --param seq_len=128 --effective-batch 32 --steps N`
               (no cached plan: each run starts from an empty SATURATE_CACHE — saturate's first run on the machine)
  saturate-known  the same, its SATURATE_CACHE holding only the machine's matmul peaks (measured once before the
               rounds): a user who has run saturate on this machine before, not on this job (no plan, no tokens)

Each is a fresh process; the wall time is from its start to its exit (imports, data, tuning, training, saving
where the tool saves by default). Contestants run in interleaved rounds (the order rotates each round) so a slow
stretch of the machine falls on all of them; the table gives each one's median and range, and its median ratio to
the best peer per round. Loss at the end is printed as a sanity check (same job, not a race to a worse model).

    python3 bench/peers.py prepare --dir /tmp/peers
    PYTHONPATH=src python3 bench/peers.py run --dir /tmp/peers --steps 60 --rounds 2 --out bench/results/…
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable
ROOT = Path(__file__).resolve().parents[1]

STDLIB_TEXT = r"""
import sysconfig
from pathlib import Path
lib = Path(sysconfig.get_paths()["stdlib"])
Path("train.txt").write_text("\n".join(p.read_text(errors="ignore") for p in sorted(lib.glob("*.py"))[:120]))
"""

COMMON = r"""
import math, sys, time
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel
STEPS, SEQ, BATCH, LR, WARMUP = int(sys.argv[1]), 128, 32, 2e-3, 20
torch.manual_seed(0)
tok = AutoTokenizer.from_pretrained("gpt-peer")
ids = tok(open("train.txt").read())["input_ids"]
n = len(ids) // SEQ
blocks = torch.tensor(ids[: n * SEQ]).view(n, SEQ)
class Blocks(torch.utils.data.Dataset):
    def __len__(self): return len(blocks)
    def __getitem__(self, i): return {"input_ids": blocks[i], "labels": blocks[i]}
model = GPT2LMHeadModel(GPT2Config.from_pretrained("gpt-peer"))
def lr_at(step):  # linear warm-up, cosine to 10 %
    if step < WARMUP: return (step + 1) / WARMUP
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / max(1, STEPS - WARMUP)))
"""

HF = COMMON + r"""
from transformers import Trainer, TrainingArguments
mode = sys.argv[2]
kw = dict(per_device_train_batch_size=8, gradient_accumulation_steps=4)
if mode == "bf16": kw["bf16"] = True
if mode == "auto": kw = dict(per_device_train_batch_size=32, gradient_accumulation_steps=1, bf16=True,
                             auto_find_batch_size=True, dataloader_num_workers=2)
args = TrainingArguments(output_dir="out-hf", max_steps=STEPS, learning_rate=LR, warmup_steps=WARMUP,
                         lr_scheduler_type="cosine", optim="adamw_torch", logging_steps=max(1, STEPS // 5),
                         save_strategy="no", report_to=[], use_cpu=True, seed=0, **kw)
out = Trainer(model=model, args=args, train_dataset=Blocks()).train()
print("RESULT", {"loss": out.training_loss, "train_s": out.metrics["train_runtime"]})
"""

LIGHTNING = COMMON + r"""
import lightning.pytorch as pl
from lightning.pytorch.tuner import Tuner
class Module(pl.LightningModule):
    def __init__(self):
        super().__init__(); self.model, self.batch_size = model, 2
    def train_dataloader(self):
        return torch.utils.data.DataLoader(Blocks(), batch_size=self.batch_size, shuffle=True)
    def training_step(self, batch, _):
        loss = self.model(**batch).loss; self.log("loss", loss, prog_bar=True); return loss
    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lr_at), "interval": "step"}]
m = Module()
trainer = pl.Trainer(max_steps=STEPS, precision="bf16-mixed", accelerator="cpu", logger=False,
                     enable_checkpointing=False, enable_model_summary=False)
Tuner(trainer).scale_batch_size(m, mode="power", init_val=2, max_trials=5)
t = time.perf_counter(); trainer.fit(m)
print("RESULT", {"loss": float(trainer.callback_metrics["loss"]), "train_s": time.perf_counter() - t,
                 "batch_size": m.batch_size})
"""

CONTESTANTS = ("hf-fp32", "hf-bf16", "hf-auto", "lightning", "saturate", "saturate-known")
PEERS = CONTESTANTS[:4]


def prepare(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    from real_scripts import gpt2_folder_code

    code = STDLIB_TEXT + gpt2_folder_code("gpt-peer", 128, "n_layer=4, n_head=4, n_embd=256")
    subprocess.run([PY, "-c", code], cwd=folder, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    (folder / "peer_hf.py").write_text(HF)
    (folder / "peer_lightning.py").write_text(LIGHTNING)
    print(f"prepared {folder}: gpt-peer/ (config + tokenizer), train.txt, peer_hf.py, peer_lightning.py")


def command(name: str, steps: int, folder: Path) -> list[str]:
    if name.startswith("hf-"):
        return [PY, "peer_hf.py", str(steps), name[3:]]
    if name == "lightning":
        return [PY, "peer_lightning.py", str(steps)]
    return [PY, "-m", "saturate", "run", "--hf", "gpt-peer", "--data", "train.txt", "--param", "seq_len=128",
            "--param", "lr=2e-3", "--param", "warmup_steps=20", "--effective-batch", "32", "--steps", str(steps),
            "--run-dir", f"run-{time.monotonic_ns()}", "--no-progress", "--json"]


def contest(name: str, steps: int, folder: Path, cache: Path, peaks: Path | None = None) -> dict:
    if name == "saturate-known" and peaks is not None:  # the peaks, as a second job on this machine finds them
        shutil.copytree(peaks, cache / "peaks", dirs_exist_ok=True)
    # Each contestant's own Inductor cache, empty: a compile trial costs what it costs on a first run (a cache that
    # an earlier run of the same plan left made one take 6 s instead of 58, 2026-11-27).
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "SATURATE_CACHE": str(cache),
           "PYTHONPATH": str(ROOT / "src"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    t = time.perf_counter()
    out = subprocess.run(command(name, steps, folder), cwd=folder, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    row: dict = {"name": name, "wall_s": wall, "rc": out.returncode}
    if out.returncode != 0:
        row["error"] = (out.stderr.strip().splitlines() or ["?"])[-1][:300]
        return row
    if name.startswith("saturate"):
        doc = json.loads(out.stdout)
        tr = doc.get("training") or {}
        p = tr.get("plan") or {}
        row.update(loss=tr.get("train_loss"), train_s=tr.get("train_seconds"),
                   plan=f"{doc.get('trained')}: {p.get('micro_batch')}×{p.get('grad_accum')} {p.get('precision')}")
        row["said"] = [ln for ln in out.stderr.splitlines() if re.search(r"not tuned|tuning budget|using the plan",
                                                                        ln)][:3]
    else:
        m = re.search(r"RESULT (\{.*\})", out.stdout)
        row.update(eval(m.group(1)) if m else {})  # noqa: S307 (our own script's dict literal)
    return row


def run(a: argparse.Namespace) -> None:
    folder = Path(a.dir).resolve()
    names = [n for n in a.contestants.split(",")]
    rows: list[dict] = []
    peaks = None
    if "saturate-known" in names:  # measured once, outside every contestant's wall time
        machine = folder / "cache-machine"
        subprocess.run([PY, "-m", "saturate", "probe"], env={**os.environ, "SATURATE_CACHE": str(machine),
                                                              "PYTHONPATH": str(ROOT / "src")},
                       check=True, capture_output=True)
        peaks = machine / "peaks"
    for r in range(a.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            cache = folder / f"cache-{r}-{name}"  # no plan cached from an earlier run: saturate tunes each time
            shutil.rmtree(cache, ignore_errors=True)  # nor a token cache from an earlier invocation of this bench
            row = contest(name, a.steps, folder, cache, peaks) | {"round": r}
            rows.append(row)
            print(f"round {r + 1}/{a.rounds} {name:10s} wall {row['wall_s']:6.1f} s  rc {row['rc']}  "
                  f"loss {row.get('loss')}  {row.get('error', '')}", flush=True)
    table = summarise(rows, names, a.steps)
    print(table)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"peers-{a.steps}.json").write_text(json.dumps({"steps": a.steps, "rows": rows}, indent=2,
                                                              default=str) + "\n")
        (out / f"peers-{a.steps}.md").write_text(table + "\n")


def summarise(rows: list[dict], names: list[str], steps: int) -> str:
    lines = [f"| {steps} steps | wall (median, range) | best peer's wall ÷ its wall, per round | loss | plan |",
             "|---|---|---|---|---|"]
    rounds = sorted({r["round"] for r in rows})
    best = {}
    for r in rounds:
        peers = [x["wall_s"] for x in rows if x["round"] == r and x["name"] in PEERS and x["rc"] == 0]
        best[r] = min(peers) if peers else None
    for name in names:
        mine = [x for x in rows if x["name"] == name and x["rc"] == 0]
        if not mine:
            lines.append(f"| {name} | failed | | |")
            continue
        walls = [x["wall_s"] for x in mine]
        ratios = [best[x["round"]] / x["wall_s"] for x in mine if best.get(x["round"])]
        losses = [x["loss"] for x in mine if x.get("loss") is not None]
        ratio = f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})" if ratios else "-"
        loss = f"{statistics.median(losses):.3f}" if losses else "-"
        lines.append(f"| {name} | {statistics.median(walls):.1f} s ({min(walls):.1f}–{max(walls):.1f}) | {ratio} "
                     f"| {loss} | {mine[-1].get('plan', mine[-1].get('batch_size', ''))} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="verb", required=True)
    pp = sub.add_parser("prepare")
    pp.add_argument("--dir", default="/tmp/peers")
    pr = sub.add_parser("run")
    pr.add_argument("--dir", default="/tmp/peers")
    pr.add_argument("--steps", type=int, default=60)
    pr.add_argument("--rounds", type=int, default=2)
    pr.add_argument("--contestants", default=",".join(CONTESTANTS))
    pr.add_argument("--out")
    a = p.parse_args()
    prepare(Path(a.dir)) if a.verb == "prepare" else run(a)


if __name__ == "__main__":
    main()
