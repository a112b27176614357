"""The tuned settings as a patch `git apply` and `patch -p1` take (script/patch_edit.py)."""

from __future__ import annotations

import shutil
import subprocess
import types

import pytest

from saturate.script.overrides import Overrides
from saturate.script.patch_edit import keyword_changes, tuned_patch, unified, value_change

CONFIG = """import dataclasses


@dataclasses.dataclass
class Config:
    batch_size: int = 4
    grad_accum: int = 8  # the split of the effective batch: 32
    lr: float = 4e-3
"""
TRAIN = """import torch
from torch.utils.data import DataLoader, TensorDataset
from config import Config

cfg = Config()
model = torch.nn.Linear(2, 1)
loader = DataLoader(TensorDataset(torch.zeros(64, 2)),
                    batch_size=cfg.batch_size,
                    shuffle=True)
opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
"""


def tuning(over: Overrides, **fields) -> types.SimpleNamespace:
    loader = {"site": "train.py:7", "split": {"micro": "cfg.batch_size", "micro_value": 4,
                                              "accum": {"cfg.grad_accum": 8}}}
    return types.SimpleNamespace(best=types.SimpleNamespace(overrides=over), loaders=[loader],
                                 optimizer={"class": "AdamW", "site": "train.py:10"}, **fields)


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "config.py").write_text(CONFIG)
    (tmp_path / "train.py").write_text(TRAIN)
    return tmp_path


def applies(folder, patch: str) -> dict[str, str]:
    """The files after `git apply` (outside a repository: relative to the folder) and, on a fresh copy, after
    `patch -p1`: both must take it and agree."""
    (folder / "edit.diff").write_text(patch)
    copy = folder.parent / f"{folder.name}-copy"
    shutil.copytree(folder, copy)
    done = subprocess.run(["git", "apply", "edit.diff"], cwd=folder, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    done = subprocess.run(["patch", "-p1", "-i", "edit.diff"], cwd=copy, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    after = {p.name: p.read_text() for p in folder.glob("*.py")}
    assert after == {p.name: p.read_text() for p in copy.glob("*.py")}
    return after


def test_the_loaders_arguments_the_optimizers_fused_and_the_split_go_in_one_patch(folder):
    over = Overrides(loader={"num_workers": 2, "persistent_workers": True}, optimizer={"fused": True},
                     train_loader={"site": "train.py:7", "batch_size": 32,
                                   "set": {"cfg.batch_size": 32, "cfg.grad_accum": 1}})
    patch = tuned_patch(tuning(over), folder)
    assert patch.left == [] and patch.text.startswith("--- a/config.py\n+++ b/config.py\n")
    assert patch.folder == folder.resolve()
    after = applies(folder, patch.text)
    assert "    batch_size: int = 32\n    grad_accum: int = 1  # the split" in after["config.py"]
    assert "                    shuffle=True, num_workers=2, persistent_workers=True)" in after["train.py"]
    assert "AdamW(model.parameters(), lr=cfg.lr, fused=True)" in after["train.py"]
    compile(after["train.py"], "train.py", "exec")  # still Python


def test_a_literal_the_call_gives_is_replaced_where_it_is(folder):
    (folder / "train.py").write_text(TRAIN.replace("shuffle=True)", "shuffle=True, num_workers=0)"))
    changes = keyword_changes(folder / "train.py", 7, "DataLoader", {"num_workers": 4, "batch_size": 16})
    after = applies(folder, unified(changes, folder))
    assert "batch_size=16,\n                    shuffle=True, num_workers=4)" in after["train.py"]


def test_a_call_taking_unpacked_keywords_is_not_given_one_more(folder):
    (folder / "train.py").write_text(TRAIN.replace("shuffle=True)", "**opts)"))
    said = keyword_changes(folder / "train.py", 7, "DataLoader", {"num_workers": 2})
    assert said == "the DataLoader(...) at train.py:7 takes **keywords, which may already set num_workers"


def test_a_setting_held_in_several_places_or_none_is_left_out_and_said(folder):
    (folder / "presets.py").write_text("def small():\n    return dict(batch_size=4)\n")
    said = value_change(folder, "cfg.batch_size", 4, 32)
    assert said == (f"cfg.batch_size: 2 places in {folder} give it 4 (config.py:6, presets.py:2), so it is not in "
                    "the patch")
    assert value_change(folder, "cfg.grad_accum", 3, 1).startswith("cfg.grad_accum: 0 places")
    over = Overrides(train_loader={"site": "train.py:7", "batch_size": 32,
                                   "set": {"cfg.batch_size": 32, "cfg.grad_accum": 1}})
    patch = tuned_patch(tuning(over), folder)
    assert patch.left == [said]
    assert "-    grad_accum: int = 8" in patch.text and "-    batch_size" not in patch.text  # the rest still goes in


def test_an_argparse_default_and_a_module_constant_are_found():
    import ast

    from saturate.script.patch_edit import _values_for

    tree = ast.parse("p.add_argument('--grad-accum', type=int, default=8)\nBATCH = 4\nx.add_argument('-b', "
                     "dest='batch', default=2)\n")
    found = {name: [ast.unparse(v) for n in ast.walk(tree) for v in _values_for(n, name)]
             for name in ("grad_accum", "BATCH", "batch")}
    assert found == {"grad_accum": ["8"], "BATCH": ["4"], "batch": ["2"]}


def test_nothing_at_a_line_of_the_script_gives_an_empty_patch(folder):
    patch = tuned_patch(tuning(Overrides(threads=1, tf32=True, compile="default")), folder)
    assert patch.text == "" and patch.left == []


def test_a_script_outside_the_working_folder_is_patched_from_its_own(folder, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("cwd")
    site = f"{folder / 'train.py'}:7"
    t = tuning(Overrides(loader={"num_workers": 2}))
    t.loaders[0]["site"] = site
    patch = tuned_patch(t, elsewhere)
    assert patch.folder == folder.resolve() and patch.text.startswith("--- a/train.py\n")
    assert "num_workers=2)" in applies(folder, patch.text)["train.py"]
