"""The tuner's tables fit 80 columns by default with nothing cut off; --wide shows every figure; the plot."""

from __future__ import annotations

import json

from rich.console import Console
from test_search import FakeMachine, GiB, linear_memory, saturating, settings

from saturate.plan import Plan
from saturate.tune.evidence import chosen_trial, loader_table, micro_batch_series, plot, print_report, trials_table
from saturate.tune.search import search
from saturate.tune.trial import LoaderTrial, Trial


def render(renderable, width: int = 80) -> list[str]:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(renderable)
    return console.export_text().splitlines()


def busy_trials() -> list[Trial]:
    """Trials as long as they get: long stages, every knob on, a long error, a long verdict, contention."""
    big = Plan(micro_batch=128, grad_accum=16, precision="bf16", tf32=True, activation_checkpointing=True,
               fused_optimizer=True, compile="max-autotune", strategy="fsdp", cpu_offload=True)
    return [
        Trial(stage="precision", plan=Plan(micro_batch=8, grad_accum=256), samples_per_s=12345.6, spread=0.123,
              windows=16, step_s=0.166, peak_memory_bytes=75 * GiB, seconds=123.4, contended=True, busy_cores=1.2,
              verdict="+2.0 %, within noise (±5.0 %) vs fp32, the simpler is kept " * 2),
        Trial(stage="activation-checkpointing", plan=big, samples_per_s=99999.9, spread=0.004, windows=3,
              step_s=0.02, peak_memory_bytes=3 * 2**20, compile_s=42.0, seconds=9.9, verdict="chosen"),
        Trial(stage="activation-checkpointing", plan=big, samples_per_s=99999.9, spread=0.004, windows=24,
              step_s=0.02, seconds=9.9, paired=True,
              verdict="paired with 128×16: +4.0 %, beyond noise (±1.0 %); in 24 alternating pairs: faster in 20"),
        Trial(stage="micro-batch", plan=Plan(micro_batch=64, grad_accum=32), status="oom",
              error="OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.10 GiB total "
                    "capacity; 60.00 GiB already allocated)", seconds=1.0),
    ]


def busy_loader() -> list[LoaderTrial]:
    return [LoaderTrial(16, 4, True, samples_per_s=123456.7, spread=0.25, windows=8, worker_memory_bytes=12 * GiB,
                        startup_s=12.34, verdict="workers use 12.00 GiB > RAM budget 10.00 GiB, and more words"),
            LoaderTrial(0, None, False, samples_per_s=10.0, worker_memory_bytes=0, verdict="chosen")]


def test_tables_fit_80_columns_and_cut_nothing():
    for table in (trials_table(busy_trials(), 128, "host RSS"), loader_table(busy_loader())):
        lines = render(table)
        assert lines and max(len(line) for line in lines) <= 80, "\n".join(lines)
        text = "\n".join(lines)
        assert "…" not in text
    text = "\n".join(render(trials_table(busy_trials(), 128, "host RSS")))
    words = " ".join(text.split())
    for piece in ("128×16 bf16+tf32 AC", "fused max-autotune", "fsdp+offload"):  # the long plan wrapped, not cut
        assert piece in text
    assert "12,346 ±12.3 %*" in text and "other processes kept the machine busy" in words
    assert "→ chosen" in text and "allocated)" in words  # outcomes on lines of their own, whole
    assert "checkpointing ⇄" in text and "⇄ paired: two plans timed again in alternating windows" in words


def test_wide_tables_show_every_figure():
    text = "\n".join(render(trials_table(busy_trials(), 128, "host RSS", wide=True), width=250))
    for column in ("micro×accum", "windows", "tokens/s", "step s", "busy cores", "compile s", "outcome"):
        assert column in text
    narrow = "\n".join(render(trials_table(busy_trials(), 128, "host RSS")))
    assert "compile s" not in narrow and "tokens/s" not in narrow
    assert "activation-checkpointing (paired)" in text
    assert "start-up s" in "\n".join(render(loader_table(busy_loader(), wide=True), width=200))


def test_plot_series_keep_configurations_apart_and_mark_the_chosen_trial(tmp_path):
    machine = FakeMachine(speed=saturating(16), memory=linear_memory(GiB, 0.1 * GiB), spread=0.02)
    result = search(machine, Plan(), settings(try_compile=False, supports={"bf16": True}))
    assert result.plan.fused_optimizer and result.plan.micro_batch == 16
    series = micro_batch_series(result.trials)
    assert set(series) >= {"bf16", "bf16 fused", "fp32"}
    # The fused trial is its own series; the unfused one at 16 stays with its micro-batch climb.
    assert [m for m, _, _ in series["bf16 fused"]] == [16]
    assert 16 in [m for m, _, _ in series["bf16"]] and len(series["bf16"]) > 1
    own = chosen_trial(result)
    assert own is not None and own.stage == "fused-optimizer" and own.plan.fused_optimizer
    paths, note = plot(result, tmp_path, 1.5)
    assert note is None and (tmp_path / "micro_batch.png").read_bytes()[:4] == b"\x89PNG"


def test_report_says_warnings_first_and_json_keeps_the_spread():
    from saturate.tune.evidence import result_dict

    machine = FakeMachine(speed=saturating(16), memory=linear_memory(GiB, 0.1 * GiB), spread=0.02,
                          verify_speed=lambda p, n: saturating(16)(p) * 0.3)
    result = search(machine, Plan(), settings(try_compile=False))
    lines = render(_Report(result))
    assert lines[0].startswith("warning: the chosen plan verified at")
    assert max(len(line) for line in lines) <= 80
    data = json.loads(json.dumps(result_dict(result), default=str))
    assert data["warnings"] and all("spread" in t for t in data["trials"] if t["status"] == "ok")


class _Report:
    def __init__(self, result) -> None:
        self.result = result

    def __rich_console__(self, console, options):
        print_report(console, self.result, 1, "device")
        return iter(())
