"""Where the runs of a user's command put what is not the user's: the trial logs (`trial_logs`: one folder per
saturate process, the older ones pruned), a doctor run's trace (`doctor_folder`) and the temporary files of a run
saturate stops (`scratch_tmp`).
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from saturate.errors import ConfigError, file_not_folder

ENV_TRIAL_LOGS = "SATURATE_TRIAL_LOGS"  # where trials' own output goes (default: a fresh temporary folder)
TRIALS_PREFIX = "saturate-trials-"
DOCTOR_PREFIX = "saturate-doctor-"  # a doctor run's trace folder (doctor_folder)
KEEP_TRIAL_LOGS = 10  # the temporary trial-log folders kept: this run's and the newest earlier ones

# a Unix socket's path is at most 107 bytes (sun_path, Linux): a DataLoader worker shares a tensor through a listener
# socket in `$TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX`, and one whose path is longer fails, leaving the loader hung
SOCKET_PATH_MAX = 108
PYMP_LISTENER = "/pymp-XXXXXXXX/listener-XXXXXXXX"

_made: dict[str, Path] = {}


def trial_logs() -> Path:
    """The folder of the trial logs: `SATURATE_TRIAL_LOGS`, or else one fresh `saturate-trials-…` folder in the
    system's temporary folder for this saturate process, made when first asked (older ones are pruned)."""
    given = os.environ.get(ENV_TRIAL_LOGS, "")
    if given not in _made:
        _made[given] = Path(given) if given else Path(tempfile.mkdtemp(prefix=TRIALS_PREFIX))
        if not given:
            prune_trial_logs(_made[given].parent, keep=_made[given])
    _made[given].mkdir(parents=True, exist_ok=True)
    return _made[given]


def doctor_folder(given: Path | None) -> Path:
    """Where a doctor run's trace goes (doctor/trace.py): `given`, else a fresh `saturate-doctor-…` folder in the
    system's temporary folder — not the working folder, which a doctor run leaves as it was —, the older ones pruned
    as the trial logs are (the newest `KEEP_TRIAL_LOGS`, idle for an hour)."""
    if given is not None:
        if (why := file_not_folder(given, "trace folder", "--trace-dir")) is not None:
            raise ConfigError(why)
        return Path(given)
    # named, not made: the trace makes it when written, so a doctor run that fails before leaves no empty folder
    made = Path(tempfile.gettempdir()) / f"{DOCTOR_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    prune_trial_logs(made.parent, keep=made, prefix=DOCTOR_PREFIX)
    return made


def prune_trial_logs(folder: Path, keep: Path, newest: int = KEEP_TRIAL_LOGS, idle_s: float = 3600.0,
                     prefix: str = TRIALS_PREFIX) -> list[Path]:
    """Remove this user's `saturate-trials-…` folders in `folder` beyond the `newest` few, those untouched for
    `idle_s` only (another saturate may still be writing to a recent one); `keep` is never removed. Returns what
    was removed. The folders a user asked for (`SATURATE_TRIAL_LOGS`) are never pruned."""
    found = []
    for path in folder.glob(prefix + "*"):
        with contextlib.suppress(OSError):
            if path != keep and path.is_dir() and not path.is_symlink() and path.stat().st_uid == os.getuid():
                found.append((max([path.stat().st_mtime, *(f.stat().st_mtime for f in path.iterdir())]), path))
    found.sort(reverse=True)
    removed = []
    for touched, path in found[max(newest - 1, 0):]:
        if time.time() - touched >= idle_s:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def scratch_tmp(folder: Path, env: Mapping[str, str]) -> dict[str, str]:
    """The variables that send a stopped run's temporary files into `folder/tmp`, removed with the run folder.

    A trial, a doctor run or a side-by-side round is stopped mid-run, so nothing of its processes' own clean-up
    at exit runs: each DataLoader worker that passed a tensor leaves multiprocessing's `pymp-*` listener folder in
    the temporary folder (100 after one tune of a 10-worker script). torch.compile's cache stays where it was
    (`TORCHINDUCTOR_CACHE_DIR`, by default under the temporary folder), so trials still reuse compiled kernels."""
    scratch = folder / "tmp"
    if len(str(scratch)) + len(PYMP_LISTENER) >= SOCKET_PATH_MAX:  # a worker could not share a tensor from there
        return {}
    scratch.mkdir(exist_ok=True)
    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())  # as torch._inductor's default_cache_dir() names it
    inductor = env.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    return {"TMPDIR": str(scratch), "TORCHINDUCTOR_CACHE_DIR": inductor}
