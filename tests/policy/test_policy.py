"""The policy floor: every threshold once, with its reason; overridable for an experiment, refused in one line when
wrong; `Load`, the one judgement of other processes' load."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from conftest import cli_env, saturate_cmd
from saturate.errors import ConfigError
from saturate.policy import POLICY, Load, Policy, load_policy, reasons
from saturate.policy.thresholds import LoadRules


def test_every_field_says_why_it_is_what_it_is():
    for section in dataclasses.fields(POLICY):
        for f in dataclasses.fields(getattr(POLICY, section.name)):
            assert f.metadata.get("why"), f"{section.name}.{f.name} has no reason"
    said = reasons(POLICY)
    assert set(said) == set(POLICY.to_dict()) and "same load" in said["load"]["same_cores"]


def test_the_policy_is_frozen_and_replaced_field_by_field():
    with pytest.raises(dataclasses.FrozenInstanceError):
        POLICY.load.same_cores = 0.3  # type: ignore[misc]
    p = Policy().replaced({"load": {"same_cores": 0.3}, "gains": {"min_gain": 0.05}})
    assert p.load.same_cores == 0.3 and p.gains.min_gain == 0.05 and p.load.uneven_cores == POLICY.load.uneven_cores
    assert p.to_dict()["load"]["same_cores"] == 0.3


@pytest.mark.parametrize("text, problem", [
    ("[loads]\nsame_cores = 0.3\n", "unknown policy section 'loads'"),
    ("[load]\nsame = 0.3\n", "unknown policy field load.same"),
    ("[load]\nsame_cores = 'a lot'\n", "policy field load.same_cores must be a float"),
    ("[windows]\nside_by_side_rounds = 2.5\n", "policy field windows.side_by_side_rounds must be a int"),
    ("[load\n", "cannot read it as TOML"),
])
def test_a_wrong_policy_file_is_refused_in_one_line(tmp_path, text, problem):
    path = tmp_path / "policy.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(")):
        load_policy(str(path))


def test_the_command_line_refuses_a_wrong_policy_file_before_anything_runs(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text("[load]\nsame = 0.3\n")
    out = subprocess.run(saturate_cmd("probe"), env={**cli_env(), "SATURATE_POLICY": str(path)}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"saturate: error: SATURATE_POLICY={path}: unknown policy field load.same; known: busy_cores, busy_share, "
        "same_cores, uneven_cores, forgiven_cores"]
    path.write_text("[load]\nsame_cores = 0.35\n")  # a good one is in force, in this process and in a command's
    code = "from saturate.policy import POLICY, overridden; print(POLICY.load.same_cores, overridden() is not None)"
    out = subprocess.run([sys.executable, "-c", code], env={**cli_env(), "SATURATE_POLICY": str(path)},
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["0.35", "True"], out.stderr


def test_a_load_is_busy_from_half_a_core_or_a_quarter_of_the_cores():
    assert not Load(None, 2).busy and not Load(0.49, 2).busy and Load(0.5, 2).busy  # 2 cores: half a core
    assert not Load(1.9, 16).busy and Load(4.0, 16).busy  # 16 cores: a quarter of them
    assert Load(0.5).busy  # cores not known (1): half a core


def test_two_loads_are_the_same_close_together_uneven_far_apart_and_neither_between():
    a = Load(1.0)
    assert a.same_as(Load(1.15)) and not a.uneven_with(Load(1.15))
    assert not a.same_as(Load(1.3)) and not a.uneven_with(Load(1.3))  # between: neither trusted nor left out
    assert a.uneven_with(Load(0.4)) and not a.same_as(Load(0.4))
    assert not a.same_as(Load(None)) and not a.uneven_with(Load(None))  # unread: never either


def test_the_threads_a_neighbour_leaves():
    assert Load(0.0, 2).threads_left() == 2 and Load(1.0, 2).threads_left() == 1
    assert Load(1.2, 2).threads_left() == 1  # a quarter of a core's reading is forgiven
    assert Load(1.3, 2).threads_left() == 1  # never none
    assert Load(3.1, 8).threads_left() == 5 and Load(3.3, 8).threads_left() == 4
    assert Load(1.0, 2, LoadRules(forgiven_cores=0.0)).threads_left() == 1


def test_one_rule_says_which_thread_count_to_measure_on_a_busy_cpu():
    from saturate.policy.threads import Skip, threads_to_try

    assert threads_to_try("cpu", 1, 2, Load(1.0, 2)).count == 1
    assert threads_to_try("cpu", 1, 8, Load(3.3, 8)).count == 4
    assert threads_to_try("cpu", 1, 2, Load(0.2, 2)).skip is Skip.QUIET
    assert threads_to_try("cpu", 1, 1, Load(1.0, 2)).skip is Skip.ENOUGH  # one thread already
    assert threads_to_try("cuda", 1, 2, Load(1.0, 2)).skip is Skip.NOT_CPU
    assert threads_to_try("cpu", 2, 2, Load(1.0, 2)).skip is Skip.PROCESSES
    assert threads_to_try("cpu", 1, None, Load(1.0, 2)).skip is Skip.UNKNOWN
