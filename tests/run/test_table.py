"""The before/after table cannot be misread (issue 31): one MFU denominator, rows that differ look different, and
the untuned training's predictions each name the measurement they come from. Fake rows, recorded figures."""

from __future__ import annotations

from types import SimpleNamespace

from rich.console import Console

from saturate.plan import Plan
from saturate.run.costs import untuned_line
from saturate.run.side_by_side import Row
from saturate.run.table import comparison_table, legend, mfu_line, opts, same_peak

PEAKS = {"fp32": 1e12, "tf32": 1e12, "bf16": 4e12, "fp16": 4e12}  # a device whose bf16 peak is 4× its fp32 one
HW = SimpleNamespace(supports={}, peak_flops=lambda dtype: (PEAKS[dtype], f"test {dtype} peak"))
WORKLOAD = SimpleNamespace(name="gpt-tiny", tokens_per_sample=128, flops_per_sample=1e8)


def _row(label: str, sps: float, **plan: object) -> Row:
    p = Plan(micro_batch=8, grad_accum=4, name=label, **plan)  # type: ignore[arg-type]
    return Row(label, p, sps, sps * 128, 0.1, 2**20, 0.9, None)


def _text(rows: list[Row], width: int = 80) -> str:
    console = Console(record=True, width=width, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(comparison_table(rows, WORKLOAD, "host RSS"))
    return console.export_text()


def _fits(rows: list[Row]) -> list[str]:
    """The table and the lines under it as printed off a terminal (80 columns), having checked that nothing is cut
    to "…" to fit (a long label wraps instead)."""
    lines = _text(rows).splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80 and "…" not in "".join(lines), "\n".join(lines)
    return lines


def _rows() -> list[Row]:
    # The run that read naive 26.4 % above tuned 17.3 %: naive fp32 against the fp32 peak, tuned bf16 against bf16's.
    return [_row("naive", 20.0), _row("runner-up", 60.0, precision="bf16", threads=1),
            _row("tuned", 50.0, precision="bf16", threads=1, fused_optimizer=True),
            _row("training run", 52.0, precision="bf16", threads=1, fused_optimizer=True)]


def test_every_row_s_mfu_has_one_denominator_and_orders_like_throughput():
    rows = _rows()
    peak, source = same_peak(rows, WORKLOAD, HW, 1)
    assert peak == 4e12 and source.startswith("the bf16 peak: test bf16 peak")
    assert [r.mfu.peak for r in rows] == [4e12] * 4
    by_mfu = sorted(rows, key=lambda r: r.mfu.value)
    assert by_mfu == sorted(rows, key=lambda r: r.samples_per_s)  # naive (fp32) is no longer above the bf16 plans
    assert rows[0].mfu.value == 20.0 * 1e8 / 4e12
    detail = rows[0].to_dict()["mfu_detail"]  # the JSON records the denominator used
    assert detail["peak"] == 4e12 and "bf16 peak" in detail["source"] and "same for every row" in detail["source"]
    text = " ".join(_text(rows).split())  # the line under the table wraps at 80 columns
    assert "MFU: model FLOP/s against 4 TFLOP/s (the bf16 peak: test bf16 peak), the same for every row" in text
    assert "0.1 %" in text and "0.1 %" in text  # naive 2e9 / 4e12; the training run 5.2e9 / 4e12


def test_rows_with_their_own_peaks_are_said_not_comparable():
    from saturate.hardware.mfu import mfu

    rows = _rows()[:2]
    rows[0].mfu, rows[1].mfu = mfu(2e11, 1e12, "fp32 peak"), mfu(6e11, 4e12, "bf16 peak")
    assert mfu_line(rows) == "MFU: each row against its own precision's peak (not comparable between rows)"
    assert mfu_line([_row("naive", 1.0)]) is None  # no MFU at all: no line


def test_no_peak_for_any_precision_leaves_every_mfu_unknown():
    hw = SimpleNamespace(supports={}, peak_flops=lambda dtype: (None, "unknown"))
    import saturate.hardware.peak_store as store

    original = store.matmul_peak
    store.matmul_peak = lambda hw, dtype: (_ for _ in ()).throw(RuntimeError("no matmul"))  # type: ignore[assignment]
    try:
        rows = _rows()
        assert same_peak(rows, WORKLOAD, hw, 1) == (None, "no peak for the rows' precisions")
    finally:
        store.matmul_peak = original
    assert all(r.mfu is None for r in rows) and "MFU: " not in _text(rows)


def test_rows_that_differ_in_a_setting_no_column_shows_differ_in_the_table():
    rows = _rows()
    same_peak(rows, WORKLOAD, HW, 1)
    lines = _fits(rows)
    runner, tuned = (next(line for line in lines if line.startswith(label)) for label in ("runner-up", "tuned"))
    # Both read "8×4 bf16 t1" before; the fused optimizer is the one difference, and it shows.
    assert runner.split()[1:4] == ["8×4", "bf16", "t1"] and tuned.split()[1:4] == ["8×4", "bf16", "t1"]
    assert runner.split()[4] == "-" and tuned.split()[4] == "f"
    assert "opts: f fused AdamW" in lines


def test_opts_letters_and_legend():
    plan = Plan(fused_optimizer=True, compile="max-autotune", activation_checkpointing=True, pin_memory=True,
                non_blocking=True, cpu_offload=True, strategy="fsdp")
    assert opts(plan) == "fmapnos" and opts(Plan()) == "" and opts(Plan(compile="default")) == "c"
    assert opts(Plan(compile="reduce-overhead")) == "r" != opts(Plan(compile="max-autotune-no-cudagraphs")) == "M"
    assert legend([Plan(compile="max-autotune"), Plan(fused_optimizer=True)]) == (
        "opts: f fused AdamW, m compile max-autotune")
    assert legend([Plan()]) is None
    assert "opts" not in _text([_row("naive", 20.0)])  # nothing to mark: no column, no legend


def test_the_table_with_every_mark_and_a_long_label_fits_80_columns():
    rows = [_row("guide: timeseries-after", 1234.5, precision="bf16", tf32=True, threads=12, num_workers=4,
                 pin_memory=True, non_blocking=True),
            _row("tuned", 4567.8, precision="bf16", tf32=True, threads=12, fused_optimizer=True,
                 compile="max-autotune", activation_checkpointing=True)]
    same_peak(rows, WORKLOAD, HW, 1)
    lines = _fits(rows)
    guide, tuned = (next(line for line in lines if line.startswith(label)) for label in ("guide:", "tuned"))
    assert guide.split()[4] == "pn" and tuned.split()[4] == "fma", "\n".join(lines)  # after "8×4 bf16+tf32 t12"
    assert lines[lines.index(guide) + 1].strip().startswith("timeseries")  # the label goes on, not cut to "…"


def test_the_untuned_training_s_two_predictions_name_their_measurements():
    # The run that printed 2372 s in one line and 1047 s in another: one from naive's one cold measurement before
    # tuning (it sized the budget), one from naive's side-by-side speed.
    line = untuned_line({"predicted_untuned_s": 1047.0}, 2372.0, side_by_side=True)
    assert "predicted at 1047 s from naive's side-by-side speed" in line
    assert "naive's one measurement before tuning, which sized the budget, predicted 2372 s" in line
    assert "2372" not in untuned_line({"predicted_untuned_s": 1047.0}, 1100.0, side_by_side=True)  # within 10 %
    assert "from naive's one measurement before tuning" in untuned_line({"predicted_untuned_s": 90.0}, 90.0, False)
    assert untuned_line({}, 2372.0, True) == ""


def test_a_ratio_the_rounds_disagree_on_is_shown_as_its_range_not_a_median():
    from saturate.stats.rounds import Ratio

    rows = _rows()
    same_peak(rows, WORKLOAD, HW, 1)
    rows[1].vs_naive = Ratio.of([2.9, 3.0, 3.1])  # beyond the noise: the median
    rows[2].vs_naive = Ratio.of([0.62, 3.81])  # the run that printed 2.22× beside "no measurable gain (0.62–3.81×)"
    lines = _fits(rows)
    runner, tuned = (next(line for line in lines if line.startswith(label)) for label in ("runner-up", "tuned"))
    assert runner.endswith("3.00×") and tuned.endswith("0.62–3.81") and "2.22" not in tuned
    assert any(line.startswith("× naive as a range") for line in lines)
    rows[2].vs_naive = Ratio.of([2.4, 2.6])
    assert not any(line.startswith("× naive as a range") for line in _fits(rows))


def test_naive_against_itself_reads_one_not_a_range():
    """naive's own rounds ratio is 1 in every round, "within noise" by construction: its cell is 1.00×, not the
    range "1.00–1.00" a noisy comparison gets."""
    from saturate.stats.rounds import Ratio

    rows = _rows()
    same_peak(rows, WORKLOAD, HW, 1)
    rows[0].vs_naive = Ratio.of([1.0, 1.0])
    naive = next(line for line in _fits(rows) if line.startswith("naive"))
    assert naive.endswith("1.00×") and "1.00–1.00" not in naive, naive
