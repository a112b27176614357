"""Small pieces the hooks share: where a script's line is shown (relative only under the working folder) and
how many samples a batch holds (one function for the hooks and the doctor's Profiler)."""

from __future__ import annotations

import torch

from saturate.doctor.profiler import batch_len
from saturate.script.child.found import shown_path


def test_a_script_path_is_relative_only_under_the_working_folder(tmp_path, monkeypatch):
    inside = tmp_path / "work" / "sub" / "train.py"
    outside = tmp_path / "elsewhere" / "train.py"
    sibling = tmp_path / "work-old" / "train.py"  # a prefix of the folder's name is not under it
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    assert shown_path(str(inside)) == "sub/train.py"
    assert shown_path(str(outside)) == str(outside)  # never ../elsewhere/train.py
    assert shown_path(str(sibling)) == str(sibling)


def test_batch_len_counts_the_first_dimension_of_the_first_tensor():
    x = torch.zeros(5, 3)
    assert batch_len(x) == 5
    assert batch_len((x, torch.zeros(5))) == 5
    assert batch_len({"ids": [1, 2], "x": x}) == 5  # the first tensor, whatever comes before it
    assert batch_len(torch.tensor(1.0)) == 1  # one sample
    assert batch_len("text") == 0
