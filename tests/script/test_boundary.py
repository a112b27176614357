"""What crosses between saturate and a user's command: `Overrides` (validated, JSON in and out) and
`ChildSettings` (the environment's one JSON value), and the failure kind read from the script's stderr."""

from __future__ import annotations

import dataclasses
import json

import pytest

from saturate.errors import ConfigError
from saturate.script.boundary import ENV_DIR, ENV_SETTINGS, SHIM, ChildSettings, environment, steps_reported
from saturate.script.command import ran_out_of_memory
from saturate.script.overrides import NONE, Overrides


def test_overrides_round_trip_through_json_and_keep_only_what_is_set():
    data = {"loader": {"num_workers": 2, "persistent_workers": True}, "tf32": True,
            "train_loader": {"site": "train.py:49", "batch_size": 16}, "optimizer": {"fused": True},
            "trainer": {"bf16": True}, "lightning": {"precision": "bf16-mixed"}}
    over = Overrides.from_dict(json.loads(json.dumps(data)))
    assert over.to_dict() == data and Overrides.from_dict(over.to_dict()) == over
    assert NONE.to_dict() == {} and not NONE and over
    assert Overrides(loader={"num_workers": 0}).to_dict() == {"loader": {"num_workers": 0}}  # set, though zero


def test_overrides_are_frozen_and_do_not_share_the_callers_dict():
    fields = {"num_workers": 2}
    over = Overrides(loader=fields)
    fields["num_workers"] = 8
    assert over.loader == {"num_workers": 2}
    with pytest.raises(dataclasses.FrozenInstanceError):
        over.tf32 = True  # type: ignore[misc]


def test_merged_adds_fields_section_by_section_the_later_winning():
    a = Overrides(loader={"num_workers": 2, "prefetch_factor": 2}, trainer={"bf16": True})
    b = Overrides(loader={"prefetch_factor": 4}, tf32=True)
    assert a.merged(b).to_dict() == {"loader": {"num_workers": 2, "prefetch_factor": 4}, "trainer": {"bf16": True},
                                     "tf32": True}
    assert a.to_dict() == {"loader": {"num_workers": 2, "prefetch_factor": 2}, "trainer": {"bf16": True}}
    autocast = Overrides(bf16_autocast="cuda")
    assert Overrides.from_dict(autocast.to_dict()) == autocast and b.merged(autocast).to_dict() == {
        "loader": {"prefetch_factor": 4}, "tf32": True, "bf16_autocast": "cuda"}


@pytest.mark.parametrize("data, message", [
    ({"loader": {"workers": 2}}, "workers not among the loader settings saturate applies"),
    ({"trainer": {"learning_rate": 1.0}}, "learning_rate not among the TrainingArguments fields"),
    ({"steps": 5}, "unknown setting(s) steps"),
    ({"tf32": "yes"}, '"tf32" must be true or false'),
    ({"optimizer": ["fused"]}, '"optimizer" must be an object of optimizer settings'),
    ({"bf16_autocast": "mps"}, '"bf16_autocast" must be one of cuda, cpu'),
])
def test_a_bad_override_is_one_error_naming_the_key(data, message):
    with pytest.raises(ConfigError) as e:
        Overrides.from_dict(data, "--overrides x.json")
    assert message in str(e.value) and str(e.value).startswith("--overrides x.json: ")
    assert "\n" not in str(e.value)


def test_reading_an_overrides_file_refuses_what_is_not_one(tmp_path):
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match="expected a JSON object of settings"):
        Overrides.read(tmp_path / "list.json")
    with pytest.raises(ConfigError, match="not a readable overrides.json"):
        Overrides.read(tmp_path / "broken.json")
    (tmp_path / "ok.json").write_text(json.dumps({"loader": {"num_workers": 1}}))
    assert Overrides.read(tmp_path / "ok.json") == Overrides(loader={"num_workers": 1})


def test_child_settings_cross_as_one_json_value_with_their_overrides():
    settings = ChildSettings(mode="trial", warmup=3, count_steps=0, steps=4, stop=True,
                             overrides=Overrides(loader={"num_workers": 2}), windows={"window_s": 0.5, "target": 0.02})
    back = ChildSettings.from_json(settings.to_json())
    assert back == settings and isinstance(back.overrides, Overrides)
    assert ChildSettings.from_json(None) == ChildSettings() and ChildSettings().needed_steps == 6
    env = environment({"PYTHONPATH": "/theirs"}, SHIM.parent, settings, SHIM.parents[3])
    assert env["PYTHONPATH"].split(":")[0] == str(SHIM) and env["PYTHONPATH"].endswith("/theirs")
    assert env[ENV_DIR] == str(SHIM.parent) and ChildSettings.from_json(env[ENV_SETTINGS]) == settings
    assert (SHIM / "sitecustomize.py").exists()


@pytest.mark.parametrize("text, message", [
    ('{"mode": "train"}', "mode 'train' is not one of doctor, trial, apply"),
    ('{"warmup": -1}', "warmup must be an integer >= 0"),
    ('{"stpes": 3}', "unknown child setting(s) stpes"),
    ('{"overrides": {"loader": {"workers": 1}}}', "workers not among the loader settings"),
])
def test_bad_child_settings_are_refused_naming_the_key(text, message):
    with pytest.raises(ConfigError) as e:
        ChildSettings.from_json(text)
    assert message in str(e.value)


def test_the_steps_every_process_reported_and_an_out_of_memory_failure(tmp_path):
    assert steps_reported(tmp_path) == 0
    (tmp_path / "status-11.json").write_text(json.dumps({"optimizer_steps": 3}))
    (tmp_path / "status-12.json").write_text(json.dumps({"optimizer_steps": 5}))
    assert steps_reported(tmp_path) == 5
    assert ran_out_of_memory(["Traceback (most recent call last):", "torch.OutOfMemoryError: CUDA out of memory."])
    assert not ran_out_of_memory(["ValueError: the batch has 3 dimensions"])


def test_settings_the_child_cannot_read_stop_the_command_with_one_line(monkeypatch, tmp_path):
    import sys

    from saturate.script import boundary
    from saturate.script.command import run_instrumented

    monkeypatch.setattr(boundary.ChildSettings, "to_json", lambda self: '{"mode": "bogus"}')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        run_instrumented([sys.executable, "-c", "import torch; print('trained')"], ChildSettings(), quiet_stdout=True)
    assert "saturate's hooks could not start" in str(e.value) and "mode 'bogus' is not one of" in str(e.value)


def test_threads_travel_as_a_positive_integer_and_the_later_wins():
    over = Overrides.from_dict({"loader": {"num_workers": 2}, "threads": 1})
    assert over.threads == 1 and over.to_dict() == {"loader": {"num_workers": 2}, "threads": 1}
    assert over.merged(Overrides(threads=3)).threads == 3 and over.merged(NONE).threads == 1
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="\"threads\" must be a positive integer"):
            Overrides.from_dict({"threads": bad})


def test_the_host_allocator_travels_in_the_scripts_environment_unless_the_user_set_one(tmp_path, monkeypatch):
    import os

    from saturate.engine.host_alloc import ENV_MMAP, ENV_TRIM, child_env
    from saturate.script import command

    over = Overrides.from_dict({"host_alloc": True})
    assert over.to_dict() == {"host_alloc": True} and NONE.merged(over).host_alloc
    with pytest.raises(ConfigError, match="\"host_alloc\" must be true or false"):
        Overrides.from_dict({"host_alloc": 1})
    settings = ChildSettings(overrides=over)
    monkeypatch.setattr(os, "environ", {"PATH": "/bin"})
    env = command._env(tmp_path, settings)
    assert {k: env[k] for k in (ENV_MMAP, ENV_TRIM) if k in env} == child_env({})
    monkeypatch.setattr(os, "environ", {"MALLOC_TRIM_THRESHOLD_": "1"})
    mine = command._env(tmp_path, settings)
    assert mine["MALLOC_TRIM_THRESHOLD_"] == "1" and ENV_MMAP not in mine
    monkeypatch.setattr(os, "environ", {})
    assert ENV_MMAP not in command._env(tmp_path, ChildSettings())  # only when asked for
