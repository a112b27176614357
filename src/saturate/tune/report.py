"""The tuner's evidence: a trials table, the decisions, JSON, and PNG plots (matplotlib, headless)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from saturate.tune.results import MemoryFit, SearchResult
from saturate.tune.trial import LoaderTrial, Trial


def _num(v: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def _mib(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**20:.0f} MiB"


def trial_line(t: Trial | LoaderTrial, tokens_per_sample: int) -> str:
    """One line per finished trial, for progress while the search runs."""
    if isinstance(t, LoaderTrial):
        rate = f"{t.samples_per_s:,.0f} samples/s" if t.samples_per_s else t.status
        return (f"loader: {t.num_workers} workers, prefetch {t.prefetch_factor or '-'}, pinned "
                f"{'yes' if t.pin_memory else 'no'}: {rate}, workers' memory {_mib(t.worker_memory_bytes)}")
    p = t.plan
    what = (f"{t.stage}: micro-batch {p.micro_batch}×{p.grad_accum} {p.precision}{'+tf32' if p.tf32 else ''}"
            f"{' +AC' if p.activation_checkpointing else ''}{' +fused' if p.fused_optimizer else ''}"
            f"{'' if p.compile == 'none' else ' +compile'}{'' if p.strategy == 'single' else ' ' + p.strategy}")
    if not t.ok:
        return f"{what}: {t.status} ({t.error})"
    tok = f", {t.samples_per_s * tokens_per_sample:,.0f} tokens/s" if tokens_per_sample > 1 else ""
    comp = f", compiled in {t.compile_s:.1f} s" if t.compile_s else ""
    return (f"{what}: {t.samples_per_s:.1f} samples/s{tok}, peak {_mib(t.peak_memory_bytes)}{comp} "
            f"({t.seconds:.1f} s)")


def trials_table(trials: list[Trial], tokens_per_sample: int, memory_kind: str) -> Table:
    t = Table(title="Trials (every figure measured in this run)", box=box.SIMPLE_HEAVY, title_justify="left")
    several = any(tr.plan.strategy != "single" for tr in trials)  # under torchrun: DDP or FSDP per trial
    tokens = tokens_per_sample > 1  # samples that are not tokens get no tokens/s column
    for col in ("#", "stage", "micro×accum", "precision", *(["strategy"] if several else []), "AC", "fused",
                "compile", "samples/s", *(["tokens/s"] if tokens else []), "step s", f"peak {memory_kind}",
                "compile s", "trial s", "outcome"):
        t.add_column(col, justify="left" if col in ("stage", "precision", "strategy", "compile", "outcome")
                     else "right")
    for i, tr in enumerate(trials, 1):
        p = tr.plan
        prec = p.precision + ("+tf32" if p.tf32 else "")
        tok = tr.samples_per_s * tokens_per_sample if tr.samples_per_s and tokens_per_sample else None
        outcome = tr.verdict or (tr.status if not tr.ok else "")
        t.add_row(str(i), tr.stage, f"{p.micro_batch}×{p.grad_accum}", prec,
                  *([p.strategy + (" +offload" if p.cpu_offload else "")] if several else []),
                  "on" if p.activation_checkpointing else "", "on" if p.fused_optimizer else "",
                  "" if p.compile == "none" else p.compile,
                  _num(tr.samples_per_s), *([_num(tok, "{:,.0f}")] if tokens else []), _num(tr.step_s, "{:.3f}"),
                  _mib(tr.peak_memory_bytes), _num(tr.compile_s), f"{tr.seconds:.1f}", outcome)
    return t


def loader_table(trials: list[LoaderTrial]) -> Table:
    t = Table(title="Input pipeline (the DataLoader alone)", box=box.SIMPLE_HEAVY, title_justify="left")
    for col in ("workers", "prefetch", "pinned", "samples/s", "workers' memory (USS)", "start-up s", "outcome"):
        t.add_column(col, justify="left" if col == "outcome" else "right")
    for tr in trials:
        t.add_row(str(tr.num_workers), str(tr.prefetch_factor or "-"), "yes" if tr.pin_memory else "no",
                  _num(tr.samples_per_s, "{:,.0f}"), _mib(tr.worker_memory_bytes), _num(tr.startup_s, "{:.2f}"),
                  tr.verdict or tr.status)
    return t


def print_report(console: Console, result: SearchResult, tokens_per_sample: int, memory_kind: str) -> None:
    console.print(trials_table(result.trials, tokens_per_sample, memory_kind))
    if result.loader_trials:
        console.print(loader_table(result.loader_trials))
    console.print("[bold]Decisions[/bold]")
    for line in result.decisions:
        console.print(f"  • {line}")
    for line in result.skipped:
        console.print(f"  [dim]– {line}[/dim]")


def result_dict(result: SearchResult) -> dict[str, Any]:
    return {
        "plan": result.plan.to_dict() | {"provenance": None},
        "trials": [t.to_dict() for t in result.trials],
        "loader_trials": [t.to_dict() for t in result.loader_trials],
        "memory_fit": result.fit.to_dict() if result.fit else None,
        "decisions": result.decisions,
        "skipped": result.skipped,
        "seconds": result.seconds,
    }


def plot(result: SearchResult, out_dir: Path, loader_margin: float) -> tuple[list[Path], str | None]:
    """micro_batch.png (throughput and memory against micro-batch) and loader.png; (paths, note)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "plots skipped: matplotlib is not installed"
    paths = []
    chosen = result.chosen.plan
    same = [t for t in result.trials if t.ok and t.samples_per_s and t.stage != "verify"
            and t.plan.precision == chosen.precision and t.plan.compile == "none"
            and not t.plan.activation_checkpointing and t.steps > 1]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    pts = sorted({t.plan.micro_batch: t.samples_per_s for t in same}.items())
    if pts:
        ax1.plot([m for m, _ in pts], [v for _, v in pts], "o-", label=f"{chosen.precision}, measured")
    ax1.axvline(chosen.micro_batch, color="green", ls=":", label=f"chosen: {chosen.micro_batch}")
    ax1.set(xlabel="micro-batch", ylabel="samples/s", title="Throughput against micro-batch")
    _log2_axis(ax1)
    ax1.legend()
    _plot_memory(ax2, result.trials, result.fit, chosen.precision)
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "micro_batch.png"))
    plt.close(fig)
    if result.loader_trials:
        fig, ax = plt.subplots(figsize=(6, 4))
        for pf in sorted({t.prefetch_factor or 2 for t in result.loader_trials}):
            rows = sorted((t.num_workers, t.samples_per_s) for t in result.loader_trials
                          if t.ok and (t.prefetch_factor or 2) == pf and not t.pin_memory and t.samples_per_s)
            if rows:
                ax.plot([w for w, _ in rows], [v for _, v in rows], "o-", label=f"prefetch {pf}")
        model_rate = result.chosen.samples_per_s or 0
        ax.axhline(model_rate, color="black", ls="--", label="model (verified plan)")
        ax.axhline(model_rate * loader_margin, color="grey", ls=":", label=f"{loader_margin:g}× model: wanted")
        ax.set(xlabel="DataLoader workers", ylabel="samples/s (loader alone)", yscale="log",
               title="Input pipeline against workers")
        ax.legend()
        fig.tight_layout()
        paths.append(_save(fig, out_dir / "loader.png"))
        plt.close(fig)
    return paths, None


def _plot_memory(ax: Any, trials: list[Trial], fit: MemoryFit | None, precision: str) -> None:
    pts = [(t.plan.micro_batch, t.peak_memory_bytes / 2**30) for t in trials
           if t.peak_memory_bytes is not None and t.plan.precision == precision and t.plan.compile == "none"
           and not t.plan.activation_checkpointing and t.stage != "verify"]
    if pts:
        ax.plot([m for m, _ in pts], [g for _, g in pts], "o", label="measured peak")
    if fit is not None:
        top = max([m for m, _ in pts] + [1]) * 4
        xs = [2 ** (i / 8) for i in range(int(8 * math.log2(top)) + 1)]  # a line is curved on a log axis
        ax.plot(xs, [fit.predict(x) / 2**30 for x in xs], "-", color="tab:orange", label="fitted line (prediction)")
        ax.axhline(fit.limit / 2**30, color="red", ls="--", label=f"limit ({fit.kind})")
        ax.set(ylabel=f"peak {fit.kind} memory, GiB")
    ax.set(xlabel="micro-batch", title="Memory against micro-batch")
    _log2_axis(ax)
    ax.legend()


def _log2_axis(ax: Any) -> None:
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))  # 1, 2, 4 … (not 1.0, 2.0)


def _save(fig: Any, path: Path) -> Path:
    from saturate.atomic import atomic_path

    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    return path
