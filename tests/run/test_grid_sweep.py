"""`saturate sweep`: every point tuned then trained; table, plot, JSON; an interrupted sweep resumes."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
from rich.console import Console

from saturate import cli
from saturate.engine.checkpoint import CheckpointManager
from saturate.errors import ConfigError
from saturate.hardware import probe
from saturate.run.grid_sweep import grid_points, parse_grid, sweep
from saturate.tune import api
from saturate.tune.measure import RealMeasurer
from saturate.workloads.timeseries import ts_lstm_workload

TINY = {"layers": 1, "n_series": 2, "length": 300, "effective_batch": 4, "eval_windows": 8, "warmup_steps": 1,
        "window": 4}


@pytest.fixture(scope="module")
def cpu():
    """This CPU without bf16: the tests are about the sweep, and bf16 LSTM trials are slow on CPUs."""
    hw = probe(measure_peaks=False, device="cpu")
    return dataclasses.replace(hw, supports={**hw.supports, "bf16": False})


def quiet() -> Console:
    return Console(file=open("/dev/null", "w"), width=160)  # noqa: SIM115 - closed with the process


class Measurers:
    """Short trials, counted: how many points were tuned."""

    def __init__(self) -> None:
        self.tuned: list[int] = []

    def __call__(self, workload, hw):
        self.tuned.append(workload.identity["model"]["hidden"])
        return RealMeasurer(workload, hw, min_seconds=0.02, min_steps=1, max_steps=1)


def test_grid_parsing():
    assert parse_grid(["hidden=128,256", "window=30,60,90", "lr=1e-3"]) == {
        "hidden": [128, 256], "window": [30, 60, 90], "lr": [0.001]}
    assert grid_points({"a": [1, 2], "b": ["x", "y"]}) == [{"a": 1, "b": "x"}, {"a": 1, "b": "y"},
                                                         {"a": 2, "b": "x"}, {"a": 2, "b": "y"}]
    for bad, message in ((["hidden"], "expected KEY=V1,V2"), (["hidden="], "no values"), ([], "at least one"),
                         (["a=1", "a=2"], "a is given twice"), (["a=1,1"], "a value is repeated")):
        with pytest.raises(ConfigError, match=message):
            parse_grid(bad)


@pytest.mark.slow
def test_a_sweep_interrupted_mid_point_resumes_where_it_stopped(tmp_path, cpu):
    point2 = tmp_path / "sw" / "points" / "01-hidden=16"
    crash = {"on": True}

    def make(params):
        w = ts_lstm_workload(**TINY, eval_every=2, **params)  # checkpoints every 2 steps
        if params["hidden"] == 16:
            real = w.loss_fn

            def loss_fn(model, batch):
                # Point 2 "loses its machine" in training, after its first checkpoint (never while tuning).
                if crash["on"] and CheckpointManager(point2 / "run" / "checkpoints").checkpoints():
                    raise KeyboardInterrupt
                return real(model, batch)

            w.loss_fn = loss_fn
        return w

    measurers = Measurers()
    run = functools.partial(sweep, grid={"hidden": [8, 16]}, hardware=cpu, out_dir=tmp_path / "sw", steps=4,
                            try_compile=False, console=quiet(), measurer_factory=measurers)
    with pytest.raises(KeyboardInterrupt):
        run(make)
    state = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert state["points"]["hidden=8"]["status"] == "done"
    assert "hidden=16" not in state["points"]  # in progress, not recorded
    assert measurers.tuned == [8, 16]
    assert (point2 / "tune" / "plan.toml").exists()
    assert [s for s, _ in CheckpointManager(point2 / "run" / "checkpoints").checkpoints()] == [2]

    crash["on"] = False  # the machine is back
    result = run(make)
    assert measurers.tuned == [8, 16]  # nothing tuned again: point 1 was done, point 2 reuses its tuned plan
    points = result["points"]
    assert points["hidden=8"]["status"] == points["hidden=16"]["status"] == "done"
    assert points["hidden=16"]["resumed"] is True and points["hidden=8"]["resumed"] is False
    assert points["hidden=16"]["steps"] == 4 and points["hidden=16"]["val_loss"] is not None
    assert set(points["hidden=16"]["metrics"]) == {"val/mse", "val/mae", "val/mae_last_value"}
    assert result["best"] in ("hidden=8", "hidden=16") and not result["interrupted"]
    assert (tmp_path / "sw" / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    again = run(make)  # everything done: nothing runs
    assert measurers.tuned == [8, 16] and again["points"] == points


@pytest.mark.slow
def test_cli_sweep_table_plot_json_and_refusals(tmp_path, cpu, monkeypatch, capsys):
    from saturate.run import grid_sweep as sweep_module

    monkeypatch.setattr("saturate.hardware.probe", lambda **kw: cpu)
    assert sweep_module.sweep  # the CLI probes through saturate.hardware.probe
    monkeypatch.setattr(api, "RealMeasurer", functools.partial(RealMeasurer, min_seconds=0.02, min_steps=1,
                                                               max_steps=1))
    args = ["sweep", "--preset", "ts-lstm", *[f"--param={k}={v}" for k, v in TINY.items() if k != "window"],
            "--grid", "hidden=4", "window=4,6", "--steps", "2", "--no-compile", "--no-progress"]
    assert cli.main([*args, "--out", str(tmp_path / "sw")]) == 0
    out = capsys.readouterr().out
    assert "sweep results" in out and "(best)" in out and out.count("done") >= 2
    state = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert len(state["points"]) == 2 and state["settings"]["grid"] == {"hidden": [4], "window": [4, 6]}
    assert all(p["plan"]["micro_batch"] * p["plan"]["grad_accum"] == 4 for p in state["points"].values())
    assert (tmp_path / "sw" / "sweep.png").exists()

    other = [a if a != "hidden=4" else "hidden=8" for a in args]
    assert cli.main([*other, "--out", str(tmp_path / "sw")]) == 2
    assert "holds a sweep with other settings (grid)" in capsys.readouterr().err
    assert cli.main([*args, "--grid", "hiden=1,2", "--out", str(tmp_path / "bad")]) == 2
    assert "ts-lstm: unknown parameter 'hiden' (did you mean 'hidden'?)" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()  # refused before anything was written


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT"])
def test_a_preempted_sweep_exits_75_and_ctrl_c_130(tmp_path, cpu, monkeypatch, stop):
    from saturate.run import grid_sweep as sweep_module

    monkeypatch.setattr("saturate.hardware.probe", lambda **kw: cpu)
    seen = {}

    def stopped(make, grid, hw, **kw):  # the point's train() stopped by `stop`, a checkpoint written
        seen["out"] = kw["out_dir"]
        return {"points": {}, "interrupted": True, "stop_signal": stop}

    monkeypatch.setattr(sweep_module, "sweep", stopped)
    args = ["sweep", "--preset", "ts-lstm", "--grid", "hidden=4,8", "--out", str(tmp_path / "sw"), "--no-progress"]
    assert cli.main(args) == (75 if stop == "SIGTERM" else 130)  # 75 (EX_TEMPFAIL): requeue, as `train` exits
    assert seen["out"] == tmp_path / "sw"


@pytest.mark.slow
def test_the_sweep_records_the_signal_that_stopped_it(tmp_path, cpu):
    import os
    import signal

    def make(params):
        w = ts_lstm_workload(**TINY, eval_every=2, **params)
        real = w.loss_fn

        def loss_fn(model, batch):
            if model.training and CheckpointManager(tmp_path / "sw" / "points" / "00-hidden=8" / "run" /
                                                    "checkpoints").checkpoints():
                os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's preemption, after the first checkpoint
            return real(model, batch)

        w.loss_fn = loss_fn
        return w

    result = sweep(make, {"hidden": [8]}, cpu, out_dir=tmp_path / "sw", steps=6, try_compile=False, console=quiet(),
                   measurer_factory=Measurers())
    assert result["interrupted"] and result["stop_signal"] == "SIGTERM"
    assert json.loads((tmp_path / "sw" / "sweep.json").read_text())["points"]["hidden=8"]["status"] == "interrupted"
