"""The process's end (cli/quick_exit): exit handlers run, every buffer reaches its pipe, the code is kept, and a
thread that is not a daemon is waited for."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})


def test_handlers_run_and_every_buffer_is_flushed(tmp_path: Path) -> None:
    out = _python("""
        import atexit, ctypes, sys
        from pathlib import Path
        from saturate.cli.quick_exit import exit_now
        atexit.register(lambda: Path("handler-ran").write_text("yes"))
        print("x" * 200_000)                      # Python's buffer, larger than a pipe's
        print("to stderr", file=sys.stderr)
        libc = ctypes.CDLL(None)
        libc.printf(b"from C\\n")                  # C's stdio buffer (fully buffered on a pipe)
        exit_now(3)
        print("never")
    """, tmp_path)
    assert out.returncode == 3
    assert out.stdout.startswith("x" * 200_000)
    assert "from C" in out.stdout and "never" not in out.stdout
    assert "to stderr" in out.stderr
    assert (tmp_path / "handler-ran").read_text() == "yes"


def test_a_running_thread_is_waited_for(tmp_path: Path) -> None:
    out = _python("""
        import threading, time
        from pathlib import Path
        from saturate.cli.quick_exit import exit_now
        def late():
            time.sleep(0.5)
            Path("thread-done").write_text("yes")
        threading.Thread(target=late).start()
        exit_now(None)
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "thread-done").read_text() == "yes"


def test_python_m_saturate_keeps_mains_exit_code(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "saturate", "train", "--preset", "no-such-preset", "--steps", "1"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin",
                              "SATURATE_CACHE": str(tmp_path / "cache")})
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].startswith("saturate: ")
