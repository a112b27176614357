"""The search starts from the informed plan (plan.default_plan) and measures around it (fake machine, no timing)."""

from __future__ import annotations

import dataclasses
import json

from test_search import FakeMachine, GiB, linear_memory, saturating, settings

from saturate.hardware.cpu import cpu_supports
from saturate.plan import INFORMED, Plan, default_plan
from saturate.tune.search import search

NATIVE = {"bf16": True, "fp16": True, "tf32": True}


def informed(effective_batch: int = 64, device: str = "cuda", supports: dict[str, bool] | None = None) -> Plan:
    """What `tune` starts from on an Ampere-class GPU (or `device`) with 8 cores and the fused kernel."""
    return default_plan(effective_batch, device, NATIVE if supports is None else supports, cores=8,
                        fused_optimizer=True)


def flat(rate: float = 100.0):
    return lambda p: rate


def test_the_first_trial_is_the_informed_plan_and_fp32_is_measured_against_its_bf16():
    base = informed()
    assert (base.precision, base.tf32, base.fused_optimizer, base.micro_batch) == ("bf16", True, True, 16)
    machine = FakeMachine(speed=saturating(16), memory=linear_memory(GiB, 0.1 * GiB))
    result = search(machine, base, settings(try_compile=False))
    first = result.trials[0]
    assert first.plan.knobs() == base.knobs() and machine.tried[0] == first.plan
    second = machine.tried[1]  # the alternative to bf16, its losses the reference bf16's are checked against
    assert (second.precision, second.tf32, second.micro_batch) == ("fp32", True, 16)
    assert not any(p.precision == "fp32" and not p.tf32 for p in machine.tried)  # no climb from naive's settings
    assert result.decisions[0].startswith("start: the informed plan (bf16") and INFORMED in result.decisions[0]
    assert result.plan.precision == "bf16" and result.plan.fused_optimizer  # 1.8× and 1.05× in this fake
    assert result.plan.provenance["precision"].startswith("bf16: the GPU has bf16 tensor cores")
    assert result.plan.provenance["precision"].endswith("(measured)")
    assert "within 0.00 % of fp32's" in result.plan.provenance["precision"]


def test_a_fused_optimizer_measured_slower_is_turned_off_and_said_measured():
    def speed(p: Plan) -> float:
        return saturating(16)(p) / (1.05 if p.fused_optimizer else 1.0) * (0.8 if p.fused_optimizer else 1.0)

    machine = FakeMachine(speed=speed, memory=linear_memory(GiB, 0.1 * GiB))
    result = search(machine, informed(), settings(try_compile=False))
    assert machine.tried[0].fused_optimizer  # the informed plan's choice, measured first
    assert not result.plan.fused_optimizer
    line = next(d for d in result.decisions if d.startswith("fused optimizer"))
    assert line.startswith("fused optimizer: off (") and "vs fused" in line
    said = result.plan.provenance["fused_optimizer"]
    assert said.startswith("off: unfused +") and said.endswith("(measured)") and INFORMED not in said


def test_within_noise_everywhere_the_tuned_plan_is_the_informed_plan_with_its_reasons():
    base = informed()
    machine = FakeMachine(speed=flat(), memory=linear_memory(GiB, 0.1 * GiB), spread=0.03)
    result = search(machine, base, settings(try_compile=False))
    assert result.plan.knobs() == base.knobs()  # nothing beat the informed choices beyond the noise
    prov = result.plan.provenance
    for knob in ("precision", "fused_optimizer", "micro_batch"):  # measured around, and kept: both said
        start = base.provenance[knob].replace(f" ({INFORMED})", "")
        assert prov[knob].startswith(start) and "chosen from the hardware" in prov[knob], (knob, prov[knob])
        assert prov[knob].endswith("(measured)") and INFORMED not in prov[knob], (knob, prov[knob])
    assert "within noise" in prov["precision"] and "within noise" in prov["fused_optimizer"]
    # bf16 stayed, so no trial measured TF32 for fp32 matmuls: its reason is the informed plan's, untouched
    assert prov["tf32"] == base.provenance["tf32"] and INFORMED in prov["tf32"]
    assert "kept as chosen from the hardware, not measured: tf32" in result.decisions
    assert "informed" not in prov and prov["start"].startswith("the informed plan (bf16")


def test_naive_start_still_climbs_as_it_did():
    # The same search from naive's settings (the tests' Plan()): bf16 and fused measured as candidates, from fp32.
    machine = FakeMachine(speed=flat(), memory=linear_memory(GiB, 0.1 * GiB), spread=0.03)
    result = search(machine, Plan(), settings(try_compile=False))
    assert (machine.tried[0].precision, machine.tried[0].fused_optimizer) == ("fp32", False)
    assert result.plan.precision == "fp32" and not result.plan.fused_optimizer  # within noise: the incumbent
    assert result.decisions[0].startswith("start: the plan given (8×8 fp32)")


def test_an_informed_micro_batch_that_runs_out_of_memory_backs_off_and_is_said_measured():
    # 4 GiB + 0.5 GiB per sample at bf16 (0.6 of fp32's): 16 needs 8.8 GiB of 8 — it does not fit; 8 does.
    machine = FakeMachine(speed=saturating(1000), memory=linear_memory(4 * GiB, 0.5 * GiB / 0.6), capacity=8 * GiB)
    result = search(machine, informed(), settings(try_compile=False))
    assert machine.tried[0].micro_batch == 16 and result.trials[0].status == "oom"
    assert result.trials[1].plan.micro_batch == 8 and result.trials[1].ok
    assert result.plan.micro_batch <= 8 and result.chosen.ok
    assert not any(t.ok and t.plan.micro_batch > 8 and not t.plan.activation_checkpointing for t in result.trials)
    assert result.plan.provenance["micro_batch"].endswith("(measured)")


def test_an_informed_micro_batch_slower_than_a_smaller_one_is_searched_downward():
    rates = {32: 90.0, 16: 100.0, 8: 130.0, 4: 120.0, 2: 60.0, 1: 30.0}
    machine = FakeMachine(speed=lambda p: rates[p.micro_batch], memory=linear_memory(GiB, 0.01 * GiB), spread=0.01)
    result = search(machine, informed(), settings(try_compile=False, supports={}, fused_available=False))
    tried = [p.micro_batch for p in machine.tried]
    assert tried[0] == 16 and 32 in tried and 8 in tried and 4 in tried  # up first, then down, both measured
    assert tried.index(32) < tried.index(8)
    assert result.plan.micro_batch == 8
    assert result.plan.provenance["micro_batch"].startswith("8 × 8") and "(measured)" in \
        result.plan.provenance["micro_batch"]


def test_an_informed_bf16_whose_losses_drift_from_fp32_is_rejected_whatever_its_speed():
    def losses(p: Plan) -> list[float]:
        return [5.0, 4.5, 4.2, 4.0] if p.precision == "fp32" else [5.0, 4.6, 4.6, 4.7]

    machine = FakeMachine(speed=saturating(16), memory=linear_memory(GiB, 0.1 * GiB), losses=losses)
    result = search(machine, informed(), settings(try_compile=False))
    assert machine.tried[0].precision == "bf16" and result.plan.precision == "fp32"
    assert any(d.startswith("precision: bf16 (chosen from the hardware) rejected, its first 4 losses differ")
               for d in result.decisions)
    said = result.plan.provenance["precision"]
    assert said.startswith("fp32") and "bf16 rejected: bf16's first 4 losses differ" in said and INFORMED not in said


def test_an_informed_bf16_the_budget_cannot_check_is_kept_with_a_warning(monkeypatch):
    from saturate.tune.state import SearchState

    monkeypatch.setattr(SearchState, "affordable", lambda self, what, loader=False, need=None: False)
    machine = FakeMachine(speed=saturating(16), memory=linear_memory(GiB, 0.1 * GiB))
    result = search(machine, informed(), settings(try_compile=False))
    assert [t.stage for t in result.trials] == ["precision", "verify"]
    assert result.plan.knobs() == informed().knobs()
    assert any("was not checked against fp32's losses" in w for w in result.warnings)
    for knob in ("precision", "tf32", "fused_optimizer", "micro_batch"):  # nothing measured: all as chosen
        assert result.plan.provenance[knob] == informed().provenance[knob]
    assert result.plan.num_workers == informed().num_workers and result.plan.pin_memory  # the loader: unmeasured too


def test_an_avx2_only_cpu_never_measures_bf16_from_the_informed_plan():
    # plan.default_plan's own test (tests/test_plan.py) fakes the flags; here the search from it tries no bf16.
    supports = cpu_supports({"sse2", "avx", "avx2", "fma"})
    base = informed(32, "cpu", supports)
    machine = FakeMachine(speed=saturating(16), memory=linear_memory(GiB, 0.1 * GiB), device_type="cpu", cores=2)
    result = search(machine, base, settings(effective_batch=32, supports=supports, try_compile=False))
    assert base.precision == "fp32" and {p.precision for p in machine.tried} == {"fp32"}
    assert result.plan.precision == "fp32"
    assert any(d.startswith("precision: fp32 (no lower precision is native here") for d in result.decisions)
    assert result.plan.provenance["precision"] == base.provenance["precision"]  # not measured: no alternative


def test_tune_starts_from_the_informed_plan_and_naive_stays_the_before(tmp_path, cpu):
    from rich.console import Console

    from saturate.plan import reference_plan
    from saturate.run.flow import reference_plans
    from saturate.tune import tune
    from saturate.workloads import build_workload
    from saturate.workloads.coupling import workload_default_plan

    w = dataclasses.replace(build_workload("gpt-tiny", seed=0, effective_batch=8), val_data=None)
    machine = FakeMachine(speed=saturating(16), memory=linear_memory(GiB, 0.1 * GiB), device_type="cpu")
    result = tune(w, cpu, out_dir=tmp_path / "t", measurer=machine, try_compile=False, use_cache=False,
                  console=Console(file=open("/dev/null", "w")), verify=False)  # noqa: SIM115
    start, _ = workload_default_plan(w, cpu)
    assert machine.tried[0].knobs() == start.knobs()
    saved = json.loads((tmp_path / "t" / "tune.json").read_text())
    assert saved["choices"]["start"].startswith("the informed plan") and set(saved["choices"]) >= {
        "precision", "tf32", "fused_optimizer", "micro_batch", "loader"}
    written = Plan.load(result.plan_path).provenance
    assert written["start"] == saved["choices"]["start"]
    for knob in ("precision", "tf32", "fused_optimizer", "micro_batch", "loader"):  # short: the evidence in tune.json
        assert written[knob] == (saved["choices"][knob] if knob in saved["unmeasured"] else
                                 "measured (tune.json: choices)")
    assert "tf32" in saved["unmeasured"] and INFORMED in written["tf32"]  # a CPU: no trial measures TF32
    label, naive = reference_plans(w, cpu.device_type)[0]  # what `saturate run` compares with: naive, as it was
    assert label == "naive" and naive.knobs() == reference_plan("naive").replace(
        micro_batch=8, grad_accum=1).knobs()


def test_the_chunked_loss_is_measured_where_a_micro_batch_holds_more_rows_than_a_chunk():
    """issue 32: plan.loss_chunk is a knob the tuner measures like the others, before the micro-batch search:
    kept when faster beyond the noise, or within it with less memory (each one's peak said), the whole logits
    kept when slower, not tried when one chunk holds them."""
    def speed(faster: float):
        return lambda p: saturating(16)(p) * (faster if p.loss_chunk else 1.0)

    def memory(p: Plan) -> int:
        return GiB + int((0.05 if p.loss_chunk else 0.1) * GiB) * p.micro_batch

    chunked = settings(try_compile=False, loss_chunk_rows=1024, rows_per_sample=1024)
    machine = FakeMachine(speed=speed(1.2), memory=memory)
    result = search(machine, informed(), chunked)
    assert result.plan.loss_chunk == 1024 and any(p.loss_chunk == 1024 for p in machine.tried)
    line = next(d for d in result.decisions if d.startswith("loss:"))
    assert line.startswith("loss: in chunks of 1024 rows (+") and "peak memory" in line

    even = FakeMachine(speed=speed(1.0), memory=memory)  # within noise, and a third less memory: kept for it
    result = search(even, informed(), chunked)
    assert result.plan.loss_chunk == 1024
    assert "the memory it frees is the reason" in next(d for d in result.decisions if d.startswith("loss:"))
    tried = [p.loss_chunk for p in even.tried]
    assert tried.index(1024) < next(i for i, p in enumerate(even.tried) if p.micro_batch != 16)  # before the climb

    slower = FakeMachine(speed=speed(0.8), memory=memory)
    result = search(slower, informed(), chunked)
    assert result.plan.loss_chunk is None
    assert next(d for d in result.decisions if d.startswith("loss:")).startswith("loss: the whole logits (")

    small = FakeMachine(speed=speed(1.2), memory=memory)  # 16 samples × 8 rows: one chunk holds them
    result = search(small, informed(), settings(try_compile=False, loss_chunk_rows=1024, rows_per_sample=8))
    assert result.plan.loss_chunk is None and not any(p.loss_chunk for p in small.tried)
    from saturate.tune.search import _Search

    def planned(**kw) -> int:  # the budget is shared over the trials expected: a skipped stage is not one
        return _Search(small, informed(), settings(try_compile=False, **kw), None, None).expected_trials()

    assert planned(loss_chunk_rows=1024, rows_per_sample=8) == planned()
    assert planned(loss_chunk_rows=1024, rows_per_sample=1024) == planned() + 1
    assert any(s.startswith("chunked loss: not tried, a micro-batch's") for s in result.skipped)

    none = FakeMachine(speed=speed(1.2), memory=memory)  # a workload without a chunked loss: nothing said
    result = search(none, informed(), settings(try_compile=False))
    assert not any(p.loss_chunk for p in none.tried) and not any("chunk" in s for s in result.skipped)


def test_on_a_gpu_each_sdpa_backend_is_measured_against_torchs_choice_and_the_fastest_kept():
    """plan.attention (issue 32): cuDNN, flash and memory-efficient attention each measured against the incumbent;
    one that cannot run this model's attention fails its trial and is said so."""
    factor = {None: 1.0, "cudnn": 1.3, "flash": 1.1, "efficient": 1.0}

    def memory(p: Plan) -> int:  # the memory-efficient kernel "cannot run" here: its trial fails
        return 200 * GiB if p.attention == "efficient" else GiB + int(0.1 * GiB) * p.micro_batch

    machine = FakeMachine(speed=lambda p: saturating(16)(p) * factor[p.attention], memory=memory)
    result = search(machine, informed(), settings(try_compile=False,
                                                  attention_backends=("cudnn", "flash", "efficient")))
    assert result.plan.attention == "cudnn"
    assert [p.attention for p in machine.tried if p.attention] [:3] == ["cudnn", "flash", "efficient"]
    line = next(d for d in result.decisions if d.startswith("attention:"))
    assert line.startswith("attention: cudnn (cudnn +") and "efficient oom" in line

    same = FakeMachine(speed=saturating(16), memory=linear_memory(GiB, 0.1 * GiB))  # within noise: torch's own
    result = search(same, informed(), settings(try_compile=False, attention_backends=("cudnn", "flash")))
    assert result.plan.attention is None
    assert next(d for d in result.decisions if d.startswith("attention:")).startswith("attention: torch's choice (")


def test_once_compiled_is_kept_cuda_graphs_and_max_autotune_are_each_measured_against_it():
    """The compile ladder (issue 32): reduce-overhead (CUDA graphs) and max-autotune after compile "default" is
    kept, each under the same rule (faster beyond the noise and paying back its compile time); none of it when
    compiling did not pay."""
    factor = {"none": 1.0, "default": 1.0, "reduce-overhead": 1.25, "max-autotune": 1.2}  # × saturating's 1.3
    machine = FakeMachine(speed=lambda p: saturating(16)(p) * factor[p.compile],
                          memory=linear_memory(GiB, 0.1 * GiB))
    ladder = ("reduce-overhead", "max-autotune")
    result = search(machine, informed(), settings(planned_steps=100_000, compile_ladder=ladder))
    assert [p.compile for p in machine.tried if p.compile != "none"][:3] == ["default", *ladder]
    assert result.plan.compile == "reduce-overhead"
    assert any(d.startswith("compile: reduce-overhead (+") for d in result.decisions)
    assert any(d.startswith("compile: reduce-overhead (max-autotune ") for d in result.decisions)

    flat_compile = FakeMachine(speed=lambda p: saturating(16)(p) / (1.3 if p.compile != "none" else 1.0),
                               memory=linear_memory(GiB, 0.1 * GiB))
    result = search(flat_compile, informed(), settings(planned_steps=100_000, compile_ladder=ladder))
    assert result.plan.compile == "none"
    assert not any(p.compile in ladder for p in flat_compile.tried)  # default did not pay: the ladder is not climbed
