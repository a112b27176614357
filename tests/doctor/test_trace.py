"""The doctor's trace (issue 62): a few steps after the timed ones under torch.profiler, saturate's phases as named
ranges, a Chrome trace that loads as JSON — for a loop of the user's (the Profiler) and for a preset (diagnose())."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from toy import mlp_workload, neighbours_ignored, one_thread  # noqa: F401

from conftest import run_main
from saturate import Profiler
from saturate.doctor.diagnose import DoctorConfig, diagnose
from saturate.doctor.report import render
from saturate.doctor.trace import TraceFiles
from saturate.plan import Plan

pytestmark = pytest.mark.usefixtures("one_thread", "neighbours_ignored")


def ranges(trace: str | Path) -> Counter:
    """How often each of saturate's named ranges appears in a Chrome trace."""
    events = json.loads(Path(trace).read_text())["traceEvents"]
    return Counter(e["name"] for e in events if str(e.get("name", "")).startswith("saturate: "))


def profiled(tmp_path: Path, **kw) -> tuple[Profiler, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return Profiler(model, opt, warmup=1, count_steps=1, steps=3, report=False, trace=tmp_path / "t", **kw), model, opt


def run_loop(prof: Profiler, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    loader = DataLoader(TensorDataset(torch.randn(512, 8), torch.randn(512, 1)), batch_size=8)
    for i, (x, y) in enumerate(prof.data(loader)):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        prof.step()
        if i + 1 == steps:
            break


def test_a_loop_is_traced_after_its_timed_steps_with_its_phases_as_ranges(tmp_path):
    prof, model, opt = profiled(tmp_path, trace_steps=2)
    run_loop(prof, model, opt, steps=1 + 1 + 3 + 1)
    assert prof.diagnosis is not None and not prof.finished  # diagnosed; one traced step so far, hooks still on
    run_loop(prof, model, opt, steps=3)  # the loop goes on: the second traced step ends the trace
    assert prof.finished
    m = prof.diagnosis.measurements
    assert m.steps == 3  # the timed figures are the timed steps' only
    files = TraceFiles.from_dict(m.trace)
    assert files is not None and files.steps == 2 and Path(files.trace) == tmp_path / "t" / "trace.json"
    seen = ranges(files.trace)
    assert seen["saturate: step 1"] == seen["saturate: step 2"] == 1 and "saturate: step 3" not in seen
    for phase in ("data", "forward", "backward", "optimizer"):
        assert seen[f"saturate: {phase}"] == 2, (phase, seen)  # once in each traced step
    assert files.memory is None  # a CPU: no memory snapshot


def test_a_loop_that_ends_inside_the_trace_keeps_what_was_traced(tmp_path):
    prof, model, opt = profiled(tmp_path)  # three steps to trace
    run_loop(prof, model, opt, steps=1 + 1 + 3 + 1)
    d = prof.finish()  # the loop ended after one traced step
    files = TraceFiles.from_dict(d.measurements.trace)
    assert files is not None and files.steps == 1 and ranges(files.trace)["saturate: step 1"] == 1


def test_a_preset_is_traced_after_its_timed_steps_and_the_report_says_how_to_open_it(tmp_path, cpu, capfd):
    from toy import Samples

    workload = mlp_workload(Samples(), effective_batch=8)
    config = DoctorConfig(steps=3, warmup=1, count_steps=1, min_seconds=0.0, scaling=False, trace=tmp_path,
                          trace_steps=2)
    d = diagnose(workload, Plan(micro_batch=4, grad_accum=2), config, hardware=cpu)
    files = TraceFiles.from_dict(d.measurements.trace)
    assert files is not None and files.steps == 2
    seen = ranges(files.trace)
    assert seen["saturate: forward"] == seen["saturate: backward"] == 4  # two micro-batches in each of two steps
    assert seen["saturate: optimizer"] == 2 and seen["saturate: step 2"] == 1
    assert "profiler_start" not in capfd.readouterr().err  # the profiler library's own lines are kept off stderr
    render(d)
    out = capfd.readouterr().out
    assert f"trace of 2 steps after the timed ones: {files.trace}" in out and "ui.perfetto.dev" in out
    untraced = diagnose(workload, Plan(micro_batch=4, grad_accum=2), DoctorConfig(
        steps=3, warmup=1, count_steps=1, min_seconds=0.0, scaling=False), hardware=cpu)
    assert untraced.measurements.trace is None


@pytest.mark.parametrize(("args", "message"), [
    (["--trace-dir", "{tmp}/x", "--no-trace"], "--trace-dir and --no-trace cannot be given together"),
    (["--trace-dir", "{tmp}/file"], "is a file, not a folder; choose another --trace-dir"),
])
def test_the_trace_flags_are_refused_in_one_line(tmp_path, capsys, args, message):
    (tmp_path / "file").write_text("")
    out = run_main(capsys, "doctor", "--preset", "gpt-tiny", *[a.format(tmp=tmp_path) for a in args])
    assert out.returncode != 0 and message in out.stderr and not (tmp_path / "x").exists()


def test_the_default_trace_folder_is_named_in_the_temporary_folder_and_made_only_when_written(tmp_path, monkeypatch):
    import tempfile

    from saturate.script.scratch import DOCTOR_PREFIX, doctor_folder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = doctor_folder(None)
    assert folder.parent == tmp_path and folder.name.startswith(DOCTOR_PREFIX) and not folder.exists()
    assert doctor_folder(tmp_path / "mine") == tmp_path / "mine"
