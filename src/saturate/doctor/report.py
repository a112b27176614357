"""The doctor's report: what was measured, the verdict, the fixes with their predicted gains."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from saturate.doctor.findings import Diagnosis, Fix, Measurements, Prediction, sites_line
from saturate.doctor.phases import PHASES
from saturate.doctor.trace import TraceFiles
from saturate.engine.console import tidy_console
from saturate.telemetry import Stat

_GIB = 1024**3
_PHASE_LABELS = {
    "data": "waiting for data",
    "h2d": "host-to-device copy",
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer step",
    "other": "everything else",
}


def _gib(x: float | None) -> str:
    return "unmeasured" if x is None else f"{x / _GIB:.2f} GiB"


def _stat(s: Stat, unit: str, fmt: str = ".0f") -> str:
    if s.mean is None:
        return f"unmeasured ({s.missing})"
    return f"{s.mean:{fmt}}{unit} mean, {s.low:{fmt}}..{s.peak:{fmt}}{unit} ({s.samples} samples)"


def prediction_text(p: Prediction) -> str:
    if p.after is None:
        return p.basis
    if p.metric in ("step_s", "sample_s"):
        unit = "s/step" if p.metric == "step_s" else "s/sample"
        return (f"predicted {p.gain:.2f}× faster ({p.before:.4g} → {p.after:.4g} {unit}); {p.basis}")
    kind = "host" if p.metric == "host_bytes" else "device"
    return f"predicted {kind} memory {_gib(p.before)} → {_gib(p.after)}; {p.basis}"


def _fix_line(i: int, fix: Fix) -> Text:
    text = Text(f"{i}. ", style="bold")
    text.append(fix.title, style="bold")
    if not fix.same_training:
        text.append(" [changes the training]", style="yellow")
    text.append(f"\n   {prediction_text(fix.prediction)}\n   why: {fix.why}")
    return text


def _where(m: Measurements) -> str:
    parts = [f"{m.device_name} ({m.device_type})"]
    if m.micro_batch:
        accum = f" × accumulation {m.grad_accum}" if m.grad_accum else ""
        parts.append(f"micro-batch {m.micro_batch}{accum}")
    if m.num_workers is not None:
        parts.append(f"{m.num_workers} loader workers")
    if m.precision:
        parts.append(f"precision {m.precision}")
    if m.compile:
        parts.append(f"compile {m.compile}")
    return ", ".join(parts)


def render(d: Diagnosis, console: Console | None = None, title: str = "saturate doctor") -> None:
    console = console or tidy_console(highlight=False)
    m = d.measurements
    console.print(Text(f"{title}: {_where(m)}", style="bold"))
    if m.contention and m.contention.get("line"):  # what else ran meanwhile, first: it colours every figure below
        console.print(Text(m.contention["line"], style="bold yellow" if m.contention.get("significant") else "dim"))
    spread = (f" ±{100 * m.step_spread:.1f} % over {len(m.window_shares)} windows" if m.step_spread is not None
              else "")
    console.print(f"{m.steps} steps timed: {m.step_s:.4g} s per optimizer step{spread}"
                  + (f", {m.samples_per_step / m.step_s:.1f} samples/s" if m.samples_per_step else "")
                  + f" (measured; phases in {m.timing})")
    t = Table(show_header=True, box=None, padding=(0, 2))
    t.add_column("phase")
    t.add_column("per step", justify="right")
    t.add_column("share", justify="right")
    t.add_column("over windows", justify="right")
    t.add_column("")
    total = sum(m.phases.values()) or 1.0
    for p in PHASES:
        v = m.phases.get(p, 0.0)
        if v == 0.0 and p in ("h2d",) and m.context == "loop":
            continue  # not separable in a user's loop: part of "everything else"
        share = v / total
        low, high = m.share_range(p)
        ranged = f"{100 * low:.0f}..{100 * high:.0f} %" if len(m.window_shares) > 1 else ""
        t.add_row(_PHASE_LABELS[p], f"{1000 * v:.1f} ms", f"{100 * share:.0f} %", ranged, "█" * round(20 * share))
    console.print(t)
    if m.syncs_per_step is not None:
        where = ", ".join(f"{v:g} in {k}" for k, v in m.syncs_by_phase.items() if v)
        console.print(f"synchronisations per step: {m.syncs_per_step:g}" + (f" ({where})" if where else "")
                      + f" — {m.sync_method}")
        if m.syncs_by_site:
            console.print("  at " + sites_line(m.syncs_by_site, seen=m.syncs_seen))
    else:
        console.print(f"synchronisations per step: unmeasured ({m.sync_missing})")
    console.print(f"device utilisation: {_stat(m.device_util, ' %')}")
    if m.accelerator:
        mem = _gib(m.device_mem_peak)
        if m.device_mem_peak is not None and m.device_mem_total:
            mem += f" of {_gib(m.device_mem_total)} ({100 * m.device_mem_peak / m.device_mem_total:.0f} %)"
        console.print(f"device memory peak (this process, reserved): {mem}")
    console.print(f"host CPU: {_stat(m.host_cpu, ' %')} of {m.cpu_cores} usable cores")
    if m.host_ram_total is not None and m.host_ram_available_min is not None:
        console.print(f"host RAM: {_gib(m.host_ram_available_min)} available at the lowest, of "
                      f"{_gib(m.host_ram_total)}; swap traffic "
                      + (f"{m.swap_bytes / 1024**2:.0f} MiB" if m.swap_bytes is not None else
                         f"unmeasured ({m.swap_missing})"))
    if m.tree_peak is not None:
        budget = f" against a budget of {_gib(m.host_budget)} ({m.host_budget_source})" if m.host_budget else ""
        workers = (f"; {m.workers_seen} worker(s), the largest {_gib(m.worker_peak)} of its own"
                   if m.workers_seen and m.worker_peak is not None else "")
        console.print(f"job memory peak ({m.memory_kind.upper()}, training process and workers): "
                      f"{_gib(m.tree_peak)}{budget}{workers}")
    console.print()
    style = {"compute-bound": "bold green", "contended": "bold yellow"}.get(d.verdict, "bold red")
    console.print(Text(f"verdict: {d.label}", style=style))
    for e in d.evidence:
        console.print(Text(f"  • {e}"))
    for f in d.findings[1:]:
        label = "note" if f.verdict == "note" else f"also {f.verdict}"
        for e in f.evidence:
            console.print(Text(f"  ({label}) {e}"))
    if d.fixes:
        console.print()  # the heading on a line of its own, not read as the end of the last sentence
        console.print(Text("fixes, ranked (gains are predictions, not measurements):", style="bold"))
        for i, fix in enumerate(d.fixes, 1):
            console.print(_fix_line(i, fix))
    else:
        console.print("no fix to suggest")
    for n in m.notes:
        console.print(Text(f"note: {n}", style="yellow"))
    if (files := TraceFiles.from_dict(m.trace)) is not None:
        for line in files.lines():
            console.print(Text(line, style="dim"), soft_wrap=True)  # a path broken over lines cannot be copied
