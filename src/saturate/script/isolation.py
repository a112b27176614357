"""Trials that touch nothing: what a doctor run, a tuning trial or a side-by-side round writes never reaches the
user's folders, the next trial, or the full run.

    layers = Layers.of(command, run_folder)      # None where the command runs as it is (SATURATE_ISOLATION=off)
    popen(layers.wrap(command) if layers else command)

Each such run of the command sees the folders it may write to (`folders`: the working folder, and the nearest
existing folder of every path on its command line) through an overlay in a mount namespace of its own
(`child/overlay_exec.py`): it reads them as they are, and what it creates, changes or deletes there lands in a
scratch layer inside saturate's run folder, removed with it. So a script that resumes from a snapshot when one
exists, or a Trainer's `get_last_checkpoint(output_dir)`, sees in every trial exactly what a plain run would see,
and the full run of `run --` (not covered: it is the user's run) starts from the state the user left.

Limits (docs/scripts.md): Linux only (user and mount namespaces; most distributions allow them to
unprivileged users, some containers do not — then saturate says so in one line and trials run in the user's
folders); writes outside the covered folders (the home folder's caches, an absolute path built inside the script
and named on no command line) are not covered; a file the run opens for writing is copied into the scratch layer
first (overlay copy-up), which for a very large file costs its copy.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ENV = "SATURATE_ISOLATION"  # "off": trials run in the user's folders, as before
EXEC = Path(__file__).resolve().parent / "child" / "overlay_exec.py"
# never covered: the system's own folders (an overlay there would change nothing a training script writes)
SYSTEM = ("/proc", "/sys", "/dev", "/run", "/usr", "/etc", "/boot", "/bin", "/sbin", "/lib", "/lib64", "/lib32",
          "/opt/conda/pkgs", "/snap")


def _is_system(path: Path) -> bool:
    text = str(path)
    return text == "/" or any(text == s or text.startswith(s + "/") for s in SYSTEM)


def _nearest_folder(path: Path) -> Path | None:
    for p in (path, *path.parents):
        with contextlib.suppress(OSError):
            if p.is_dir():
                return p
    return None


def folders(command: Sequence[str], cwd: Path | None = None) -> list[Path]:
    """The folders a run of `command` is kept from writing to: the working folder and, for each argument that is a
    path outside it (absolute, or with a `/`; `--flag=value` too), its nearest existing folder; none inside
    another, none of the system's."""
    cwd = (cwd or Path.cwd()).resolve()
    found = [cwd]
    for arg in command[1:]:
        value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
        if not value or value.startswith("-") or "/" not in value:
            continue  # a word, a flag, or a relative name: the latter lies in the working folder
        path = Path(os.path.expanduser(value))
        with contextlib.suppress(OSError, RuntimeError):
            folder = _nearest_folder((path if path.is_absolute() else cwd / path).resolve())
            if folder is not None and not _is_system(folder):
                found.append(folder)
    found = [f for f in found if not _is_system(f)]
    return sorted({f for f in found if not any(f != g and f.is_relative_to(g) for g in found)})


def run_folder(prefix: str, command: Sequence[str] = (), covered: Sequence[Path] | None = None) -> Path:
    """A new temporary folder for one run's results and scratch layers, outside every folder the run is covered
    in (`covered`, default those of `command`: a folder inside one would be hidden by the overlay); the system's
    temporary folder unless that is one."""
    covered = list(covered) if covered is not None else (folders(command) if command else [])
    bases = [Path(tempfile.gettempdir()), Path.home() / ".cache" / "saturate", Path("/dev/shm"), Path("/var/tmp")]
    for base in bases:
        with contextlib.suppress(OSError):
            base = base.resolve()
            if not any(base.is_relative_to(f) for f in covered):
                base.mkdir(parents=True, exist_ok=True)
                return Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    return Path(tempfile.mkdtemp(prefix=prefix))  # everything covered: `Layers.of` then leaves the culprit out


def remove(folder: Path) -> None:
    """Remove a run folder, scratch layers included (an overlay's work folder is created unreadable)."""
    def unlock(func, path, _exc):  # noqa: ANN001 — shutil's onerror signature
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(path), stat.S_IRWXU)
            os.chmod(path, stat.S_IRWXU)
            func(path)
    shutil.rmtree(folder, onerror=unlock)
    shutil.rmtree(folder, ignore_errors=True)


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why runs cannot be covered here (one line), or None when they can: tried once per process on a folder of
    its own — a file written inside must not appear in the folder."""
    if os.environ.get(ENV, "").lower() in ("off", "0", "no", "false"):
        return f"{ENV}=off"
    if not sys.platform.startswith("linux"):
        return "keeping a run's writes in a scratch layer needs Linux (mount namespaces)"
    probe = Path(tempfile.mkdtemp(prefix="saturate-probe-"))
    try:
        (probe / "folder").mkdir()
        layers = Layers([probe / "folder"], probe / "run")
        cmd = layers.wrap([sys.executable, "-S", "-c", "open('written', 'w').write('x')"])
        done = subprocess.run(cmd, cwd=probe / "folder", capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            return (done.stderr.strip().splitlines() or [f"status {done.returncode}"])[-1].removeprefix("saturate: ")
        if (probe / "folder" / "written").exists():
            return "the overlay did not hold the run's writes"
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"trying an overlay: {e}"
    finally:
        remove(probe)


@dataclass
class Layers:
    """The overlays of one run: each covered folder with its upper and work folders inside `root`."""

    covered: list[Path]
    root: Path

    @classmethod
    def of(cls, command: Sequence[str], run_folder: Path) -> Layers | None:
        """The layers for one run of `command` whose results go to `run_folder`; None when runs are not covered
        here (`unavailable()`), which the verbs say once."""
        if unavailable() is not None:
            return None
        covered = [f for f in folders(command) if not run_folder.resolve().is_relative_to(f)]
        if not covered or uncoverable(tuple(covered)) is not None:
            return None
        return cls(covered, run_folder / "layers")

    def wrap(self, command: Sequence[str]) -> list[str]:
        """`command` started through `overlay_exec.py` with this run's overlays."""
        spec = []
        for i, folder in enumerate(self.covered):
            upper, work = self.root / str(i) / "upper", self.root / str(i) / "work"
            upper.mkdir(parents=True, exist_ok=True)
            work.mkdir(parents=True, exist_ok=True)
            spec.append([str(folder), str(upper), str(work)])
        path = self.root / "spec.json"
        path.write_text(json.dumps(spec))
        return [sys.executable, "-S", str(EXEC), str(path), "--", *command]

    def written(self) -> list[Path]:
        """The paths the run created, changed or deleted in the covered folders, as they are named there."""
        layers = []
        for i, folder in enumerate(self.covered):
            layers.append((folder, self.root / str(i) / "upper"))
            with contextlib.suppress(OSError, ValueError):  # mounts inside the folder, each with its own layer
                nested = json.loads((self.root / str(i) / "nested.json").read_text())
                layers += [(Path(n["folder"]), Path(n["upper"])) for n in nested if n["upper"]]
        out = []
        for folder, upper in layers:
            for dirpath, _dirs, files in os.walk(upper):
                out += [folder / Path(dirpath).relative_to(upper) / name for name in files]
        return sorted(out)


@functools.lru_cache(maxsize=8)
def uncoverable(covered: tuple[Path, ...]) -> str | None:
    """Why these folders cannot be covered (an overlay refused over one of them: some network file systems), or
    None: tried once per process and set of folders, so that a trial is never started only to fail there."""
    probe = run_folder("saturate-probe-", covered=covered)
    try:
        done = subprocess.run(Layers(list(covered), probe / "layers").wrap([sys.executable, "-S", "-c", "pass"]),
                              capture_output=True, text=True, timeout=30)
        if done.returncode == 0:
            return None
        return (done.stderr.strip().splitlines() or [f"status {done.returncode}"])[-1].removeprefix("saturate: ")
    except (OSError, subprocess.SubprocessError) as e:
        return f"trying an overlay: {e}"
    finally:
        remove(probe)


def notice(command: Sequence[str]) -> str:
    """One line for the verbs' header: where the runs' writes go."""
    reason = unavailable() or uncoverable(tuple(folders(command)))
    if reason is not None:
        return (f"trials are not isolated here ({reason}): what the script writes during them lands in your folders")
    shown = ", ".join(str(f) for f in folders(command)[:3])
    return f"trials write to a scratch layer over {shown}: your files are left as they were"
