"""The before/after table of `saturate run`, and the lines under it, made so that it cannot be misread.

- One MFU denominator for every row (`same_peak`): the highest peak among the rows' precisions on this device, so
  MFU orders the rows as their throughput does (against each row's own precision's peak, naive in fp32 read 26 %
  above a bf16 plan's 17 % that ran faster). The line under the table names it; each row's `mfu_detail` in the JSON
  records the peak and its source.
- Rows that differ show it: what the columns leave out (the fused optimizer, compile, activation checkpointing,
  pinned and non-blocking copies, CPU offload, FSDP) is a letter in the `opts` column, with a legend line for the
  letters shown. A runner-up that differed from the tuned plan only by its fused optimizer read the same as it.
- Within 80 columns: a long plan label ("guide: timeseries-after") wraps onto a second line, never cut.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from saturate.engine.summary import mfu_peak, peak_dtype
from saturate.hardware.mfu import flops_text, mfu
from saturate.plan import Plan

if TYPE_CHECKING:
    from saturate.run.side_by_side import Row
    from saturate.stats.rounds import Ratio

# The settings no column shows, each a letter in `opts` (in this order) and its legend.
OPTS: tuple[tuple[str, str, Any], ...] = (
    ("f", "fused AdamW", lambda p: p.fused_optimizer),
    ("c", "torch.compile", lambda p: p.compile == "default"),
    ("r", "compile reduce-overhead", lambda p: p.compile == "reduce-overhead"),
    ("m", "compile max-autotune", lambda p: p.compile == "max-autotune"),
    ("M", "compile max-autotune-no-cudagraphs", lambda p: p.compile == "max-autotune-no-cudagraphs"),
    ("a", "activation checkpointing", lambda p: p.activation_checkpointing),
    ("p", "pinned memory", lambda p: p.pin_memory),
    ("n", "non-blocking copies", lambda p: p.non_blocking),
    ("o", "CPU offload", lambda p: p.cpu_offload),
    ("l", "chunked loss (logits never whole)", lambda p: p.loss_chunk is not None),
    ("s", "an SDPA backend chosen (plan.attention)", lambda p: p.attention is not None),
    ("s", "FSDP (sharded)", lambda p: p.strategy == "fsdp"),
)
COMMON = "the same for every row"  # the MFU line's words when one denominator was used


def opts(plan: Plan) -> str:
    """The letters of `OPTS` a plan sets ("" for none): one per setting, each compile mode its own."""
    return "".join(letter for letter, _, on in OPTS if on(plan))


def same_peak(rows: list[Row], workload: Any, hw: Any, world_size: int) -> tuple[float | None, str]:
    """Every row's MFU against one denominator: the highest peak among the rows' precisions on this device (a row
    in fp32 and one in bf16 are both divided by the bf16 peak). Sets each row's `mfu`; returns the peak and its
    source ((None, why) when no precision has a peak, and each row's MFU says it is unknown)."""
    peaks: dict[str, tuple[float | None, str]] = {}
    for r in rows:
        dtype = peak_dtype(hw, r.plan)
        if dtype not in peaks:
            peaks[dtype] = mfu_peak(hw, r.plan)
    known = [(peak, dtype, source) for dtype, (peak, source) in peaks.items() if peak]
    if not known:
        return None, "no peak for the rows' precisions"
    peak, dtype, source = max(known, key=lambda k: k[0])
    source = f"the {dtype} peak: {source}; {COMMON}"
    for r in rows:
        r.mfu = mfu((r.samples_per_s or 0) * (workload.flops_per_sample or 0), peak, source, world_size)
    return peak, source


def mfu_line(rows: list[Row]) -> str | None:
    """The line under the table that says what MFU is divided by; None when no row has an MFU figure."""
    with_peak = [r.mfu for r in rows if r.mfu is not None and r.mfu.peak]
    if not with_peak:
        return None
    denominators = {(m.peak, m.source) for m in with_peak}
    if len(denominators) > 1:  # rows made elsewhere (a test, an old report): not comparable, said
        return "MFU: each row against its own precision's peak (not comparable between rows)"
    peak, source = denominators.pop()
    return f"MFU: model FLOP/s against {flops_text(peak or 0.0)} ({source.removesuffix('; ' + COMMON)}), {COMMON}"


NOISY = "× naive as a range (low–high): the rounds disagree on which is faster, so no ratio is a result"


def ratio_cell(vs_naive: Ratio | None, ratio: float | None) -> str:
    """The × naive cell: the median of the per-round ratios; their range where it holds 1 (the noise between rounds
    could flip the comparison: a median such as 2.22× over rounds of 0.62× and 3.81× is not a result)."""
    if vs_naive is not None and vs_naive.rounds > 1 and not (vs_naive.faster or vs_naive.slower):
        return f"{vs_naive.low:.2f}–{vs_naive.high:.2f}"
    return _f(ratio, "{:.2f}×")


def comparison_table(rows: list[Row], workload: Any, memory_kind: str, side_by_side: bool = True) -> Group:
    """The before/after table, within 80 columns, and the lines under it (what MFU is divided by, the `opts`
    letters shown): the ratio column is the median of the per-round ratios (their ranges are said in the verdicts);
    a row not in the rounds (the training run) is divided by naive's median only when naive was measured side by
    side (`side_by_side`). A plan that sets torch's threads shows them after its precision ("bf16 t1")."""
    t = Table(title=f"{workload.name}: before and after, measured in this run",
              box=box.SIMPLE_HEAVY, title_justify="left", show_edge=False, padding=(0, 0))
    tokens = workload.tokens_per_sample > 1  # samples that are not tokens get tokens/s instead of samples/s
    memory = "peak MiB" if memory_kind == "device" else "RSS MiB"
    letters = {r.label: opts(r.plan) for r in rows}
    show_opts = any(letters.values())
    for col in ("plan", "batch", "precision", *(["opts"] if show_opts else []), "wkrs",
                "tokens/s" if tokens else "samples/s", memory, "util", "MFU", "× naive"):
        t.add_column(col, justify="left" if col in ("plan", "precision", "opts") else "right",
                     overflow="fold" if col == "plan" else "ellipsis")  # a long label wraps, never cut to "…"
    base = next((r.samples_per_s for r in rows if r.label == "naive" and r.samples_per_s), None) \
        if side_by_side else None
    for r in rows:
        p = r.plan
        ratio = r.vs_naive.median if r.vs_naive else (r.samples_per_s / base if base and r.samples_per_s else None)
        t.add_row(
            r.label, f"{p.micro_batch}×{p.grad_accum}",
            p.precision + ("+tf32" if p.tf32 else "") + (f" t{p.threads}" if p.threads else ""),
            *([letters[r.label] or "-"] if show_opts else []),
            str(p.num_workers), _f(r.tokens_per_s if tokens else r.samples_per_s, "{:,.0f}" if tokens else "{:,.1f}"),
            "-" if r.peak_memory_bytes is None else f"{r.peak_memory_bytes / 2**20:,.0f}",
            _f(r.utilisation, "{:.0%}"), r.mfu.cell() if r.mfu else "-",
            ratio_cell(r.vs_naive if r.label != "naive" else None, ratio) if r.status == "ok" else r.status)
    noisy = any(r.vs_naive is not None and not (r.vs_naive.faster or r.vs_naive.slower) for r in rows
                if r.label != "naive")
    under = [line for line in (mfu_line(rows), legend([r.plan for r in rows]),
                               NOISY if noisy else None) if line]
    return Group(t, *(Text(line) for line in under))  # Text: a peak's source may hold "[/proc/…]", not markup


def legend(plans: list[Plan]) -> str | None:
    """The `opts` letters the plans set, spelled out ("opts: f fused AdamW, c torch.compile"); None when none."""
    used = [f"{letter} {what}" for letter, what, on in OPTS if any(on(p) for p in plans)]
    return "opts: " + ", ".join(used) if used else None


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)
