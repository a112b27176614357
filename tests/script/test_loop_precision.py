"""A plain loop's bf16 autocast from outside (script/child/loop_precision.py), in this process."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from saturate.script.child.loop_precision import LoopPrecision
from saturate.script.child.patches import Patches


class AutocastSeen(Dataset):
    """Each item: whether CPU autocast is on where the item is made (in a loader's worker, that worker)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> bool:
        return torch.is_autocast_enabled("cpu")


def test_bf16_autocast_is_on_in_the_main_thread_and_off_in_forked_loader_workers():
    patches, loop = Patches(), LoopPrecision("cpu", keep_losses=False)
    try:
        loop.install(torch, patches)
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        in_workers = list(DataLoader(AutocastSeen(), batch_size=None, num_workers=2, multiprocessing_context="fork"))
        in_main = list(DataLoader(AutocastSeen(), batch_size=None, num_workers=0))
    finally:
        torch.set_autocast_enabled("cpu", False)
        torch.set_autocast_cache_enabled(True)
        patches.detach()
    assert in_workers == [False] * 4
    assert in_main == [True] * 4


SPAWNED = """
import json, sys, torch
from torch.utils.data import DataLoader, Dataset


class AutocastSeen(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor(float(torch.is_autocast_enabled("cpu")))


if __name__ == "__main__":
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for x in DataLoader(AutocastSeen(), batch_size=None, num_workers=1, multiprocessing_context="spawn"):
        seen.append(bool(x))
        model(x.reshape(1, 1)).sum().backward()
        opt.step()
        opt.zero_grad()
    with open(sys.argv[1], "w") as f:
        json.dump({"main": torch.is_autocast_enabled("cpu"), "workers": seen}, f)
"""


@pytest.mark.slow
def test_bf16_autocast_from_outside_is_off_in_spawned_loader_workers(tmp_path):
    """A spawned worker is a fresh interpreter the shim hooks too: its loop starts with autocast off."""
    import json
    import sys

    from saturate.script.overrides import Overrides
    from saturate.script.run_script import full_run

    (tmp_path / "spawned.py").write_text(SPAWNED)
    run = full_run([sys.executable, str(tmp_path / "spawned.py"), str(tmp_path / "seen.json")],
                   Overrides(bf16_autocast="cpu"), quiet_stdout=True)
    assert run.returncode == 0, run
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {"main": True, "workers": [False] * 4}
