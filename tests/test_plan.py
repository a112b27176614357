"""The Plan: validation, TOML round trips, the reference plans, resolve_plan and default_plan."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from saturate.errors import ConfigError, SaturateError
from saturate.plan import (
    COMPILE_MODES,
    PRECISIONS,
    REFERENCE_PLANS,
    STRATEGIES,
    Plan,
    default_plan,
    reference_plan,
    resolve_plan,
)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    # Plans are files: every path below is relative to a private folder, and no cache is shared.
    monkeypatch.setenv("SATURATE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


def _toml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


# --- the dataclass -------------------------------------------------------------------------------


def test_defaults_are_a_valid_single_process_fp32_plan():
    plan = Plan()
    assert plan.samples_per_step() == plan.micro_batch * plan.grad_accum >= 1
    assert plan.samples_per_step(world_size=4) == 4 * plan.samples_per_step()
    assert plan.precision in PRECISIONS and plan.compile in COMPILE_MODES and plan.strategy in STRATEGIES
    assert (plan.precision, plan.compile, plan.strategy) == ("fp32", "none", "single")
    assert plan.prefetch_factor is None and plan.num_workers == 0
    # The default survives its own validation when rebuilt from its dict.
    assert Plan.from_dict(plan.to_dict()) == plan


def test_replace_validates_the_new_values():
    plan = Plan().replace(micro_batch=4, grad_accum=3)
    assert plan.samples_per_step() == 12
    with pytest.raises(ConfigError, match="micro_batch"):
        Plan().replace(micro_batch=0)
    with pytest.raises(ConfigError, match="plan.loss_chunk must be >= 1, got 0"):
        Plan().replace(loss_chunk=0)


@pytest.mark.parametrize(
    "plan",
    [
        Plan(),
        Plan(name="everything", micro_batch=3, grad_accum=5, num_workers=2, prefetch_factor=3,
             pin_memory=True, persistent_workers=True, non_blocking=True, precision="bf16", tf32=True,
             compile="max-autotune", activation_checkpointing=True, fused_optimizer=True, strategy="ddp",
             threads=3, loss_chunk=4096, attention="flash",
             provenance={"source": "tune", "trials": 7, "losses": [2.5, 2.25], "nested": {"ok": True}}),
    ],
    ids=["defaults", "every-field-set"],
)
def test_toml_save_load_round_trip(tmp_path, plan):
    path = tmp_path / "plan.toml"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan
    assert dataclasses.asdict(loaded) == dataclasses.asdict(plan)
    assert _leftovers(tmp_path) == []  # written under a temporary name, then renamed


def test_save_overwrites_an_existing_plan_whole(tmp_path):
    path = tmp_path / "plan.toml"
    Plan(name="first", micro_batch=64, provenance={"long": "x" * 500}).save(path)
    Plan(name="second").save(path)
    assert Plan.load(path) == Plan(name="second")


def test_plan_table_is_accepted(tmp_path):
    path = _toml(tmp_path / "p.toml", '[plan]\nmicro_batch = 4\ngrad_accum = 2\nprecision = "bf16"\n')
    plan = Plan.load(path)
    assert (plan.micro_batch, plan.grad_accum, plan.precision) == (4, 2, "bf16")


def test_plan_table_beside_other_keys_is_not_silently_unwrapped(tmp_path):
    path = _toml(tmp_path / "p.toml", 'micro_batch = 4\n[plan]\ngrad_accum = 2\n')
    with pytest.raises(ConfigError, match="'plan'"):
        Plan.load(path)


def test_unknown_key_is_an_error_naming_the_key_and_the_file(tmp_path):
    path = _toml(tmp_path / "p.toml", "micro_batch = 4\nmicro_bach = 8\n")
    with pytest.raises(ConfigError, match="micro_bach") as err:
        Plan.load(path)
    assert str(path) in str(err.value)
    assert "\n" not in str(err.value)  # the CLI prints it as one line


def test_unknown_key_in_from_dict():
    with pytest.raises(ConfigError, match="'warp_speed'"):
        Plan.from_dict({"warp_speed": 9})


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('micro_batch = "8"', "micro_batch"),
        ("micro_batch = 8.5", "micro_batch"),
        ("micro_batch = true", "micro_batch"),
        ("grad_accum = [1, 2]", "grad_accum"),
        ("pin_memory = 1", "pin_memory"),
        ('non_blocking = "yes"', "non_blocking"),
        ("precision = 16", "precision"),
        ("name = 3", "name"),
        ("prefetch_factor = 2.0", "prefetch_factor"),
        ('provenance = "tune"', "provenance"),
    ],
)
def test_wrong_type_is_an_error_naming_the_field(tmp_path, line, field):
    path = _toml(tmp_path / "p.toml", f"num_workers = 2\n{line}\n")
    with pytest.raises(ConfigError, match=rf"plan\.{field}\b"):
        Plan.load(path)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"micro_batch": 0}, "micro_batch"),
        ({"micro_batch": -3}, "micro_batch"),
        ({"grad_accum": -1}, "grad_accum"),
        ({"grad_accum": 0}, "grad_accum"),
        ({"num_workers": -1}, "num_workers"),
        ({"prefetch_factor": 2}, "prefetch_factor"),  # with num_workers = 0
        ({"num_workers": 2, "prefetch_factor": 0}, "prefetch_factor"),
        ({"persistent_workers": True}, "persistent_workers"),  # with num_workers = 0
        ({"precision": "fp8"}, "precision"),
        ({"precision": "FP16"}, "precision"),
        ({"compile": "fast"}, "compile"),
        ({"strategy": "zero"}, "strategy"),
    ],
)
def test_out_of_range_is_an_error_naming_the_field(changes, field):
    with pytest.raises(ConfigError, match=rf"plan\.{field}\b") as err:
        Plan(**changes)
    assert isinstance(err.value, SaturateError) and isinstance(err.value, ValueError)


def test_out_of_range_in_a_file_names_the_field(tmp_path):
    path = _toml(tmp_path / "p.toml", 'compile = "fast"\n')
    with pytest.raises(ConfigError, match="plan.compile") as err:
        Plan.load(path)
    assert "'fast'" in str(err.value)


def test_invalid_toml_is_a_config_error(tmp_path):
    path = _toml(tmp_path / "broken.toml", "micro_batch = = 4\n[plan\n")
    with pytest.raises(ConfigError, match="not valid TOML") as err:
        Plan.load(path)
    assert "broken.toml" in str(err.value)


def test_a_key_given_twice_is_named_with_its_line(tmp_path):
    path = _toml(tmp_path / "twice.toml", "[plan]\nmicro_batch = 4  # first\ngrad_accum = 2\nmicro_batch = 8\n")
    with pytest.raises(ConfigError) as err:
        Plan.load(path)
    assert str(err.value) == (f"plan file {path} is not valid TOML: key 'plan.micro_batch' is given twice "
                              "(again on line 4)")


def test_undecodable_file_is_a_config_error(tmp_path):
    path = tmp_path / "binary.toml"
    path.write_bytes(b"\xff\xfe\x00micro_batch = 4")
    with pytest.raises(ConfigError, match="binary.toml"):
        Plan.load(path)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist") as err:
        Plan.load(tmp_path / "absent.toml")
    assert "absent.toml" in str(err.value)


# --- the reference plans ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(REFERENCE_PLANS))
def test_every_reference_plan_is_valid_and_named_after_its_key(name, tmp_path):
    plan = REFERENCE_PLANS[name]
    assert isinstance(plan, Plan)
    assert plan.name == name
    # Re-running validation on its fields (as a file would) accepts it, and it survives TOML.
    assert Plan.from_dict(plan.to_dict()) == plan
    plan.save(tmp_path / "ref.toml")
    assert Plan.load(tmp_path / "ref.toml") == plan
    assert reference_plan(name) == plan


def test_reference_plans_carry_the_guides_numbers():
    after = REFERENCE_PLANS["a6000-after"]
    assert (after.micro_batch, after.grad_accum) == (32, 4)
    assert (after.num_workers, after.prefetch_factor, after.precision) == (8, 4, "fp16")
    assert after.pin_memory and after.non_blocking

    before = REFERENCE_PLANS["a6000-before"]
    assert (before.micro_batch, before.grad_accum) == (12, 10)
    # The guide's before/after keep the same order of effective batch (120 vs 128 samples).
    assert before.samples_per_step() == 120 and after.samples_per_step() == 128

    rocm = REFERENCE_PLANS["rocm-after"]
    assert (rocm.micro_batch, rocm.grad_accum, rocm.num_workers) == (32, 4, 4)

    ts = REFERENCE_PLANS["timeseries-after"]
    assert ts.micro_batch == 256
    assert ts.compile == "max-autotune" and ts.tf32 is True

    assert REFERENCE_PLANS["naive"].samples_per_step() == 8
    assert REFERENCE_PLANS["naive"].precision == "fp32" and REFERENCE_PLANS["naive"].num_workers == 0


def test_reference_plan_returns_a_copy():
    plan = reference_plan("a6000-after")
    plan.micro_batch = 1
    assert REFERENCE_PLANS["a6000-after"].micro_batch == 32


def test_unknown_reference_plan():
    with pytest.raises(ConfigError, match="'a6000-sideways'") as err:
        reference_plan("a6000-sideways")
    assert "naive" in str(err.value)  # lists what exists


# --- resolve_plan ------------------------------------------------------------------------------


def test_resolve_plan_by_name():
    assert resolve_plan("rocm-after") == REFERENCE_PLANS["rocm-after"]


def test_resolve_plan_from_a_file(tmp_path):
    Plan(name="mine", micro_batch=2, grad_accum=16).save(tmp_path / "mine.toml")
    assert resolve_plan(str(tmp_path / "mine.toml")) == Plan(name="mine", micro_batch=2, grad_accum=16)
    assert resolve_plan("mine.toml").micro_batch == 2  # relative to the working folder


def test_resolve_plan_prefers_a_file_over_a_reference_name(tmp_path):
    _toml(tmp_path / "naive", "micro_batch = 3\n")
    assert resolve_plan("naive").micro_batch == 3


def test_resolve_plan_missing_toml_says_the_file_does_not_exist():
    with pytest.raises(ConfigError, match="does not exist") as err:
        resolve_plan("tuned.toml")
    assert "tuned.toml" in str(err.value)


def test_resolve_plan_nonsense_lists_the_reference_plans():
    with pytest.raises(ConfigError, match="'nonsense'") as err:
        resolve_plan("nonsense")
    assert "neither a file nor a reference plan" in str(err.value)
    assert all(name in str(err.value) for name in REFERENCE_PLANS)


# --- default_plan ----------------------------------------------------------------------------------

_CPU = {"bf16": True, "fp16": True, "tf32": False}
_AMPERE = {"bf16": True, "fp16": True, "tf32": True}


@pytest.mark.parametrize("device_type", ["cpu", "cuda", "rocm", "mps"])
@pytest.mark.parametrize("effective", [1, 7, 32, 96, 128])
def test_default_plan_keeps_the_effective_batch(device_type, effective):
    plan = default_plan(effective, device_type, _AMPERE if device_type != "cpu" else _CPU)
    assert plan.micro_batch * plan.grad_accum == effective
    assert plan.samples_per_step() == effective
    assert 1 <= plan.micro_batch <= 16
    assert plan.name == "default"


def test_default_plan_micro_batch_is_the_largest_divisor_under_the_cap():
    assert default_plan(96, "cpu", _CPU).micro_batch == 8
    assert default_plan(96, "cuda", _AMPERE).micro_batch == 16
    assert default_plan(7, "cuda", _AMPERE).micro_batch == 7
    assert default_plan(13 * 17, "cuda", _AMPERE).micro_batch == 13


def test_default_plan_uses_gpu_features_only_on_a_gpu():
    cpu = default_plan(32, "cpu", _CPU)  # a CPU with native bf16 trains in bf16; copies and pinning are a GPU's
    assert (cpu.precision, cpu.pin_memory, cpu.non_blocking, cpu.fused_optimizer, cpu.tf32, cpu.num_workers) == (
        "bf16", False, False, False, False, 0)
    mps = default_plan(32, "mps", {"bf16": True, "fp16": True})
    assert (mps.precision, mps.pin_memory, mps.fused_optimizer) == ("fp32", False, False)
    for gpu in ("cuda", "rocm"):
        plan = default_plan(32, gpu, _AMPERE)
        assert (plan.precision, plan.pin_memory, plan.non_blocking, plan.fused_optimizer, plan.tf32) == (
            "bf16", True, True, True, True)
    turing = default_plan(32, "cuda", {"bf16": False, "fp16": True, "tf32": False})
    assert (turing.precision, turing.tf32, turing.pin_memory) == ("fp32", False, True)
    assert "fp16 needs a GradScaler" in turing.provenance["precision"]


def test_an_avx2_only_cpu_gets_fp32_and_an_amx_or_avx512_bf16_cpu_gets_bf16():
    from saturate.hardware.cpu import cpu_supports

    avx2 = default_plan(32, "cpu", cpu_supports({"sse2", "avx", "avx2", "fma"}), cores=2, fused_optimizer=True)
    assert avx2.precision == "fp32" and "emulated" in avx2.provenance["precision"]
    for flags in ({"avx2", "avx512f", "avx512_bf16"}, {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}):
        plan = default_plan(32, "cpu", cpu_supports(flags), cores=2, fused_optimizer=True)
        assert (plan.precision, plan.tf32, plan.fused_optimizer, plan.num_workers, plan.pin_memory) == (
            "bf16", False, True, 0, False)


def test_an_h100_like_gpu_gets_bf16_tf32_fused_pinned_and_workers_from_its_cores():
    h100 = {"bf16": True, "fp16": True, "tf32": True}
    plan = default_plan(32, "cuda", h100, cores=16, fused_optimizer=True)
    assert (plan.precision, plan.tf32, plan.fused_optimizer, plan.pin_memory, plan.non_blocking) == (
        "bf16", True, True, True, True)
    assert (plan.num_workers, plan.micro_batch, plan.grad_accum) == (4, 16, 2)  # at most 4; the rule's cap of 16
    assert default_plan(32, "cuda", h100, cores=2).num_workers == 1  # one core kept for the training process
    assert default_plan(32, "cuda", h100, cores=1).num_workers == 0
    assert default_plan(32, "cuda", h100, world_size=8, cores=16).num_workers == 1  # 2 cores per process
    assert default_plan(32, "cuda", h100).num_workers == 0  # cores unknown
    assert default_plan(32, "cuda", h100, fused_optimizer=False).fused_optimizer is False  # no kernel here


def test_every_choice_of_the_default_plan_is_labelled_chosen_from_the_hardware():
    from saturate.plan import INFORMED, INFORMED_KNOBS, informed_choices, informed_summary

    plan = default_plan(32, "cuda", _AMPERE, cores=16, fused_optimizer=True)
    assert plan.provenance["informed"] == INFORMED == "chosen from the hardware, not measured"
    assert all(plan.provenance[k].endswith(f"({INFORMED})") for k in INFORMED_KNOBS)
    lines = informed_choices(plan)
    assert [line.split(":")[0] for line in lines] == list(INFORMED_KNOBS)
    assert informed_summary(plan) == ("bf16 (TF32 for fp32 matmuls), fused AdamW, micro-batch 16 × 2, 4 loader "
                                      "worker(s), pinned memory, non-blocking copies (chosen from the hardware, "
                                      "not measured)")
    assert informed_choices(reference_plan("naive")) == []  # naive is what it was: no such label


def test_the_default_micro_batch_is_the_largest_within_a_memory_prediction():
    plan = default_plan(32, "cuda", _AMPERE, memory_cap=(20, "a measured peak"))
    assert (plan.micro_batch, plan.grad_accum) == (16, 2) and "a measured peak" in plan.provenance["micro_batch"]
    assert default_plan(32, "cuda", _AMPERE, memory_cap=(1000, "x")).micro_batch == 32  # the whole batch
    assert default_plan(32, "cuda", _AMPERE, memory_cap=(0, "x")).micro_batch == 1
    assert "no memory was measured" in default_plan(32, "cpu", _CPU).provenance["micro_batch"]


def test_on_a_cpu_memory_only_lowers_the_default_micro_batch():
    roomy = default_plan(32, "cpu", _CPU, memory_cap=(1000, "a measured peak"))
    assert (roomy.micro_batch, roomy.grad_accum) == (8, 4)  # a larger micro-batch does not run faster on a CPU
    said = roomy.provenance["micro_batch"]
    assert "up to 8 on a CPU" in said and "a measured peak" in said
    assert default_plan(32, "cpu", _CPU, memory_cap=(5, "x")).micro_batch == 4
    assert default_plan(32, "cpu", _CPU, memory_cap=(0, "x")).micro_batch == 1


def test_default_plan_is_valid_toml(tmp_path):
    plan = default_plan(128, "cuda", _AMPERE)
    plan.save(tmp_path / "d.toml")
    assert Plan.load(tmp_path / "d.toml") == plan


def test_config_error_messages_are_single_lines():
    for bad in ({"micro_batch": 0}, {"precision": "fp8"}, {"pin_memory": 1}):
        with pytest.raises(ConfigError) as err:
            Plan(**bad)
        assert re.fullmatch(r"[^\n]+", str(err.value))


def test_reference_plan_copies_never_share_provenance():
    from saturate.plan import REFERENCE_PLANS, reference_plan

    copy_ = reference_plan("naive")
    copy_.provenance["tuned_on"] = "x"
    assert "tuned_on" not in REFERENCE_PLANS["naive"].provenance
    again = copy_.replace(micro_batch=2)
    assert again.provenance == {"tuned_on": "x"} and again.provenance is not copy_.provenance


def test_unserialisable_provenance_is_a_config_error(tmp_path):
    plan = Plan(provenance={"note": None})
    with pytest.raises(ConfigError, match="provenance"):
        plan.save(tmp_path / "p.toml")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("supports", "tokens", "micro"), [
    ({"bf16": True}, 128, 16),  # bf16 on a CPU, GPT-2-shaped samples: 16 × 2
    ({"bf16": True}, 2048 // 16, 16),  # 16 samples of 128 tokens: at the limit
    ({"bf16": True}, 2048 // 16 + 1, 8),  # over it: a micro-batch already holds the rows
    ({"bf16": True}, 1024, 8),
    ({"bf16": True}, None, 8),  # not tokens (an image, a row of features): nothing measured supports more
    ({"bf16": True}, 1, 8),
    ({}, 128, 8),  # fp32 (no native bf16): 32 × 1 measured −12.4 % against 8 × 4 on the AVX2 EPYC
])
def test_on_a_cpu_in_bf16_short_samples_take_a_micro_batch_of_16(supports, tokens, micro):
    plan = default_plan(32, "cpu", supports, tokens_per_sample=tokens)
    assert (plan.micro_batch, plan.grad_accum) == (micro, 32 // micro)
    said = plan.provenance["micro_batch"]
    assert ("up to 16 on a CPU in bf16" in said) == (micro == 16) and "chosen from the hardware" in said, said
    assert default_plan(32, "cuda", _AMPERE, tokens_per_sample=tokens).micro_batch == 16  # a GPU's rule as before


def test_memory_lowers_the_bf16_cpu_micro_batch_too():
    plan = default_plan(32, "cpu", {"bf16": True}, tokens_per_sample=128, memory_cap=(12, "a measured peak"))
    assert (plan.micro_batch, plan.grad_accum) == (8, 4)
    assert "up to 16 on a CPU in bf16" in plan.provenance["micro_batch"] and "within the 12" in \
        plan.provenance["micro_batch"]
