"""What saturate's hooks change in torch, recorded so that all of it can be undone: detaching.

After the doctor's window in a script that saturate does not stop, nothing of saturate stays on the
script's path: the methods it replaced (DataLoader's `__init__`/`__iter__`, its iterator's `__next__`,
`Optimizer.__init__`, the fused-optimizer overrides) are put back at once, and its global optimizer-step
hook is removed at the model's next forward. It cannot be removed at once: the window ends inside that
hook, while torch iterates its global optimizer hooks (removing one there is an error). Without a known
model the hook stays, its body returning at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Patches:
    """Methods replaced on torch's classes and hooks registered, in the order they were made."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self._hooks: list[Any] = []  # handles (`.remove()`), removed outside the optimizer step

    def replace(self, owner: type, name: str, value: Any) -> None:
        """`owner.name = value`, remembered."""
        had, original = name in owner.__dict__, owner.__dict__.get(name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, original) if had else delattr(owner, name))

    def hook(self, handle: Any) -> Any:
        """A hook's handle, remembered."""
        self._hooks.append(handle)
        return handle

    @property
    def attached(self) -> bool:
        return bool(self._undo or self._hooks)

    def detach(self, model: Any = None) -> None:
        """Put every replaced method back now; remove the hooks at `model`'s next forward (may be called from
        inside an optimizer hook). Without a model the hooks stay."""
        while self._undo:
            self._undo.pop()()
        if model is not None and self._hooks:
            self._hooks.append(model.register_forward_pre_hook(lambda *args: self.remove_hooks()))

    def remove_hooks(self) -> None:
        """Remove the hooks now (never from inside an optimizer hook: torch is iterating them)."""
        while self._hooks:
            self._hooks.pop().remove()
