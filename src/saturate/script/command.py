"""Running a user's command unchanged with saturate's hooks in every Python process it starts.

    run_instrumented(["python", "train.py", "--config", "medium"], settings) -> ScriptRun

The command runs as it would without saturate (its own stdout, its own working folder), with one
folder put first on PYTHONPATH whose `sitecustomize.py` loads `child/hooks.py` once torch is imported;
settings (`ChildSettings`) travel in the environment, results come back as files in a temporary folder —
what crosses, both ways, is `boundary.py`. The command
runs in a process group of its own so that saturate can stop all of it (launcher, ranks, loader
workers) on Ctrl-C, at a time limit, or once it has what it measured. A tuning trial's or a side-by-side
round's own output (stdout and stderr) goes to a log file of its own in `trial_logs()`, not to the terminal:
a Trainer script prints its arguments, its model's config and its progress bar in every one of them; its
last lines are kept for an error message, which names the file. A doctor run and the full run print theirs.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from saturate.engine.host_alloc import child_env
from saturate.errors import ConfigError, SaturateError
from saturate.policy import POLICY
from saturate.script.boundary import (
    FIRST_STEP,
    REPORT,
    SUMMARY,
    TRACE_DIR,
    ChildSettings,
    child_error,
    environment,
    read_json,
    steps_reported,
)
from saturate.script.isolation import Layers, remove, run_folder
from saturate.script.scratch import scratch_tmp, trial_logs

SOURCE = Path(__file__).resolve().parents[2]  # the folder holding this saturate package: first for the child too
# how torch's out-of-memory errors read in a script's stderr (CUDA's, the CPU allocator's, ROCm's): the one place
# a failure's kind is read from text, the script's own, so that no decision parses saturate's messages
OOM_MARKERS = ("OutOfMemoryError", "out of memory", "DefaultCPUAllocator: can't allocate memory")
LAUNCHERS = ("torchrun", "accelerate", "deepspeed")
USAGE = "python SCRIPT …, python -m MODULE …, torchrun …, accelerate launch …"


class ScriptFailed(SaturateError):
    """The command failed or ended before saturate had its measurements; `out_of_memory` when the script's last
    error lines were torch's out-of-memory error."""

    def __init__(self, message: str, out_of_memory: bool = False, timed_out: bool = False) -> None:
        super().__init__(message)
        self.out_of_memory, self.timed_out = out_of_memory, timed_out  # timed_out: stopped at its time limit


class NotTunable(SaturateError):
    """The script as written could not be measured (its first trial failed, or its hooks saw no optimizer step):
    there is nothing to compare a setting against."""


def ran_out_of_memory(lines: Sequence[str]) -> bool:
    """Whether a script's last stderr lines hold torch's out-of-memory error."""
    return any(marker in line for line in lines[-10:] for marker in OOM_MARKERS)


@dataclass
class ScriptRun:
    """What came back from one instrumented run of a command."""

    command: list[str]
    returncode: int
    report: dict[str, Any] | None  # rank 0's measurements, when its window completed
    summary: dict[str, Any] | None  # a whole run's step times and samples (settings["profile"] False)
    optimizer_steps: int  # the most any process reported (a status or the report)
    seconds: float
    stderr_tail: list[str] = field(default_factory=list)
    # where its writes went: the files it created or changed in the user's folders, kept in a scratch layer
    # (isolation.py) and removed; None when the run was not covered (the full run, or isolation unavailable)
    written: list[str] | None = None
    log: str | None = None  # where its own output went (a trial or a round), else None: it was printed
    counted: bool = True  # False: run without the hooks (`run_plain`), its optimizer steps not counted


_numbers = itertools.count(1)


def check_command(command: Sequence[str]) -> list[str]:
    """The command as given, refused in one line when it is missing, not found, or not Python."""
    if not command:
        raise ConfigError(f"no command after `--`; give the training command as you run it ({USAGE})")
    exe = shutil.which(command[0])
    if exe is None:
        raise ConfigError(f"command not found: {command[0]}")
    name = os.path.basename(exe)
    if name.startswith("python") or name in LAUNCHERS:
        return list(command)
    try:
        with open(exe, "rb") as f:
            first = f.readline(200)
    except OSError:
        first = b""
    if first.startswith(b"#!") and b"python" in first:  # a Python entry point (a console script)
        return list(command)
    raise ConfigError(f"{command[0]} is not a Python command; saturate instruments Python training ({USAGE})")


def run_instrumented(command: Sequence[str], settings: ChildSettings, *,
                     first_step_timeout: float = POLICY.windows.first_step_timeout_s,
                     timeout: float | None = None, quiet_stdout: bool = False,
                     trace_to: Path | None = None) -> ScriptRun:
    """Run `command` with the hooks; wait until it ends (or is stopped); return what it measured; the trace a
    doctor run took (`settings.trace_steps`) moved into `trace_to`.

    The script's stdout is the terminal's, or with `quiet_stdout` goes to stderr (saturate's own stdout
    then carries one JSON document).

    Raises SaturateError in one line when no optimizer step came within `first_step_timeout`
    seconds, or when the script failed or ended before its first optimizer step.
    """
    cmd = check_command(command)
    folder = run_folder("saturate-script-", cmd)
    try:
        run = _run(cmd, settings, folder, first_step_timeout, timeout, quiet_stdout)
        if trace_to is not None and (folder / TRACE_DIR).is_dir():
            trace_to.mkdir(parents=True, exist_ok=True)
            for f in (folder / TRACE_DIR).iterdir():
                shutil.move(f, trace_to / f.name)
        return run
    finally:
        remove(folder)


def _env(folder: Path, settings: ChildSettings) -> dict[str, str]:
    env = environment(os.environ, folder, settings, SOURCE)
    env.setdefault("PYTHONUNBUFFERED", "1")  # the script's lines reach the terminal as they are printed
    if settings.mode != "apply":  # a run saturate stops: its temporary files go with its run folder
        env.update(scratch_tmp(folder, env))
    if settings.overrides.host_alloc:  # read by glibc as the process starts: only the environment can set them
        env.update(child_env(env))
    return env


# The reaper: a small process, outside the command's process group, that kills the whole group once saturate is gone
# (killed by a signal it cannot catch: kill -9, the OOM killer), so no trial, doctor run or round of the script lives
# on as an orphan — nor one parked with SIGSTOP (`gated.py`), which nothing else would ever wake. Its parent's death
# is seen as a change of its parent pid; it exits by itself once the group has ended.
REAPER = """
import os, signal, sys, time
parent, group = int(sys.argv[1]), int(sys.argv[2])
signal.signal(signal.SIGINT, signal.SIG_IGN)
while os.getppid() == parent:
    time.sleep(0.2)
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        sys.exit(0)
    except PermissionError:
        pass
try:
    os.killpg(group, signal.SIGKILL)
except (ProcessLookupError, PermissionError):
    pass
"""


def _reaper(group: int) -> subprocess.Popen:
    """The reaper of the process group `group` (REAPER), started."""
    return subprocess.Popen([sys.executable, "-S", "-c", REAPER, str(os.getpid()), str(group)],
                            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def run_plain(command: Sequence[str], *, quiet_stdout: bool = False) -> ScriptRun:
    """The command as written, without saturate's hooks (`run -- CMD` when it cannot tune it): its own output, its
    exit code and its time; nothing counted (`ScriptRun.counted` False). Ctrl-C reaches it as a trial's does: SIGINT
    to its whole process group, then SIGTERM and SIGKILL a few seconds apart; a reaper ends it if saturate dies."""
    cmd = check_command(command)
    sys.stdout.flush()
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=sys.stderr.fileno() if quiet_stdout else None, start_new_session=True)
    reaper = _reaper(proc.pid)
    try:
        proc.wait()
    finally:
        _stop(proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            reaper.wait(timeout=1)
    return ScriptRun(cmd, proc.returncode, None, None, 0, time.monotonic() - started, counted=False)


class Child:
    """One instrumented run of the command, started and watched: `start()`, then `alive()`/`check()` while it
    runs, `stop()` to end all of it, `result()` for what it measured. `run_instrumented` is the blocking use;
    `gated.py` keeps two alive at once."""

    def __init__(self, cmd: list[str], settings: ChildSettings, folder: Path, quiet_stdout: bool = False) -> None:
        self.cmd, self.settings, self.folder, self.quiet_stdout = cmd, settings, folder, quiet_stdout
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.proc: subprocess.Popen | None = None
        self._reaper: subprocess.Popen | None = None
        self.layers: Layers | None = None
        self._echo: threading.Thread | None = None
        self.log: Path | None = None
        self.started = 0.0
        self.seconds = 0.0

    def start(self) -> Child:
        self.started = time.monotonic()
        sys.stdout.flush()
        # a doctor run, a trial or a round writes to scratch layers over the user's folders (isolation.py); the
        # full run of `run --` ("apply") is the user's own run
        self.layers = Layers.of(self.cmd, self.folder) if self.settings.mode != "apply" else None
        cmd = self.layers.wrap(self.cmd) if self.layers is not None else self.cmd
        stdout: Any = sys.stderr.fileno() if self.quiet_stdout else None
        stderr: Any = subprocess.PIPE
        sink = None
        if self.settings.mode == "trial":  # both of its streams, in order, through one pipe to its log
            self.log = trial_logs() / f"{next(_numbers):03d}.log"
            sink = open(self.log, "w", errors="replace")  # noqa: SIM115 (closed by the echo)
            read, stdout = os.pipe()
            stderr = stdout
        try:
            self.proc = subprocess.Popen(cmd, env=_env(self.folder, self.settings), stderr=stderr,
                                         start_new_session=True, stdout=stdout)
        except BaseException:
            if sink is not None:  # not started: nothing will read the pipe or close the log
                sink.close()
                os.close(read)
            raise
        finally:
            if sink is not None:
                os.close(stdout)
        if sink is not None:
            self.proc.stderr = os.fdopen(read, "rb")
        self._reaper = _reaper(self.proc.pid)
        self._echo = threading.Thread(target=_echo, args=(self.proc.stderr, self.tail, sink), daemon=True)
        self._echo.start()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check(self, first_step_timeout: float, timeout: float | None = None) -> None:
        """Raise SaturateError (stopping the command) when no optimizer step came within `first_step_timeout`
        seconds, or it ran past `timeout`."""
        waited = time.monotonic() - self.started
        if not (self.folder / FIRST_STEP).exists() and waited > first_step_timeout:
            self.stop()
            raise SaturateError(f"no optimizer step within {first_step_timeout:g} s (--first-step-timeout); "
                                "the script was stopped. saturate times optimizer steps (torch.optim): does "
                                f"the script reach one?{self.its_output()}")
        if timeout is not None and waited > timeout:
            self.stop()
            raise ScriptFailed(f"the script did not finish its measured steps within {timeout:.0f} s; "
                               f"it was stopped{self.its_output()}", timed_out=True)

    def its_output(self) -> str:
        """Where a trial's own output went, for its error message: what printing it would have shown."""
        return f" (its output: {self.log})" if self.log is not None else ""

    def signal(self, sig: int) -> None:
        """Send `sig` to the command's whole process group (its loader workers too)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def stop(self) -> None:
        """End the command's whole process group (launcher, ranks, loader workers), parked or not."""
        if self.proc is None:
            return
        if self.seconds == 0.0:
            self.seconds = time.monotonic() - self.started
        self.signal(signal.SIGCONT)  # a parked group must run to take SIGINT's handler
        _stop(self.proc)
        if self._echo is not None:
            self._echo.join(timeout=5)
        if self._reaper is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._reaper.wait(timeout=1)  # it ends once the group has

    def wait(self, first_step_timeout: float, timeout: float | None = None) -> None:
        """Until the command ends (or is stopped at a limit, or by Ctrl-C)."""
        try:
            while self.alive():
                self.check(first_step_timeout, timeout)
                time.sleep(0.1)
            self.seconds = time.monotonic() - self.started
        finally:
            self.stop()

    def result(self) -> ScriptRun:
        """What the ended command measured; the child's own error line, or ScriptFailed without a report."""
        assert self.proc is not None
        if error := child_error(self.folder):
            raise ConfigError(error)
        folder, settings = self.folder, self.settings
        report, summary = read_json(folder, REPORT), read_json(folder, SUMMARY)
        steps = max([r["optimizer_steps"] for r in (report, summary) if r] + [steps_reported(folder)])
        written = None
        if self.layers is not None:
            written = [os.path.relpath(p) if p.is_relative_to(Path.cwd()) else str(p) for p in self.layers.written()]
        run = ScriptRun(self.cmd, self.proc.returncode, report, summary, steps, self.seconds, list(self.tail),
                        written, str(self.log) if self.log is not None else None)
        if (settings.profile and report is None) or (not settings.profile and summary is None):
            raise ScriptFailed(_why_no_report(run, settings.needed_steps if settings.profile else 2)
                               + self.its_output(),
                               out_of_memory=bool(run.returncode) and ran_out_of_memory(run.stderr_tail))
        return run


def _run(cmd: list[str], settings: ChildSettings, folder: Path, first_step_timeout: float,
         timeout: float | None, quiet_stdout: bool) -> ScriptRun:
    child = Child(cmd, settings, folder, quiet_stdout).start()
    child.wait(first_step_timeout, timeout)
    return child.result()


def _why_no_report(run: ScriptRun, needed: int) -> str:
    last = next((line.strip() for line in reversed(run.stderr_tail) if line.strip()), "")
    failed = f" (exit code {run.returncode}{': ' + last[:200] if last else ''})" if run.returncode else ""
    if run.optimizer_steps == 0:
        if run.returncode:
            return f"the script failed before its first optimizer step{failed}"
        return ("the script ended without an optimizer step (exit code 0); saturate times the steps of a "
                "torch.optim optimizer")
    return (f"the script ended after {run.optimizer_steps} optimizer step(s){failed}, before the doctor's "
            f"window of {needed}; run it for longer or lower --warmup/--steps")


def _echo(stream: Any, tail: collections.deque[str], sink: Any = None) -> None:
    """Copy the script's stderr to ours (or to `sink`, a trial's log, closed at the end) as it comes, keeping
    its last lines for an error message. A last line without its newline (a progress bar's `\r` updates, cut
    off when the script was stopped) gets one, so what saturate prints next starts on a line of its own."""
    out = sink if sink is not None else sys.stderr
    line = ""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        tail.append(line)
        with contextlib.suppress(OSError, ValueError):
            out.write(line)
            out.flush()
    if line and not line.endswith("\n"):
        with contextlib.suppress(OSError, ValueError):
            out.write("\n")
            out.flush()
    if sink is not None:
        sink.close()


def _stop(proc: subprocess.Popen) -> None:
    """End the command's whole process group: SIGINT (a script's own Ctrl-C handling), then SIGTERM,
    then SIGKILL, a few seconds apart. Once the command itself has ended (a trial's script exits at once when
    it is timed), what is left of its group — DataLoader workers on their way out — starts at SIGTERM: a SIGINT
    would interrupt each worker's exit and print its KeyboardInterrupt traceback amid the user's output."""
    for sig, wait in ((signal.SIGINT, 3.0), (signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
        if not _group_alive(proc.pid):
            break
        if sig == signal.SIGINT and proc.poll() is not None:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _group_alive(proc.pid):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.05)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=1)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(0) succeeds while any member lives, zombies included; our own child is reaped by wait()
    import psutil

    for p in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error, OSError):  # a process that ended since the listing (os.getpgid)
            if os.getpgid(p.info["pid"]) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                return True
    return False
