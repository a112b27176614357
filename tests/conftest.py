from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
# gpt-tiny shrunk to ~20 K parameters (one block, 32 wide, 32-token windows): for tests of a flow, not of the model,
# where every step of the 3 M-parameter preset would cost ~0.1-0.5 s on a 2-core CPU.
TINY = ("--param", "n_layer=1", "--param", "n_embd=32", "--param", "n_head=2", "--param", "seq_len=32")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path,
                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Token caches go to a per-session temp folder, never ~/.cache; in this process each test sees only
    the tuned plans it cached itself (a command run in a subprocess shares the session's)."""
    from saturate import plan_cache as cache

    monkeypatch.setenv("SATURATE_CACHE", str(tmp_path_factory.getbasetemp() / "saturate-cache"))
    monkeypatch.setattr(cache, "plans_dir", lambda: tmp_path / "plans")


@pytest.fixture(scope="session")
def cpu():
    """This machine's CPU as saturate sees it (matmul peaks not measured: tests do not need them)."""
    from saturate.hardware import probe

    return probe(measure_peaks=False, device="cpu")


@pytest.fixture
def short_doctor(monkeypatch: pytest.MonkeyPatch) -> None:
    """`saturate doctor` on a preset, in this process, timed briefly: at least 0.6 s, capped as the testing knob
    caps a trial (`stats/noise.default_rule()`), instead of up to 8 s (16 busy). For tests of the command's flow,
    not of its figures; the doctor's windows and verdicts are tested on their own (tests/doctor)."""
    import functools

    from saturate.doctor import diagnose as run
    from saturate.stats.noise import SHORT_TRIALS_ENV, default_rule

    monkeypatch.setenv(SHORT_TRIALS_ENV, "1")
    monkeypatch.setattr(run, "DoctorConfig", functools.partial(run.DoctorConfig, min_seconds=0.6, rule=default_rule()))


def run_main(capsys: pytest.CaptureFixture, *argv: str) -> subprocess.CompletedProcess:
    """`saturate ARGV` through `cli.main` in this process, as `python -m saturate` would exit (argparse's
    SystemExit included), with what it printed."""
    from saturate.cli import main

    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["saturate", *argv], code, out, err)


def make_small_corpus(parent: Path) -> Path:
    """~100 KB of real text (two standard-library modules), enough for many 129-token windows."""
    folder = parent / "corpus"
    folder.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "difflib.py"):
        (folder / name).write_text((stdlib / name).read_text())
    return folder


@pytest.fixture
def small_corpus(tmp_path: Path) -> Path:
    return make_small_corpus(tmp_path)


class SmallDisk:
    """A folder on a real small filesystem (a tmpfs of a few MiB) that `fill()` fills to the last few KiB,
    so the next large write fails with the kernel's own ENOSPC.

    Where no tmpfs can be mounted (not root), writes go to /dev/full instead once `fill()` is called:
    every file saturate writes atomically (its temporary) is then a link to /dev/full, whose writes the
    kernel fails with ENOSPC, and `full_file(name)` gives such a link for a file written in place.
    """

    def __init__(self, folder: Path, mounted: bool, monkeypatch: pytest.MonkeyPatch) -> None:
        self.folder, self.mounted, self._monkeypatch = folder, mounted, monkeypatch

    def fill(self, leave: int = 16 * 1024) -> None:
        if not self.mounted:
            from saturate import atomic

            real = atomic.temporary_name

            def to_dev_full(path: Path) -> Path:
                tmp = real(path)
                if Path(path).resolve().is_relative_to(self.folder.resolve()):
                    tmp.symlink_to("/dev/full")
                return tmp

            self._monkeypatch.setattr(atomic, "temporary_name", to_dev_full)
            return
        import shutil

        filler = self.folder / ".filler"
        free = shutil.disk_usage(self.folder).free
        with open(filler, "ab") as f:
            f.truncate(0)
            chunk = b"\0" * 65536
            try:
                while free - f.tell() > leave:
                    f.write(chunk[: max(4096, min(65536, free - f.tell() - leave))])
                    f.flush()
            except OSError:
                pass
        os.sync()

    def full_file(self, name: str) -> Path:
        """A path in the folder whose writes fail with ENOSPC once filled (for files not written atomically)."""
        path = self.folder / name
        if not self.mounted:
            path.symlink_to("/dev/full")
        return path


@pytest.fixture
def small_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SmallDisk]:
    """8 MiB of real filesystem; see SmallDisk."""
    import subprocess

    folder = tmp_path / "small-disk"
    folder.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(folder)], capture_output=True).returncode == 0
    try:
        yield SmallDisk(folder, mounted, monkeypatch)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def cli_env() -> dict[str, str]:
    """Environment for running `python -m saturate` in a subprocess against this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def saturate_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "saturate", *args]


def run_saturate(*args: str, cwd: Path, timeout: float = 400, **env: str) -> subprocess.CompletedProcess:
    """`python -m saturate ARGS` in `cwd`, one thread (a toy model on a shared 2-core machine: threads
    only contend) and 200 columns (rich wraps at 80 off a terminal), plus `env`."""
    full = cli_env()
    full.update(OMP_NUM_THREADS="1", COLUMNS="200", **env)
    return subprocess.run(saturate_cmd(*args), env=full, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def line_of(path: Path, text: str) -> str:
    """`name.py:LINE` of the first line of `path` containing `text`."""
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if text in line:
            return f"{path.name}:{i}"
    raise AssertionError(f"{text!r} not in {path}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests run where torch sees a CUDA/ROCm device and are skipped (not dropped) elsewhere."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA or ROCm device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# --- Ctrl-C reaches the commands the tests start ----------------------------------------------------------------
# A child process inherits an ignored or blocked SIGINT, and Python then leaves it so: every later test that presses
# Ctrl-C on a `saturate` command would wait in vain (two did, in full runs on 2026-11-23, never alone). So after each
# test SIGINT is checked at the C level (Linux: /proc/self/status, which Python's signal.getsignal cannot see past),
# restored when something ignored or blocked it, and the test that did it is named at the end of the session.
_SIGINT_BIT = 1 << (2 - 1)  # signal 2, bit 1 of the masks
_sigint_changed_by: list[str] = []


def _sigint_masks() -> tuple[int, int] | None:
    """(ignored, blocked) bits for SIGINT in this process's main thread; None where /proc cannot say."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return int(fields["SigIgn"], 16) & _SIGINT_BIT, int(fields["SigBlk"], 16) & _SIGINT_BIT
    except (OSError, KeyError, ValueError):
        return None


def _check_sigint(item: pytest.Item, when: str) -> None:
    """Restore SIGINT when something ignored or blocked it, and record the test, the phase and what the other threads
    were doing then (a C `system()` in another thread ignores SIGINT while its child runs: the suspect)."""
    import signal
    import threading
    import traceback

    masks = _sigint_masks()
    if masks is None or not any(masks) or threading.current_thread() is not threading.main_thread():
        return
    names = {t.ident: t.name for t in threading.enumerate()}
    others = [f"{names.get(ident, ident)} at " + " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}"
                                                         for f in reversed(traceback.extract_stack(frame)[-3:]))
              for ident, frame in sys._current_frames().items() if ident != threading.main_thread().ident]
    _sigint_changed_by.append(f"{item.nodeid} ({when}): SIGINT {'ignored' if masks[0] else ''}"
                              f"{' and ' if all(masks) else ''}{'blocked' if masks[1] else ''}"
                              + (f"; other threads: {'; '.join(others)}" if others else "; no other thread"))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    yield
    _check_sigint(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    yield
    _check_sigint(item, "call")


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    _check_sigint(item, "teardown")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _sigint_changed_by:
        terminalreporter.section("SIGINT left ignored or blocked (restored after each)")
        for line in _sigint_changed_by:
            terminalreporter.write_line(line)
