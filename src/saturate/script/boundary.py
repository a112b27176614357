"""The boundary between saturate (the parent) and the user's command (the child): everything that crosses it.

The parent (`command.run_instrumented`) starts the command unchanged; the child side (`child/`, loaded into every
Python process of the command by `child/shim/sitecustomize.py` once it imports torch) measures it and applies
settings. Neither side calls the other: they meet here.

In, through the environment the command inherits:

- `PYTHONPATH`: the shim's folder first (`SHIM`), then saturate's own source (so the child imports the same
  saturate as the parent);
- `ENV_DIR` (`SATURATE_SCRIPT_DIR`): a fresh temporary folder of the parent's, the only place the child writes;
- `ENV_SETTINGS` (`SATURATE_SCRIPT_SETTINGS`): `ChildSettings` as JSON — what this run is for (`mode`), how many
  steps to warm up, count and time, whether to stop the command after them, the `Overrides` to apply, and a
  trial's timed windows.

Out, as files in `ENV_DIR`, read by the parent once the command has ended or been stopped:

- `FIRST_STEP`: made at the end of the first optimizer step (the parent's `--first-step-timeout` watches for it);
- `REPORT` (`report.json`): rank 0's measurements once its window completed — the Profiler's phases and syncs,
  the model, DataLoaders, optimizer and Trainer found, a trial's windows (doctor, tune trials, side-by-side);
- `SUMMARY` (`summary.json`): a whole run's step times and samples (`profile` off: `run -- CMD`'s full run);
- `STATUS` (`status-<pid>.json`): each process's optimizer steps so far;
- `GATE` (`gate.sock`): a gated trial's socket, the parent's; the child connects to say each window's figure and
  to wait for the next (`GATE_*`: `gated.py`);
- `ERRORS` (`error-*.txt`): one line the parent prints as the error (the child could not import saturate, it ran
  backward passes but never a torch.optim step, …).

Both sides import this module and `overrides.py`; this imports nothing of either side.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from saturate.errors import ConfigError
from saturate.script.overrides import Overrides

SHIM = Path(__file__).resolve().parent / "child" / "shim"
ENV_DIR = "SATURATE_SCRIPT_DIR"
ENV_SETTINGS = "SATURATE_SCRIPT_SETTINGS"
FIRST_STEP = "first-step"
REPORT = "report.json"
SUMMARY = "summary.json"
STATUS = "status-{pid}.json"
ERRORS = "error-*.txt"
ERROR = "error-{pid}.txt"  # one process's error line (matches ERRORS)
TRACE_DIR = "trace"  # a doctor run's trace of the steps after the timed ones (doctor/trace.py), one per rank
# A gated trial's socket (`gated.py`, `child/trial_windows.py`): the child says GATE_READY (then, after each window,
# "<steps/s> <steps>") and waits for GATE_GO (one more window) or GATE_STOP.
GATE = "gate.sock"
GATE_READY, GATE_GO, GATE_STOP = "ready", "go", "stop"

Mode = Literal["doctor", "trial", "apply"]
MODES = ("doctor", "trial", "apply")


@dataclass(frozen=True)
class ChildSettings:
    """What the parent tells the child for one run of the command.

    `mode`: "doctor" (measure, then stop), "trial" (a tuning trial or a side-by-side round: the overrides applied,
    the Profiler's window, then `windows`, then stop), "apply" (the whole run with the overrides; no scratch
    folders). `warmup`/`count_steps`/`steps`: the Profiler's warm-up, sync-counted and timed optimizer steps.
    `profile` False: only steps and samples are counted (a full run, `SUMMARY`). `windows`: a trial's timed
    windows after the Profiler — `window_s`, `window_steps` and the fields of `stats.noise.WindowRule` — or None."""

    mode: Mode = "doctor"
    warmup: int = 2
    count_steps: int = 2
    steps: int = 10
    stop: bool = True
    profile: bool = True
    overrides: Overrides = field(default_factory=Overrides)
    windows: Mapping[str, Any] | None = None
    trace_steps: int = 0  # a doctor run: the steps after the timed ones traced into `TRACE_DIR` (0: none)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode {self.mode!r} is not one of {', '.join(MODES)}")
        for name in ("warmup", "count_steps", "steps", "trace_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
        if isinstance(self.overrides, Mapping):  # from JSON
            object.__setattr__(self, "overrides", Overrides.from_dict(self.overrides))
        if self.windows is not None:
            object.__setattr__(self, "windows", dict(self.windows))

    @property
    def needed_steps(self) -> int:
        """Optimizer steps the command must reach for the Profiler's window to complete."""
        return self.warmup + self.count_steps + 2

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "overrides": self.overrides.to_dict()})

    @classmethod
    def from_json(cls, text: str | None) -> ChildSettings:
        """The settings from `ENV_SETTINGS` (the defaults when it is empty); an unknown key is one line naming it."""
        data = json.loads(text or "{}")
        if unknown := sorted(set(data) - {f.name for f in fields(cls)}):
            raise ConfigError(f"unknown child setting(s) {', '.join(unknown)}")
        return cls(**data)


def environment(base: Mapping[str, str], folder: Path, settings: ChildSettings, source: Path) -> dict[str, str]:
    """The command's environment: `base` with the shim and saturate's `source` first on PYTHONPATH, the folder and
    the settings."""
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM), str(source), *filter(None, [env.get("PYTHONPATH")])])
    env[ENV_DIR] = str(folder)
    env[ENV_SETTINGS] = settings.to_json()
    return env


def read_json(folder: Path, name: str) -> dict[str, Any] | None:
    """One of the child's JSON files, or None when it did not write it."""
    path = folder / name
    return json.loads(path.read_text()) if path.exists() else None


def steps_reported(folder: Path) -> int:
    """The most optimizer steps any process of the command reported in its status file."""
    return max((json.loads(p.read_text()).get("optimizer_steps", 0)
                for p in folder.glob(STATUS.format(pid="*"))), default=0)


def child_error(folder: Path) -> str | None:
    """The first error line a child left for the parent to print, or None."""
    errors = sorted(folder.glob(ERRORS))
    return errors[0].read_text().strip() if errors else None
