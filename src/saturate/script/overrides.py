"""`Overrides`: the settings `saturate tune -- CMD` finds and `saturate run -- CMD` applies from outside — the
script's twin of `Plan`, and what travels from the parent to the child (`boundary.ChildSettings`).

Each section is optional; together they are `overrides.json`:

- `loader`: DataLoader arguments (`LOADER_KNOBS`) for every DataLoader the script makes;
- `train_loader`: `{"site": "train.py:LINE", "batch_size": N}`, the batch size of the DataLoader made at that
  line (the training loader as the as-written run saw it; a library's copy of it too): the micro-batch of a
  script whose trainer accumulates (a Lightning `Trainer`); with `"set": {"cfg.grad_accum": 4, …}` for a loop of
  its own, names (`NAME` or `NAME.attr`) set to these values where that DataLoader is made (its split of the
  effective batch: `child/split_source.py`);
- `flags`: `{"batch_size": 32, "gradient_accumulation_steps": 1}`, appended to the script's command line as
  `--name=value`: for a script that reads such overrides into its globals through nanoGPT's `configurator.py`, or
  parses them with argparse (the last of a flag wins) — its split of the effective batch where its command line
  holds it (`child/split_source.configurator`, `child/split_source.parsed`);
- `trainer`: a Transformers `Trainer`'s `TrainingArguments` fields (`TRAINER_TUNABLE`);
- `lightning`: a Lightning `Trainer`'s arguments (`LIGHTNING_TUNABLE`);
- `optimizer`: `{"fused": true}`, for the script's `Adam`/`AdamW` (a keyword their constructors take);
- `tf32`: TF32 matmuls at start-up;
- `threads`: torch's intra-op threads (`torch.set_num_threads`), kept whatever the script sets itself;
- `host_alloc`: glibc's malloc thresholds raised in the script's environment (`engine/host_alloc.py`: a CPU
  step's buffers reused, not mapped afresh every step);
- `bf16_autocast`: a device type ("cuda", "cpu") whose ops run under bf16 autocast from start-up, as if the whole
  script were inside `with torch.autocast(device, dtype=torch.bfloat16):` (forward and loss; the weights and
  the optimizer stay fp32) — for a plain loop that trains in fp32 (`child/loop_precision.py`);
- `compile`: a `torch.compile` mode ("default", "reduce-overhead", "max-autotune") for the model of a plain loop,
  compiled in place (its `forward`) once its first optimizer step has found it (`child/loop_compile.py`).

Only the knobs saturate tunes are accepted, so the training stays the same: anything else is one
`ConfigError` naming the key. Both sides import this module; it imports nothing of either.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from saturate.errors import ConfigError

LOADER_KNOBS = ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers")
FUSED_OPTIMIZERS = ("Adam", "AdamW")  # torch.optim classes whose constructor takes fused=
# TrainingArguments fields saturate may change (a Transformers Trainer)
TRAINER_TUNABLE = ("per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16", "tf32",
                   "dataloader_num_workers", "dataloader_pin_memory", "dataloader_prefetch_factor",
                   "dataloader_persistent_workers", "torch_compile", "gradient_checkpointing", "optim", "use_cpu")
LIGHTNING_TUNABLE = ("precision", "accumulate_grad_batches")  # Lightning Trainer arguments saturate may change
SECTIONS: dict[str, tuple[str, ...]] = {"loader": LOADER_KNOBS, "trainer": TRAINER_TUNABLE,
                                        "lightning": LIGHTNING_TUNABLE, "optimizer": ("fused",),
                                        "train_loader": ("site", "batch_size", "set")}
SET_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)?$")  # a name `train_loader.set` may change
FLAG_NAME = re.compile(r"^[A-Za-z_][\w.-]*$")  # a flag `flags` may give (`batch_size`, `batch-size`, `a.b`)
AUTOCAST_DEVICES = ("cuda", "cpu")  # device types `bf16_autocast` may name
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")  # the torch.compile modes `compile` may name
_KINDS = {"trainer": "TrainingArguments fields", "lightning": "Lightning Trainer arguments"}


@dataclass(frozen=True)
class Overrides:
    """Settings applied to a user's script from outside (module docstring). Empty sections are `{}`; an empty
    `Overrides()` is falsy: the script as written. Never mutated: `merged` and `with_section` give new ones."""

    loader: Mapping[str, Any] = field(default_factory=dict)
    train_loader: Mapping[str, Any] = field(default_factory=dict)  # {"site", "batch_size"} or {}
    flags: Mapping[str, int] = field(default_factory=dict)  # `--name=value`, appended to its command line
    trainer: Mapping[str, Any] = field(default_factory=dict)
    lightning: Mapping[str, Any] = field(default_factory=dict)
    optimizer: Mapping[str, Any] = field(default_factory=dict)
    tf32: bool = False
    threads: int | None = None
    host_alloc: bool = False
    bf16_autocast: str | None = None
    compile: str | None = None

    def __post_init__(self) -> None:
        for name, allowed in SECTIONS.items():
            section = getattr(self, name)
            kind = _KINDS.get(name, f"{name} settings")
            if not isinstance(section, Mapping):
                raise ConfigError(f"\"{name}\" must be an object of {kind}")
            if extra := sorted(set(section) - set(allowed)):
                raise ConfigError(f"{', '.join(extra)} not among the {kind} saturate applies ({', '.join(allowed)})")
            object.__setattr__(self, name, dict(section))  # a copy: the caller's dict cannot change it later
        train = self.train_loader
        if train and not (isinstance(train.get("site"), str) and isinstance(train.get("batch_size"), int)
                          and not isinstance(train["batch_size"], bool) and train["batch_size"] > 0):
            raise ConfigError("\"train_loader\" needs \"site\" (file.py:LINE) and a positive integer \"batch_size\"")
        names = train.get("set", {})
        if not isinstance(names, Mapping) or not all(
                isinstance(k, str) and SET_NAME.match(k) and isinstance(v, int) and not isinstance(v, bool) and v > 0
                for k, v in names.items()):
            raise ConfigError("\"train_loader\".\"set\" maps names (NAME or NAME.attr) to positive integers")
        if not isinstance(self.flags, Mapping) or not all(
                isinstance(k, str) and FLAG_NAME.match(k) and isinstance(v, int) and not isinstance(v, bool) and v > 0
                for k, v in self.flags.items()):
            raise ConfigError("\"flags\" maps command-line flags (NAME, without their dashes) to positive integers")
        object.__setattr__(self, "flags", dict(self.flags))
        for name in ("tf32", "host_alloc"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"\"{name}\" must be true or false, got {getattr(self, name)!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ConfigError(f"\"threads\" must be a positive integer, got {self.threads!r}")
        if self.bf16_autocast is not None and self.bf16_autocast not in AUTOCAST_DEVICES:
            raise ConfigError(f"\"bf16_autocast\" must be one of {', '.join(AUTOCAST_DEVICES)}, got "
                              f"{self.bf16_autocast!r}")
        if self.compile is not None and self.compile not in COMPILE_MODES:
            raise ConfigError(f"\"compile\" must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, where: str = "") -> Overrides:
        """From `overrides.json`'s object; a bad key or value is one line, prefixed by `where` (the file)."""
        prefix = f"{where}: " if where else ""
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ConfigError(f"{prefix}expected a JSON object of settings")
        known = [f.name for f in fields(cls)]
        if unknown := sorted(set(data) - set(known)):
            raise ConfigError(f"{prefix}unknown setting(s) {', '.join(unknown)} (saturate applies "
                              f"{', '.join(known)})")
        try:
            return cls(**{k: v for k, v in data.items() if v is not None})
        except ConfigError as e:
            raise ConfigError(f"{prefix}{e}") from None

    @classmethod
    def read(cls, path: Path) -> Overrides:
        """An `overrides.json` (what `saturate tune -- CMD` wrote), refused in one line when unreadable or wrong."""
        where = f"--overrides {path}"
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{where}: not a readable overrides.json ({e})") from None
        return cls.from_dict(data, where)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: only the sections that set something."""
        out: dict[str, Any] = {name: dict(getattr(self, name)) for name in SECTIONS if getattr(self, name)}
        if self.flags:
            out["flags"] = dict(self.flags)
        if self.tf32:
            out["tf32"] = True
        if self.threads is not None:
            out["threads"] = self.threads
        if self.host_alloc:
            out["host_alloc"] = True
        if self.bf16_autocast is not None:
            out["bf16_autocast"] = self.bf16_autocast
        if self.compile is not None:
            out["compile"] = self.compile
        order = ("loader", "train_loader", "flags", "trainer", "lightning", "optimizer", "tf32", "threads",
                 "host_alloc", "bf16_autocast", "compile")
        return {k: out[k] for k in order if k in out}

    def __bool__(self) -> bool:
        return bool(self.to_dict())

    def merged(self, other: Overrides) -> Overrides:
        """These settings with `other`'s added (each section's fields merged; `other` wins)."""
        return Overrides(**{name: {**getattr(self, name), **getattr(other, name)} for name in SECTIONS},
                         flags={**self.flags, **other.flags},
                         tf32=self.tf32 or other.tf32,
                         threads=other.threads if other.threads is not None else self.threads,
                         host_alloc=self.host_alloc or other.host_alloc,
                         bf16_autocast=other.bf16_autocast or self.bf16_autocast,
                         compile=other.compile or self.compile)

    def argv(self) -> list[str]:
        """The `flags` as the command-line arguments appended to the script's (`--name=value`)."""
        return [f"--{k}={v}" for k, v in self.flags.items()]

    def loader_changes(self, bound: Any, resized: bool) -> dict[str, Any]:
        """The DataLoader arguments to change in one `DataLoader(...)` call (`bound`: its bound arguments): the
        `loader` settings, and the batch size where `resized` (made at the training loader's line) and the call
        sets a batch size (not a batch_sampler of its own)."""
        changes = dict(self.loader)
        train = self.train_loader
        if resized and "batch_size" in train and bound.arguments.get("batch_sampler") is None \
                and bound.arguments.get("batch_size", 1) is not None:
            changes["batch_size"] = train["batch_size"]
        return changes

    def optimizer_changes(self, optimizer_class: type) -> dict[str, Any]:
        """Constructor keywords for an optimizer of this class: `fused=` for torch's Adam/AdamW (with foreach off,
        which fused excludes)."""
        over = self.optimizer
        if "fused" not in over or optimizer_class.__name__ not in FUSED_OPTIMIZERS \
                or not optimizer_class.__module__.startswith("torch.optim"):
            return {}
        return {"fused": over["fused"], **({"foreach": None} if over["fused"] else {})}


NONE = Overrides()  # the script as written


def from_changes(changes: Mapping[str, Any], framework: bool, device_type: str) -> Overrides | None:
    """The settings that make a doctor's fix (its plan `changes`) from outside the script, or None when it needs an
    edit or sets nothing: loader keywords, torch threads and, for a loop of its own (not a `framework`'s Trainer),
    compile and bf16 autocast (`doctor -- CMD --apply`)."""
    rest = dict(changes)
    loader = {k: rest.pop(k) for k in list(rest) if k in LOADER_KNOBS}
    over = Overrides(loader=loader)
    if "threads" in rest:
        over = over.merged(Overrides(threads=int(rest.pop("threads"))))
    if not framework and rest.get("compile") in COMPILE_MODES:
        over = over.merged(Overrides(compile=rest.pop("compile")))
    if not framework and rest.get("precision") == "bf16" and device_type in AUTOCAST_DEVICES:
        rest.pop("precision")
        over = over.merged(Overrides(bf16_autocast=device_type))
    rest.pop("non_blocking", None)  # the copy's own flag: with pinned memory, a copy that is not async still works
    return None if rest or not over else over
