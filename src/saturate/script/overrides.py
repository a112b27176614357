"""The settings `saturate tune -- CMD` finds and `saturate run -- CMD` applies from outside: what each means.

An overrides object (`overrides.json`) has, each optional:

- `"loader"`: DataLoader arguments (`LOADER_KNOBS`) for every DataLoader the script makes;
- `"train_loader"`: `{"site": "train.py:LINE", "batch_size": N}`, the batch size of the DataLoader made at
  that line (the training loader as the as-written run saw it; a library's copy of it too): the micro-batch
  of a script whose trainer accumulates (a Lightning `Trainer`);
- `"trainer"`: a Transformers `Trainer`'s `TrainingArguments` fields (`trainer_hooks.TUNABLE`);
- `"lightning"`: a Lightning `Trainer`'s arguments (`lightning_hooks.TUNABLE`);
- `"optimizer"`: `{"fused": true}`, for the script's `Adam`/`AdamW` (a keyword their constructors take);
- `"tf32"`: TF32 matmuls at start-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from saturate.errors import ConfigError
from saturate.script.child import lightning_hooks, trainer_hooks

LOADER_KNOBS = ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers")
FUSED_OPTIMIZERS = ("Adam", "AdamW")  # torch.optim classes whose constructor takes fused=


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """`a` with `b`'s settings added (the sections' fields merged)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in a.items()}
    for k, v in b.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) else v
    return out


def check(path: Path | str, overrides: dict[str, Any]) -> None:
    """Refuse (one line naming the problem) what saturate would not apply: only the knobs it tunes, so the
    training stays the same."""
    sections = {"loader": LOADER_KNOBS, "trainer": trainer_hooks.TUNABLE, "lightning": lightning_hooks.TUNABLE,
                "optimizer": ("fused",), "train_loader": ("site", "batch_size")}
    unknown = sorted(set(overrides) - set(sections) - {"tf32"})
    if unknown:
        raise ConfigError(f"--overrides {path}: unknown setting(s) {', '.join(unknown)} (saturate applies "
                          f"{', '.join((*sections, 'tf32'))})")
    what = {"trainer": "TrainingArguments fields", "lightning": "Lightning Trainer arguments"}
    for name, allowed in sections.items():
        fields = overrides.get(name, {})
        kind = what.get(name, f"{name} settings")
        if not isinstance(fields, dict):
            raise ConfigError(f"--overrides {path}: \"{name}\" must be an object of {kind}")
        if extra := sorted(set(fields) - set(allowed)):
            raise ConfigError(f"--overrides {path}: {', '.join(extra)} not among the {kind} saturate applies "
                              f"({', '.join(allowed)})")
    train = overrides.get("train_loader")
    if train is not None and not (isinstance(train.get("site"), str) and isinstance(train.get("batch_size"), int)
                                  and not isinstance(train["batch_size"], bool) and train["batch_size"] > 0):
        raise ConfigError(f"--overrides {path}: \"train_loader\" needs \"site\" (file.py:LINE) and a positive "
                          "integer \"batch_size\"")


def loader_changes(overrides: dict[str, Any], bound: Any, resized: bool) -> dict[str, Any]:
    """The DataLoader arguments to change in one `DataLoader(...)` call (`bound`: its bound arguments):
    the `"loader"` settings, and the batch size where `resized` (made at the training loader's line) and
    the call sets a batch size (not a batch_sampler of its own)."""
    changes = dict(overrides.get("loader") or {})
    train = overrides.get("train_loader") or {}
    if resized and "batch_size" in train and bound.arguments.get("batch_sampler") is None \
            and bound.arguments.get("batch_size", 1) is not None:
        changes["batch_size"] = train["batch_size"]
    return changes


def optimizer_changes(overrides: dict[str, Any], optimizer_class: type) -> dict[str, Any]:
    """Constructor keywords for an optimizer of this class: `fused=` for torch's Adam/AdamW (with foreach off,
    which fused excludes)."""
    over = overrides.get("optimizer") or {}
    if "fused" not in over or optimizer_class.__name__ not in FUSED_OPTIMIZERS \
            or not optimizer_class.__module__.startswith("torch.optim"):
        return {}
    return {"fused": over["fused"], **({"foreach": None} if over["fused"] else {})}
