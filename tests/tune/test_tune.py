"""The tuner end to end on the CPU with real measurements (short trials), its files, cache and refusals."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from conftest import cli_env, run_saturate, saturate_cmd
from saturate import plan_cache as cache
from saturate.engine import hostmem
from saturate.engine.hostmem import HostMemoryGuard, relieve
from saturate.engine.step import OutOfMemoryError
from saturate.engine.trainer import RunConfig, train
from saturate.errors import ConfigError
from saturate.plan import Plan
from saturate.tune import tune
from saturate.tune.measure import RealMeasurer
from saturate.workloads import build_workload


@pytest.fixture
def workload(small_corpus):
    # One block of gpt-tiny: its layers as wide (bf16 and the memory fit behave alike), a quarter of the compute.
    return build_workload("gpt-tiny", data=[str(small_corpus)], effective_batch=8, warmup_steps=2, n_layer=1)


def quick(workload, hw, **kw) -> RealMeasurer:
    return RealMeasurer(workload, hw, min_seconds=0.1, min_steps=2, max_steps=3, **kw)


def quiet() -> Console:
    return Console(file=open("/dev/null", "w"), width=160)  # noqa: SIM115 - closed with the process


@pytest.mark.slow
def test_tune_writes_a_verified_plan_with_its_evidence_and_train_reuses_it(tmp_path, workload, cpu):
    result = tune(workload, cpu, out_dir=tmp_path / "tune", measurer=quick(workload, cpu), try_compile=False,
                  console=quiet())
    plan = Plan.load(tmp_path / "tune" / "plan.toml")
    assert plan.name == "tuned" and plan.samples_per_step() == 8  # the effective batch is kept exactly
    assert plan.provenance["hardware"] == cpu.fingerprint()
    evidence = json.loads((tmp_path / "tune" / "tune.json").read_text())
    trials = evidence["trials"]
    assert "trials" not in (tmp_path / "tune" / "plan.toml").read_text()  # plan.toml: the settings only
    # "chosen", or "chosen, but inconsistent: …" when this (busy) machine measured it far below its trial
    assert trials[-1]["stage"] == "verify" and trials[-1]["verdict"].startswith("chosen")
    assert trials[-1]["micro_batch"] == plan.micro_batch  # the plan written is the plan verified
    assert {t["stage"] for t in trials} >= {"precision", "verify"}
    # Host RAM holds even the largest micro-batch in proportion: no memory trial, and the decision says why.
    assert any(d.startswith("memory: ") and "(a prediction)" in d for d in evidence["decisions"])
    assert evidence["loader_trials"] and plan.provenance["evidence"].endswith("tune.json")
    # Every timed trial has its windows and the machine's load is recorded, before and during the search.
    assert all(t["windows"] >= 1 and len(t["window_samples_per_s"]) == t["windows"]
               for t in evidence["trials"] if t["status"] == "ok")
    assert {"other_cores", "significant"} <= set(evidence["contention"]) and "significant" in evidence[
        "contention_before"]
    assert [p.name for p in result.plots] == ["micro_batch.png", "loader.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in result.plots)
    if cpu.supports.get("bf16"):  # a CPU with native bf16 gets it by trial, after the loss check
        assert any(t["precision"] == "bf16" for t in trials)

    config = RunConfig(run_dir=tmp_path / "run", steps=2, progress=False, tensorboard=False)
    run = train(workload, None, config, hardware=cpu)
    assert run.plan.name == "tuned" and any("using the plan tuned" in n for n in run.notes)
    plain = train(workload, None, dataclasses.replace(config, run_dir=tmp_path / "plain", use_tuned=False),
                  hardware=cpu)
    assert plain.plan.name == "default"


def test_a_plan_tuned_elsewhere_is_flagged(tmp_path, workload, cpu):
    elsewhere = Plan(micro_batch=4, grad_accum=2, name="tuned",
                     provenance={"hardware": "0123456789abcdef", "hardware_description": "NVIDIA H200"})
    config = RunConfig(run_dir=tmp_path / "run", steps=1, progress=False, tensorboard=False)
    result = train(workload, elsewhere, config, hardware=cpu)
    assert any("tuned on other hardware (NVIDIA H200)" in n for n in result.notes)
    cache.store(elsewhere, workload, "0123456789abcdef")
    plan, notes = cache.lookup(workload, cpu.fingerprint())
    assert plan is None and any("on other hardware exists" in n for n in notes)


@pytest.mark.slow
def test_oom_during_the_search_is_caught(tmp_path, workload, cpu):
    build = workload.build_model

    def build_model():
        model = build()

        def hook(module, args):
            if args[0].shape[0] > 2:
                raise OutOfMemoryError(f"simulated: micro-batch {args[0].shape[0]}")

        model.register_forward_pre_hook(hook)
        return model

    oomy = dataclasses.replace(workload, build_model=build_model)
    result = tune(oomy, cpu, out_dir=tmp_path / "tune", measurer=quick(oomy, cpu), try_compile=False,
                  console=quiet(), use_cache=False)
    statuses = [(t.plan.micro_batch, t.status) for t in result.search.trials]
    assert (8, "oom") in statuses  # the probe micro-batch ran out of memory and the search backed off
    assert result.plan.micro_batch <= 2 and result.search.chosen.ok


@pytest.mark.slow
def test_loader_stays_in_process_under_a_tiny_ram_budget(tmp_path, workload, cpu):
    result = tune(workload, cpu, out_dir=tmp_path / "tune", measurer=quick(workload, cpu, ram_budget=1),
                  try_compile=False, console=quiet(), use_cache=False)
    assert result.plan.num_workers == 0
    with_workers = [t for t in result.search.loader_trials if t.num_workers > 0]
    assert with_workers and all("RAM budget" in t.verdict for t in with_workers)


def test_a_budget_too_small_changes_nothing_and_keeps_the_plan_the_user_had(tmp_path, workload, cpu):
    from saturate.workloads.coupling import workload_default_plan

    result = tune(workload, cpu, out_dir=tmp_path / "tune", budget_s=0.001, measurer=quick(workload, cpu),
                  console=quiet())
    informed, _ = workload_default_plan(workload, cpu)
    assert result.search is None and result.kept.startswith("no change measured: tuning budget 0.001 s is too small")
    assert result.plan == informed and Plan.load(result.plan_path).knobs() == informed.knobs()
    evidence = json.loads(result.json_path.read_text())
    assert evidence["changed"] is False and len(evidence["trials"]) == 1  # the one trial it measured, kept
    assert cache.lookup(workload, cpu.fingerprint())[0] is None  # nothing cached by a tune that changed nothing
    bf16 = Plan(name="tuned", micro_batch=2, grad_accum=4, precision="bf16")
    cache.store(bf16, workload, cpu.fingerprint())
    again = tune(workload, cpu, out_dir=tmp_path / "t1", budget_s=0.001, measurer=quick(workload, cpu),
                 console=quiet())
    assert again.plan.knobs() == bf16.knobs() and "the plan cached for this job" in again.notes[0]
    assert cache.lookup(workload, cpu.fingerprint())[0].knobs() == bf16.knobs()
    apart = tune(workload, cpu, out_dir=tmp_path / "t2", budget_s=0.001, measurer=quick(workload, cpu),
                 console=quiet(), use_cache=False)  # told to leave the cache alone: the informed plan
    assert apart.plan.knobs() == informed.knobs() and "the informed starting plan" in apart.notes[0]
    with pytest.raises(ConfigError, match="too small"):  # a caller that handles it itself (`run`)
        tune(workload, cpu, out_dir=tmp_path / "t3", budget_s=0.001, measurer=quick(workload, cpu),
             console=quiet(), use_cache=False, keep=False)
    assert not (tmp_path / "t3").exists()
    with pytest.raises(ConfigError, match="budget must be > 0"):
        tune(workload, cpu, out_dir=tmp_path / "t2", budget_s=0, console=quiet())


def test_relieve_lowers_prefetch_then_workers():
    plan = Plan(num_workers=4, prefetch_factor=4, persistent_workers=True)
    steps = []
    while (eased := relieve(plan)) is not None:
        plan, change = eased
        steps.append(change)
    assert steps == ["prefetch_factor 4 -> 2", "prefetch_factor 2 -> 1", "num_workers 4 -> 2", "num_workers 2 -> 1",
                     "num_workers 1 -> 0 (loading in the training process)"]
    assert plan.num_workers == 0 and plan.prefetch_factor is None and not plan.persistent_workers


def test_host_memory_guard_reads_ram_and_swap():
    readings = {"available": 8 * 2**30, "swap": 0}

    def read():
        vm = SimpleNamespace(total=16 * 2**30, available=readings["available"])
        return vm, SimpleNamespace(used=readings["swap"])

    guard = HostMemoryGuard(read=read)
    assert guard.pressure() is None
    readings["swap"] = 2**30
    assert "swap in use grew" in guard.pressure()
    readings["swap"], readings["available"] = 0, 2**20
    assert "under the" in guard.pressure()


def test_training_under_host_memory_pressure_lowers_the_loader(tmp_path, workload, cpu, monkeypatch):
    monkeypatch.setattr(hostmem.HostMemoryGuard, "pressure", lambda self: "simulated pressure")
    plan = Plan(micro_batch=4, grad_accum=2, num_workers=1, prefetch_factor=2, persistent_workers=True)
    config = RunConfig(run_dir=tmp_path / "run", steps=3, progress=False, tensorboard=False, log_every=1)
    result = train(workload, plan, config, hardware=cpu)
    assert result.steps == 3
    assert Plan.load(tmp_path / "run" / "plan.toml").num_workers == 0
    assert any("simulated pressure; lowered prefetch_factor 2 -> 1" in n for n in result.notes)
    assert any("num_workers 1 -> 0" in n for n in result.notes)


@pytest.mark.slow
def test_saturate_run_end_to_end(tmp_path, small_corpus):
    # One block of gpt-tiny (its matmuls as wide, so bf16 still beats fp32 where the CPU has it), trials short
    # (stats/noise.py's testing knob): the flow is checked here, not the figures.
    out = run_saturate("run", "gpt-tiny", "--data", str(small_corpus), "--param", "n_layer=1", "--effective-batch",
                       "8", "--steps", "4", "--no-compile", "--budget", "60", "--run-dir", str(tmp_path / "run"),
                       "--no-progress", cwd=tmp_path, timeout=600, SATURATE_TESTING_SHORT_TRIALS="1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "before and after" in out.stdout and "× naive" in out.stdout
    assert "round 3/3: naive" in out.stdout and "measured total: " in out.stdout
    assert "tuning cost " in out.stdout
    result = json.loads((tmp_path / "run" / "comparison.json").read_text())
    rows = result["rows"]
    assert [r["label"] for r in rows if r["label"] != "runner-up"] == ["naive", "tuned", "training run"]
    assert all(r["samples_per_s"] > 0 for r in rows)
    assert result["rounds"] >= 3 and all(len(r["rounds_samples_per_s"]) == result["rounds"] for r in rows[:-1])
    tuned = next(r for r in rows if r["label"] == "tuned")
    # Without native bf16 (an AVX2 CPU) the search may rightly keep naive's settings: measured once, no ratio.
    if tuned["twin"] == "naive":
        assert tuned["note"] == "the same settings as naive: measured once" and tuned["vs_naive"] is None
        assert "tuned vs naive: " not in out.stdout
        said = " ".join(out.stdout.split())  # the console wraps at 80 columns
        assert "no saving: tuned has naive's settings" in said or result["trained"] != "tuned"
    else:
        ratio = tuned["vs_naive"]
        assert "tuned vs naive: " in out.stdout and "a prediction" in out.stdout
        assert ratio["min"] <= ratio["median"] <= ratio["max"] and ratio["rounds"] == result["rounds"]
    assert "significant" in result["contention"] and result["trained"] in {r["label"] for r in rows}
    assert result["tuning"]["budget_s"] == 60 and result["tuning"]["seconds"] > 0
    assert result["timing"]["total_s"] >= result["timing"]["training_s"] > 0
    assert Path(tmp_path / "run" / "tune" / "plan.toml").exists() and (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow
def test_saturate_tune_with_a_budget_too_small_says_no_change_and_keeps_the_plan(tmp_path, small_corpus):
    out = subprocess.run(
        saturate_cmd("tune", "--data", str(small_corpus), "--effective-batch", "8", "--budget", "0.001",
                     "--out", str(tmp_path / "t"), "--json"),
        env=cli_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    said = " ".join(out.stderr.split())
    assert "no change measured: tuning budget 0.001 s is too small" in said and "kept the informed" in said
    doc = json.loads(out.stdout)
    assert doc["changed"] is False and doc["why"].startswith("no change measured")
    assert Plan.load(tmp_path / "t" / "plan.toml").knobs() == Plan.from_dict(doc["plan"]).knobs()


def test_a_real_trial_is_timed_in_windows_with_a_spread(workload, cpu):
    m = RealMeasurer(workload, cpu, window_s=0.0, min_steps=1)  # one-step windows: a few seconds in all
    t = m.model_trial(Plan(micro_batch=4, grad_accum=2), "x")
    assert t.ok and 3 <= t.windows <= 16 and t.steps == t.windows and len(t.window_samples_per_s) == t.windows
    assert t.spread is not None and t.spread >= 0
    assert min(t.window_samples_per_s) <= t.samples_per_s <= max(t.window_samples_per_s)
    one = m.model_trial(Plan(micro_batch=4, grad_accum=2), "memory", steps=1)
    assert one.ok and one.windows == 1 and one.spread is None  # a single window has no spread


def test_a_real_trial_measures_its_optimizer_steps_share(workload, cpu, monkeypatch):
    import time

    from saturate.engine import step as step_module

    m = RealMeasurer(workload, cpu, window_s=0.0, min_steps=1)
    plain = m.model_trial(Plan(micro_batch=4, grad_accum=2), "x")
    real = step_module.optimizer_step

    def slow(*a, **kw):
        time.sleep(0.2)  # longer than the rest of this one-block model's step
        return real(*a, **kw)

    monkeypatch.setattr(step_module, "optimizer_step", slow)
    slowed = m.model_trial(Plan(micro_batch=4, grad_accum=2), "x")
    assert plain.ok and slowed.ok and 0 < plain.optimizer_share < 0.5 < slowed.optimizer_share < 1
    assert slowed.to_dict()["optimizer_share"] == round(slowed.optimizer_share, 4)


def test_tune_wide_flag_applies_to_presets_only(capsys):
    from saturate import cli

    assert cli.main(["tune", "--wide", "--", "python", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err == "saturate: error: --wide applies to a preset or --workload, not to a command after --\n"
    assert cli.build_parser().parse_args(["tune", "--wide"]).wide


def test_a_compilation_past_its_time_limit_is_stopped_in_flight(workload, cpu):
    import time

    import torch

    from saturate.tune.process import prepare_compiler

    torch._dynamo.reset()  # an earlier test's compiled GPT would otherwise be reused in well under the limit
    prepare_compiler(torch.device("cpu"))  # the compiler's once-per-process set-up is not interruptible
    m = quick(workload, cpu)
    started = time.perf_counter()
    stopped = m.model_trial(Plan(micro_batch=4, grad_accum=2, compile="default"), "compile", compile_limit_s=0.02)
    took = time.perf_counter() - started
    assert stopped.status == "timeout" and "0.02 s limit" in stopped.error, stopped.error
    assert stopped.samples_per_s is None and stopped.compile_s is None  # nothing measured is claimed
    assert took < 5.0  # stopped in flight: a CPU compilation of gpt-tiny takes several seconds
    eager = m.model_trial(Plan(micro_batch=4, grad_accum=2), "after")  # the process is left usable
    assert eager.ok and eager.samples_per_s > 0


def test_plans_tuned_at_several_processes_are_cached_apart_and_resplit(workload, cpu):
    from saturate.engine.resume import choose_plan

    fp = cpu.fingerprint()
    one = Plan(micro_batch=4, grad_accum=2, name="tuned", provenance={"world_size": 1})
    two = Plan(micro_batch=2, grad_accum=2, strategy="ddp", name="tuned", provenance={"world_size": 2})
    cache.store(one, workload, fp)
    cache.store(two, workload, fp, 2)
    assert cache.lookup(workload, fp)[0].micro_batch == 4
    assert cache.lookup(workload, fp, 2)[0].strategy == "ddp"
    assert cache.lookup(workload, fp, 4)[0].micro_batch == 4  # none tuned at 4: the one-process plan
    at2 = choose_plan(None, None, workload, cpu, True, [], world=2)
    assert (at2.micro_batch, at2.grad_accum, at2.strategy) == (2, 2, "ddp")  # as tuned, untouched
    cache.cached_plan_path(workload, fp).unlink()
    notes: list[str] = []
    at4 = choose_plan(None, None, workload, cpu, True, notes, world=4)  # the 2-process plan, re-split
    assert (at4.micro_batch, at4.grad_accum, at4.provenance["world_size"]) == (2, 1, 2)
    assert any("using the plan tuned" in n for n in notes)


def test_samples_that_are_not_tokens_get_no_tokens_column():
    from saturate.engine.console import ConsoleSink
    from saturate.run.flow import Row, comparison_table
    from saturate.tune.evidence import trial_line, trials_table
    from saturate.tune.trial import Trial

    plan = Plan(micro_batch=4, grad_accum=2)
    t = Trial(stage="verify", plan=plan, samples_per_s=100.0, step_s=0.32)

    def text(renderable) -> str:
        console = Console(record=True, width=200, file=open("/dev/null", "w"))  # noqa: SIM115
        console.print(renderable)
        return console.export_text()

    for per_sample, shown in ((1, False), (128, True)):
        assert ("tokens/s" in trial_line(t, per_sample)) is shown
        assert ("tokens/s" in text(trials_table([t], per_sample, "device", wide=True))) is shown
        row = Row("naive", plan, 100.0, 100.0 * per_sample, 0.32, None, None, None)
        assert ("tokens/s" in text(comparison_table([row], SimpleNamespace(name="w", tokens_per_sample=per_sample),
                                                    "device"))) is shown
        sink = ConsoleSink(10, console=Console(record=True, width=200, file=open("/dev/null", "w")))  # noqa: SIM115
        sink.start(SimpleNamespace(name="w", info={}, tokens_per_sample=per_sample), plan,
                   SimpleNamespace(torch_device="cpu"), 8, 10, None)
        sink.log(1, {"train/loss": 1.0, "throughput/tokens_per_s": 100.0 * per_sample,
                     "throughput/samples_per_s": 100.0, "memory/peak_gib": 0.1})
        assert ("tok/s" in sink.console.export_text()) is shown


def test_the_before_after_table_never_shows_an_mfu_above_the_peak():
    from saturate.hardware.mfu import mfu
    from saturate.run.flow import Row, comparison_table

    plan = Plan(micro_batch=4, grad_accum=2)
    rows = [Row("naive", plan, 100.0, None, 0.32, None, None, mfu(5e9, 1e10, "measured")),
            Row("tuned", plan, 300.0, None, 0.1, None, None, mfu(1.5e10, 1e10, "measured"))]
    console = Console(record=True, width=200, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(comparison_table(rows, SimpleNamespace(name="w", tokens_per_sample=1), "device"))
    text = console.export_text()
    assert "50.0 %" in text and "150" not in text and "n/a" in text
    assert rows[1].to_dict()["mfu"] is None and rows[1].to_dict()["mfu_detail"]["exceeds_peak"] is True


def test_a_tune_replaces_the_cached_plan_only_when_it_measured_the_cached_settings_itself(workload, cpu):
    from saturate.tune.api import cached_plan_stays
    from saturate.tune.results import SearchResult
    from saturate.tune.trial import Trial

    fp = cpu.fingerprint()
    bf16 = Plan(name="tuned", micro_batch=8, grad_accum=1, precision="bf16")
    fp32 = Plan(name="tuned", micro_batch=8, grad_accum=1)

    def result(*plans: Plan, warnings: tuple[str, ...] = ()) -> SearchResult:
        trials = [Trial(stage="precision", plan=p, samples_per_s=100.0, spread=0.01) for p in plans]
        return SearchResult(plan=fp32, trials=trials, loader_trials=[], fit=None, decisions=[], seconds=1.0,
                            chosen=trials[0], warnings=list(warnings))

    assert cached_plan_stays(fp32, result(fp32), workload, fp) is None  # nothing cached: the tune's plan is
    cache.store(bf16, workload, fp)
    small = cached_plan_stays(fp32, result(fp32), workload, fp)  # a budget too small to try bf16
    assert small is not None and "did not measure its settings" in small and "bf16" in small
    assert cached_plan_stays(fp32, result(fp32, bf16), workload, fp) is None  # measured both, chose fp32
    shaky = cached_plan_stays(fp32, result(fp32, bf16, warnings=("the chosen plan verified at …",)), workload, fp)
    assert shaky is not None and "verification contradicted its trials" in shaky
    assert cached_plan_stays(bf16.replace(num_workers=2), result(fp32), workload, fp) is None  # same knobs
