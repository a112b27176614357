"""Human output fits an 80-column terminal: probe, doctor (and script doctor), monitor, sweep and train's
summary, rendered at width 80: no line longer, nothing cut to "…". (The tuner's trial tables and run's
before/after table have their own tests.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from rich.console import Console

from saturate.doctor.findings import Measurements, ScalingProbe
from saturate.doctor.report import render as render_diagnosis
from saturate.doctor.rules import decide
from saturate.engine.console import ConsoleSink
from saturate.engine.summary import RunResult
from saturate.hardware import render_hardware
from saturate.hardware.readings import GpuReading, HostReading
from saturate.plan import Plan
from saturate.run.grid_sweep import results_table
from saturate.telemetry import Stat
from saturate.telemetry.monitor import render as render_monitor

GIB = 1024**3
LONG_DIR = Path("runs") / "gpt-small-20260101-120000" / "a-rather-long-subfolder-name" / "checkpoints"


def fits(draw, width: int = 80) -> str:
    console = Console(record=True, width=width, file=open("/dev/null", "w"), highlight=False)  # noqa: SIM115
    draw(console)
    text = console.export_text()
    long = [line for line in text.splitlines() if len(line) > width]
    assert not long, "\n".join(long)
    assert "…" not in text, text
    return text


def test_probe(cpu):
    gpu_like = dataclasses.replace(cpu, notes=[*cpu.notes, "a long note " * 12])
    fits(lambda c: render_hardware(gpu_like, c))


def _slow_gpu_step() -> Measurements:
    return Measurements(
        device_type="cuda", device_name="NVIDIA H100 80GB HBM3", timing="device time (CUDA events)", steps=10,
        step_s=0.412, phases={"data": 0.2, "h2d": 0.01, "forward": 0.06, "backward": 0.12, "optimizer": 0.02,
                              "other": 0.002},
        micro_batch=8, grad_accum=4, num_workers=0, precision="fp32", compile="none", supports_bf16=True,
        syncs_per_step=3.0, syncs_by_phase={"forward": 1.0, "other": 2.0}, sync_method="set_sync_debug_mode",
        cpu_cores=16, host_ram_total=128 * GIB, host_ram_available_min=90 * GIB, swap_bytes=0, tree_peak=6 * GIB,
        main_peak=5 * GIB, host_budget=90 * GIB, device_mem_total=80 * GIB, device_mem_peak=31 * GIB,
        device_util=Stat(41.0, 99.0, 3.0, 40), host_cpu=Stat(12.0, 30.0, 5.0, 40), samples_per_step=32.0,
        scaling=ScalingProbe(micro_batches=(4, 8), seconds=(0.05, 0.09)),
        item_s=0.004, notes=["a note about the run " * 6], context="plan")


def test_doctor():
    fits(lambda c: render_diagnosis(decide(_slow_gpu_step()), c))


def test_script_doctor():
    from saturate.script.command import ScriptRun
    from saturate.script.doctor_script import render_script

    report = {"model": {"class": "GPT", "parameters": 124_000_000, "wrapped_in": ["DistributedDataParallel"]},
              "optimizer": {"class": "AdamW", "site": "train.py:88"},
              "loaders": [{"site": "/home/someone/projects/a-long-project-name/train.py:61", "batch_size": 8,
                           "num_workers": 0, "pin_memory": False, "batches": 40}]}
    values = {"command": ["python", "train.py", "--config", "configs/a-long-config-name.yaml"], "report": report}
    run = ScriptRun(returncode=0, summary=None, optimizer_steps=12, seconds=30.0, **values)
    fits(lambda c: render_script(decide(_slow_gpu_step()), run, c))


def _monitor_data(n_gpus: int) -> dict:
    gpus = [dataclasses.asdict(GpuReading(i, "NVIDIA H100 80GB HBM3", 97.0, 61 * GIB, 80 * GIB, 612.0, 700.0,
                                          1980.0, 2619.0, 71.0)) for i in range(n_gpus)]
    host = HostReading(cpu_pct=43.0, cpu_count=128, ram_total=2000 * GIB, ram_used=600 * GIB,
                       ram_available=1400 * GIB, swap_total=0, swap_used=0, swap_in=None, swap_out=None)
    job = {"run_dir": str(LONG_DIR), "pid": 123456, "step": 1500, "total_steps": 20000, "tokens_per_s": 1.2e6,
           "mfu": 0.41, "loss": 2.3456, "logged_s_ago": 3.0}
    return {"time": 0.0, "gpu_source": "nvml", "gpu_note": None, "gpus": gpus, "host": dataclasses.asdict(host),
            "job": job}


@pytest.mark.parametrize("n_gpus", [1, 8])
def test_monitor(n_gpus):
    fits(lambda c: c.print(render_monitor(_monitor_data(n_gpus))))


def test_monitor_wide_keeps_the_clocks():
    text = fits(lambda c: c.print(render_monitor(_monitor_data(1), wide=True)), width=160)
    assert "SM clock" in text and "1980 MHz" in text


def _sweep_rows() -> list[dict]:
    rows = []
    for i, (hidden, window) in enumerate([(128, 30), (256, 30), (128, 90), (256, 90)]):
        rows.append({"params": {"hidden": hidden, "window": window}, "status": "done",
                     "plan": {"micro_batch": 64, "grad_accum": 4, "precision": "bf16", "num_workers": 2},
                     "samples_per_s": 12345.6 + i, "val_loss": 0.123456, "train_seconds": 1234.5,
                     "metrics": {"val/mse": 0.01, "val/mae": 0.05, "val/mae_last_value": 0.07}})
    rows.append({"params": {"hidden": 512, "window": 90}, "status": "failed",
                 "error": "nothing fits at micro-batch 1 even with activation checkpointing on this device"})
    return rows


def test_sweep():
    rows = _sweep_rows()
    text = fits(lambda c: c.print(results_table(rows, ["hidden", "window"], rows[0])))
    assert "12,345.6" in text and "nothing fits" in text


def test_sweep_wide_keeps_every_column():
    rows = _sweep_rows()
    text = fits(lambda c: c.print(results_table(rows, ["hidden", "window"], rows[0], wide=True)), width=200)
    assert "val/mae_last_value" in text or "mae_last_value" in text and "workers" in text


def test_train_summary():
    result = RunResult(run_dir=LONG_DIR.parent, plan=Plan(), steps=2000, total_steps=2000, train_seconds=1234.5,
                       tokens_per_s=1.234e6, samples_per_s=1205.1, mfu=0.412, peak_label="measured bf16 matmul peak",
                       peak_memory_bytes=31 * GIB, memory_kind="host RSS", train_loss=2.3456, val_loss=2.4567,
                       checkpoint=LONG_DIR / "ckpt-2000.pt", weights=LONG_DIR.parent / "model.safetensors",
                       stopped_early=True, interrupted=False,
                       metrics={"val/mae_last_value": 0.07})

    def draw(c: Console) -> None:
        sink = ConsoleSink(2000, console=c)
        sink.finish(result)

    text = fits(draw)
    assert "ckpt-2000.pt" in text


def test_a_verb_s_wrapped_lines_never_end_in_a_space(capsys, tmp_path, monkeypatch):
    # rich keeps the space a wrapped line broke at; the CLI's consoles (cli/output.py tidy_console) drop it.
    from conftest import run_main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SATURATE_ISOLATION", "off")
    out = run_main(capsys, "tune", "--", "python3", "no_such_script.py")
    assert out.returncode == 2
    lines = (out.stdout + out.stderr).splitlines()
    assert any(line.startswith("tune: each trial runs your command") for line in lines), lines
    assert len([line for line in lines if line.strip()]) > 3 and not [line for line in lines if line.endswith(" ")]


def test_bullets_and_notes_wrap_with_a_hanging_indent_and_no_space_at_a_line_s_end(capsys):
    from saturate.engine.console import tidy_console

    c = tidy_console(width=50)
    c.print("  • precision: fp32 (no lower precision is native here; 22.9 samples/s at micro-batch 8)")
    c.print("[yellow]note:[/yellow] the tuned plan was measured slower than naive in every round (naive 1.29× "
            "(1.23–1.36) of tuned, beyond the noise)")
    c.print("a plain paragraph that is long enough to wrap over the fifty columns of this console")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "  • precision: fp32 (no lower precision is native"  # the first line as rich wraps it
    assert lines[1] == "    here; 22.9 samples/s at micro-batch 8)"  # the rest under the text
    note = next(i for i, line in enumerate(lines) if line.startswith("note:"))
    assert lines[note + 1].startswith("      ") and lines[note + 1].strip()  # under the note's text
    assert lines[-1].startswith("the fifty")  # a paragraph wraps as ever
    assert all(len(line) <= 50 and not line.endswith(" ") for line in lines), lines


def test_on_a_terminal_styled_padding_does_not_end_a_line_in_a_space(capsys):
    """On a terminal a styled cell's padding is followed by its colour's reset code (a table's title, a wrapped
    styled word): the spaces go, the codes stay."""
    import re

    from rich.table import Table

    from saturate.engine.console import tidy_console

    c = tidy_console(width=50, force_terminal=True)
    c.print("[yellow]machine busy:[/] other processes kept 1.0 of 2 usable CPU cores busy (52 %) over the trials")
    t = Table(title="run summary (measured in this run)")
    t.add_column("plan")
    t.add_row("8×4 fp32 fused, a label long enough to make the table as wide as the console")
    c.print(t)
    raw = capsys.readouterr().out
    assert "\x1b[" in raw  # colour codes: a terminal's output
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in raw.splitlines()]
    assert any("run summary" in line for line in lines) and len(lines) > 5
    assert not [line for line in lines if line.endswith(" ")], lines


def test_the_live_progress_keeps_the_step_and_the_eta_at_80_columns():
    """On a terminal the training's live line is the bar (step N/M, ETA) with the window's figures under it: on one
    line they overflowed 80 columns and rich cut the step counter and the ETA to "…" (seen 2026-11-26)."""
    import io
    from types import SimpleNamespace

    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=True, record=True)
    sink = ConsoleSink(300, console=console)
    sink.start(SimpleNamespace(name="gpt-tiny", info={}, tokens_per_sample=128), Plan(micro_batch=8, grad_accum=4),
               SimpleNamespace(torch_device="cpu"), 32, 300, None)
    sink.log(120, {"train/loss": 1.8651, "throughput/tokens_per_s": 123_400.0, "throughput/mfu": 0.666,
                   "memory/peak_gib": 12.34, "gpu/util_pct": 99.0, "host/ram_used_pct": 12.0})
    sink._progress.stop()
    shown = fits(lambda c: c.print(sink._progress.get_renderable()))  # what the live display draws
    lines = [line for line in shown.splitlines() if line.strip()]
    bar = next(line for line in lines if line.startswith("step 120/300"))
    assert "ETA" in bar, shown
    assert any(line.startswith("loss 1.8651  123.4k tok/s  MFU 66.6%  mem 12.34 GiB  GPU 99%") for line in lines), shown
