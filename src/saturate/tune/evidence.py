"""The tuner's evidence: a trials table, the decisions, JSON, and PNG plots (matplotlib, headless)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from saturate.plan import Plan
from saturate.stats.noise import rate_text
from saturate.tune.results import MemoryFit, SearchResult
from saturate.tune.trial import LoaderTrial, Trial


def _num(v: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


GIB_FROM = 10 * 2**30  # a size this large is printed in GiB, a smaller one in MiB
TORCH_PREFETCH = 2  # DataLoader's prefetch_factor when workers are used and none is given


def _mib(v: int | None) -> str:
    if v is None:
        return "-"
    return f"{v / 2**30:.1f} GiB" if v >= GIB_FROM else f"{v / 2**20:.0f} MiB"


def plan_text(p: Plan) -> str:
    """A plan's model settings in a few characters: `16×2 bf16 AC fused compiled fsdp`."""
    compiled = "" if p.compile == "none" else " compiled" if p.compile == "default" else f" {p.compile}"
    return (f"{p.micro_batch}×{p.grad_accum} {p.precision}{'+tf32' if p.tf32 else ''}"
            f"{' AC' if p.activation_checkpointing else ''}{' fused' if p.fused_optimizer else ''}{compiled}"
            f"{'' if p.strategy == 'single' else ' ' + p.strategy}{'+offload' if p.cpu_offload else ''}"
            f"{'' if p.threads is None else f' {p.threads} thread' + ('s' if p.threads > 1 else '')}"
            f"{'' if p.loss_chunk is None else f' loss in chunks of {p.loss_chunk}'}"
            f"{'' if p.attention is None else f' {p.attention} attention'}")


def trial_line(t: Trial | LoaderTrial, tokens_per_sample: int) -> str:
    """One line per finished trial, for progress while the search runs."""
    if isinstance(t, LoaderTrial):
        rate = rate_text(t.samples_per_s, t.spread) if t.samples_per_s else t.status
        return (f"loader: {t.num_workers} workers, prefetch {t.prefetch_factor or '-'}, pinned "
                f"{'yes' if t.pin_memory else 'no'}: {rate}, workers' memory {_mib(t.worker_memory_bytes)}")
    what = f"{stage_text(t)}: {plan_text(t.plan)}"
    if not t.ok:
        return f"{what}: {t.status} ({t.error})"
    tok = f", {t.samples_per_s * tokens_per_sample:,.0f} tokens/s" if tokens_per_sample > 1 else ""
    comp = f", compiled in {t.compile_s:.1f} s" if t.compile_s else ""
    busy = f", machine busy ({t.busy_cores:.1f} cores used by others)" if t.contended and t.busy_cores else ""
    return (f"{what}: {rate_text(t.samples_per_s, t.spread)}{tok}, {t.windows} windows, peak "
            f"{_mib(t.peak_memory_bytes)}{comp}{busy} ({t.seconds:.1f} s)")


_SHORT_STAGES = {"activation-checkpointing": "checkpointing", "fused-optimizer": "fused"}
_PAIRED_NOTE = ("⇄ paired: two plans timed again in alternating windows (one window each in turn, in a random "
                "order per pair), which decided between them; the outcome line says how")


def stage_text(t: Trial, short: bool = False) -> str:
    """The trial's stage, marked when it was timed in alternating windows with another plan (paired.py):
    "(paired)", or "⇄" in the 80-column table (its footer says what it means)."""
    if short:
        return _SHORT_STAGES.get(t.stage, t.stage) + (" ⇄" if t.paired else "")
    return f"{t.stage} (paired)" if t.paired else t.stage
_BUSY_NOTE = "* other processes kept the machine busy during this trial (its spread shows how much it moved)"


def trials_table(trials: list[Trial], tokens_per_sample: int, memory_kind: str, *, wide: bool = False) -> Any:
    """The trials: by default fitted to 80 columns (plan, samples/s ± spread, memory; the outcome on a line
    of its own); `wide` shows every figure in one row per trial. tune.json has everything."""
    title = "Trials (every figure measured in this run; samples/s: median ± half-range of timed windows)"
    if wide:
        return _wide_trials(trials, tokens_per_sample, memory_kind, title)
    rows, notes = [], []
    for i, tr in enumerate(trials, 1):
        rate = rate_text(tr.samples_per_s, tr.spread, "") + ("*" if tr.contended else "")
        rows.append([str(i), stage_text(tr, short=True), plan_text(tr.plan), rate,
                     _mib(tr.peak_memory_bytes), f"{tr.seconds:.1f}"])
        notes.append(tr.verdict or (f"{tr.status}: {tr.error}" if not tr.ok else ""))
    footer = ([_BUSY_NOTE] if any(tr.contended for tr in trials) else []) + (
        [_PAIRED_NOTE] if any(tr.paired for tr in trials) else [])
    return Grid(title, ["#", "stage", "plan", "samples/s", f"peak {memory_kind}", "trial s"], "rllrrr", rows, notes,
                footer)


def _wide_trials(trials: list[Trial], tokens_per_sample: int, memory_kind: str, title: str) -> Table:
    t = Table(title=title, box=box.SIMPLE_HEAVY, title_justify="left")
    several = any(tr.plan.strategy != "single" for tr in trials)  # under torchrun: DDP or FSDP per trial
    tokens = tokens_per_sample > 1  # samples that are not tokens get no tokens/s column
    for col in ("#", "stage", "micro×accum", "precision", *(["strategy"] if several else []), "AC", "fused",
                "compile", "samples/s", "±", "windows", *(["tokens/s"] if tokens else []), "step s",
                f"peak {memory_kind}", "busy cores", "compile s", "trial s", "outcome"):
        t.add_column(col, justify="left" if col in ("stage", "precision", "strategy", "compile", "outcome")
                     else "right")
    for i, tr in enumerate(trials, 1):
        p = tr.plan
        prec = p.precision + ("+tf32" if p.tf32 else "")
        tok = tr.samples_per_s * tokens_per_sample if tr.samples_per_s and tokens_per_sample else None
        outcome = tr.verdict or (tr.status if not tr.ok else "")
        t.add_row(str(i), stage_text(tr), f"{p.micro_batch}×{p.grad_accum}", prec,
                  *([p.strategy + (" +offload" if p.cpu_offload else "")] if several else []),
                  "on" if p.activation_checkpointing else "", "on" if p.fused_optimizer else "",
                  "" if p.compile == "none" else p.compile, _num(tr.samples_per_s),
                  _num(tr.spread and 100 * tr.spread, "{:.1f} %"), str(tr.windows or "-"),
                  *([_num(tok, "{:,.0f}")] if tokens else []), _num(tr.step_s, "{:.3f}"),
                  _mib(tr.peak_memory_bytes), _num(tr.busy_cores) + ("*" if tr.contended else ""),
                  _num(tr.compile_s), f"{tr.seconds:.1f}", outcome)
    return t


def loader_table(trials: list[LoaderTrial], *, wide: bool = False) -> Any:
    """The loader settings tried, 80 columns by default (outcome on its own line); `wide`: every figure."""
    title = "Input pipeline (the DataLoader alone)"
    if wide:
        t = Table(title=title, box=box.SIMPLE_HEAVY, title_justify="left")
        for col in ("workers", "prefetch", "pinned", "samples/s", "±", "windows", "workers' memory (USS)",
                    "start-up s", "trial s", "outcome"):
            t.add_column(col, justify="left" if col == "outcome" else "right")
        for tr in trials:
            t.add_row(str(tr.num_workers), str(tr.prefetch_factor or "-"), "yes" if tr.pin_memory else "no",
                      _num(tr.samples_per_s, "{:,.0f}"), _num(tr.spread and 100 * tr.spread, "{:.1f} %"),
                      str(tr.windows or "-"), _mib(tr.worker_memory_bytes), _num(tr.startup_s, "{:.2f}"),
                      f"{tr.seconds:.1f}", tr.verdict or tr.status)
        return t
    rows = [[str(tr.num_workers), str(tr.prefetch_factor or "-"), "yes" if tr.pin_memory else "no",
             rate_text(tr.samples_per_s, tr.spread, ""), _mib(tr.worker_memory_bytes), _num(tr.startup_s, "{:.2f}")]
            for tr in trials]
    return Grid(title, ["workers", "prefetch", "pinned", "samples/s", "workers' USS", "start-up s"], "rrrrrr", rows,
                [tr.verdict or (tr.status if not tr.ok else "") for tr in trials])


class Grid:
    """A plain table that fits the console: columns as wide as their cells (the widest-content column
    wraps at spaces when they do not fit), and under each row its note, wrapped, on lines of its own.
    Nothing is cut off with an ellipsis."""

    def __init__(self, title: str, headers: list[str], justify: str, rows: list[list[str]], notes: list[str],
                 footer: list[str] | None = None) -> None:
        self.title, self.headers, self.justify, self.rows, self.notes = title, headers, justify, rows, notes
        self.footer = footer or []

    def lines(self, width: int) -> list[tuple[str, str]]:
        """(text, style) lines no wider than `width`."""
        cells = [self.headers, *self.rows]
        widths = [max(len(r[c]) for r in cells) for c in range(len(self.headers))]
        gap = 2
        over = sum(widths) + gap * (len(widths) - 1) - width
        if over > 0:  # the widest column wraps at spaces, down to its longest word
            flex = max(range(len(widths)), key=lambda c: widths[c])
            longest_word = max(len(w) for r in cells for w in r[flex].split() or [""])
            widths[flex] = max(widths[flex] - over, longest_word)
        out = [(line, "bold") for line in textwrap.wrap(self.title, width)]

        def row_lines(row: list[str]) -> list[str]:
            parts = [textwrap.wrap(v, w) or [""] for v, w in zip(row, widths, strict=True)]
            height = max(len(p) for p in parts)
            parts = [p + [""] * (height - len(p)) for p in parts]
            return [(" " * gap).join(p[i].rjust(w) if j == "r" else p[i].ljust(w)
                                     for p, w, j in zip(parts, widths, self.justify, strict=True)).rstrip()
                    for i in range(height)]

        out += [(line, "bold") for line in row_lines(self.headers)]
        out.append(("─" * min(width, sum(widths) + gap * (len(widths) - 1)), "dim"))
        for row, note in zip(self.rows, self.notes, strict=True):
            out += [(line, "") for line in row_lines(row)]
            if note:
                out += [(line, "dim") for line in textwrap.wrap(note, width, initial_indent="    → ",
                                                                 subsequent_indent="      ")]
        for line in self.footer:
            out += [(w, "dim") for w in textwrap.wrap(line, width)]
        return out

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for text, style in self.lines(options.max_width):
            yield Text(text, style=style, no_wrap=True, overflow="fold")


def print_report(console: Console, result: SearchResult, tokens_per_sample: int, memory_kind: str, *,
                 wide: bool = False) -> None:
    """What was measured and decided: the machine's load first, then the trials, loader and decisions."""
    if result.contention is not None:
        busy = result.contention.significant()
        console.print(f"during the search, {result.contention.line()}"
                      + ("; trials were timed longer where their windows disagreed" if busy else ""),
                      style="yellow" if busy else "dim", highlight=False)
    for line in result.warnings:
        console.print(f"warning: {line}", style="yellow", highlight=False)
    console.print(trials_table(result.trials, tokens_per_sample, memory_kind, wide=wide))
    if result.loader_trials:
        console.print(loader_table(result.loader_trials, wide=wide))
    console.print("[bold]Decisions[/bold]")
    for line in result.decisions:
        console.print(f"  • {line}")
    for line in result.skipped:
        console.print(f"  [dim]– {line}[/dim]")


def result_dict(result: SearchResult) -> dict[str, Any]:
    return {
        "plan": result.plan.to_dict() | {"provenance": None},
        # Where the search started and why each knob the informed plan sets has its value (measured, or "chosen
        # from the hardware, not measured" where no trial measured it).
        "choices": result.choices, "unmeasured": result.unmeasured,
        "trials": [t.to_dict() for t in result.trials],
        "loader_trials": [t.to_dict() for t in result.loader_trials],
        "memory_fit": result.fit.to_dict() if result.fit else None,
        "decisions": result.decisions,
        "skipped": result.skipped,
        "warnings": result.warnings,
        "contention": result.contention.to_dict() if result.contention is not None else None,
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
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for label, pts in micro_batch_series(result.trials).items():
        ax1.errorbar([m for m, _, _ in pts], [v for _, v, _ in pts], yerr=[e for _, _, e in pts], fmt="o-",
                     capsize=3, label=label)
    own = chosen_trial(result)
    if own is not None:
        ax1.plot([own.plan.micro_batch], [own.samples_per_s], "*", color="green", markersize=16, zorder=5,
                 label=f"chosen: {plan_text(own.plan)}")
    if result.chosen.samples_per_s and result.chosen.stage == "verify":  # unverified: its own trial is the star
        ax1.plot([chosen.micro_batch], [result.chosen.samples_per_s], "x", color="black", markersize=10, zorder=5,
                 label="verified (with the real loader)")
    ax1.set(xlabel="micro-batch", ylabel="samples/s (median ± spread)", title="Throughput against micro-batch")
    _log2_axis(ax1)
    ax1.legend(fontsize="small")
    _plot_memory(ax2, result.trials, result.fit, chosen.precision)
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "micro_batch.png"))
    plt.close(fig)
    if result.loader_trials:
        fig, ax = plt.subplots(figsize=(6, 4))
        for pf in sorted({t.prefetch_factor or TORCH_PREFETCH for t in result.loader_trials}):
            rows = sorted((t.num_workers, t.samples_per_s) for t in result.loader_trials
                          if t.ok and (t.prefetch_factor or TORCH_PREFETCH) == pf and not t.pin_memory
                          and t.samples_per_s)
            if rows:
                ax.plot([w for w, _ in rows], [v for _, v in rows], "o-", label=f"prefetch {pf}")
        model_rate = result.chosen.samples_per_s or 0
        ax.axhline(model_rate, color="black", ls="--", label="model (verified plan)" if result.chosen.stage == "verify"
                   else "model (chosen plan's trial)")
        ax.axhline(model_rate * loader_margin, color="grey", ls=":", label=f"{loader_margin:g}× model: wanted")
        ax.set(xlabel="DataLoader workers", ylabel="samples/s (loader alone)", yscale="log",
               title="Input pipeline against workers")
        ax.legend()
        fig.tight_layout()
        paths.append(_save(fig, out_dir / "loader.png"))
        plt.close(fig)
    return paths, None


def micro_batch_series(trials: list[Trial]) -> dict[str, list[tuple[int, float, float]]]:
    """One series per comparable configuration (everything but the micro-batch alike): label ->
    [(micro-batch, samples/s, ± samples/s)], from timed model trials (not the verification, which
    also reads the real loader, nor one-step memory points)."""
    series: dict[str, dict[int, tuple[float, float]]] = {}
    for t in trials:
        if not (t.ok and t.samples_per_s and t.stage != "verify" and t.steps > 1):
            continue
        label = plan_text(t.plan).split(" ", 1)[1]  # the plan without its micro-batch × accumulation
        series.setdefault(label, {})[t.plan.micro_batch] = (t.samples_per_s, (t.spread or 0.0) * t.samples_per_s)
    return {label: [(m, v, e) for m, (v, e) in sorted(pts.items())] for label, pts in series.items()}


def chosen_trial(result: SearchResult) -> Trial | None:
    """The chosen plan's own model trial (the last one of its model settings), None if it has none."""
    key = plan_text(result.chosen.plan)
    return next((t for t in reversed(result.trials) if t.stage != "verify" and t.ok and t.samples_per_s
                 and plan_text(t.plan) == key), None)


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
