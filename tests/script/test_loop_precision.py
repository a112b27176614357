"""A plain loop's bf16 autocast from outside (script/child/loop_precision.py), in this process."""

from __future__ import annotations

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
