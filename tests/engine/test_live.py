"""Never silent for long (issue 31): engine/live.py's stages, on a terminal and off one, quiet, nested, and the
tuner's trials announced. No timing is asserted: the elapsed seconds are read from the line, not waited for."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
from rich.console import Console

from conftest import TINY, cli_env, run_saturate, saturate_cmd
from saturate.engine.live import _SHOWN, Announced, _Line, silenced, stage


def _plain() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=80, highlight=False), out  # a StringIO is no terminal


def test_off_a_terminal_each_stage_prints_one_plain_line_when_it_starts():
    console, out = _plain()
    with stage(console, "probing the machine") as say:
        say("probing the machine: matmul peaks")
    assert out.getvalue().splitlines() == ["probing the machine …", "probing the machine: matmul peaks …"]


def test_nothing_on_a_quiet_console_or_under_silenced():
    quiet = Console(file=io.StringIO(), quiet=True)
    with stage(quiet, "probing the machine") as say:
        say("more")
    assert quiet.file.getvalue() == ""
    console, out = _plain()
    with silenced(), stage(console, "probing the machine"):
        pass
    with silenced(False), stage(None, "no console at all"):
        pass
    with stage(console, "said otherwise off a terminal", plain=False) as say:
        say("nor this")
    assert out.getvalue() == ""


def test_on_a_terminal_the_live_line_shows_the_stage_and_its_seconds_and_nests():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=80)
    with stage(console, "tuning: compile trial") as say:
        line = _SHOWN[console]
        assert re.fullmatch(r"tuning: compile trial \(\d+ s\)", _text(line))
        with stage(console, "inner") as inner:  # rich allows one live display: the same line says it
            assert line.text == "inner" and _SHOWN[console] is line
            inner("inner, later")
            assert line.text == "inner, later"
        assert line.text == "tuning: compile trial"  # the outer stage's own text again
        say("tuning: compile trial, compiling")
        assert line.text == "tuning: compile trial, compiling"
    assert console not in _SHOWN  # the live line is gone
    assert "tuning: compile trial" in out.getvalue()
    long = _text(_Line("tuning: micro-batch: 16×2 fp32 1 thread against 32×1 fp32 1 thread, in alternating windows"))
    assert len(long) <= 80 and re.search(r"… \(\d+ s\)$", long), long  # the seconds stay when the text is cut


def _text(line: object) -> str:
    """The live line as rich draws it, on a console of its own (the live one's output has the spinner too)."""
    console = Console(file=io.StringIO(), width=80)
    console.print(line)
    return console.file.getvalue().strip()


def test_a_stage_ended_by_an_error_leaves_no_live_line():
    console = Console(file=io.StringIO(), force_terminal=True, width=80)
    with pytest.raises(RuntimeError), stage(console, "measuring"):
        raise RuntimeError("stopped")
    assert console not in _SHOWN


class _Measurer:
    memory_kind = "host RSS"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def model_trial(self, plan, stage, **kw):
        self.calls.append(f"model {stage} {kw}")
        return "trial"

    def paired(self, a, b, stage, *, cap_s, min_gain, one_sided=False):
        self.calls.append(f"paired {stage} {cap_s} {min_gain}")
        return "pairs"


def test_the_tuner_s_trials_are_announced_and_the_measurer_is_otherwise_untouched():
    console, out = _plain()
    inner = _Measurer()
    m = Announced(inner, console, lambda plan: f"plan {plan}")
    assert m.model_trial("A", "compile", compile_limit_s=5.0) == "trial"
    pair = m.paired(SimpleNamespace(plan="A"), SimpleNamespace(plan="B"), "threads", cap_s=2.0, min_gain=0.05)
    assert pair == "pairs" and inner.calls == ["model compile {'compile_limit_s': 5.0}", "paired threads 2.0 0.05"]
    m.window_cap_s = 3.0  # what the search sets goes to the measurer itself
    assert inner.window_cap_s == 3.0 and m.memory_kind == "host RSS"
    assert not hasattr(m, "deadline")  # nor does it answer for what the measurer lacks (the search asks)
    assert out.getvalue().splitlines() == ["  tuning: compile trial, plan A …",
                                           "  tuning: threads: plan A against plan B, in alternating windows …"]


@pytest.mark.slow
def test_a_run_off_a_terminal_says_each_long_stage_on_stderr_and_keeps_stdout_json(tmp_path, small_corpus):
    out = run_saturate("run", "gpt-tiny", "--data", str(small_corpus), *TINY, "--effective-batch", "8", "--steps", "4",
                       "--no-compile", "--budget", "20", "--run-dir", str(tmp_path / "run"), "--json", cwd=tmp_path,
                       timeout=600, SATURATE_TESTING_SHORT_TRIALS="1")
    assert out.returncode == 0, out.stderr[-2000:]
    json.loads(out.stdout)  # nothing but the document on stdout
    lines = out.stderr.splitlines()
    for start in ("probing the machine", "preparing the workload", "  tuning: precision trial, ",
                  "Before/after: measuring each plan side by side in "):
        assert any(line.startswith(start) for line in lines), (start, out.stderr[-3000:])
    quiet = run_saturate("-q", "run", "gpt-tiny", "--data", str(small_corpus), *TINY, "--effective-batch", "8",
                         "--steps", "2", "--no-compile", "--budget", "5", "--run-dir", str(tmp_path / "q"), "--json",
                         cwd=tmp_path, timeout=600, SATURATE_TESTING_SHORT_TRIALS="1")
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert not any(" …" in line and line.lstrip().startswith(("probing", "preparing", "tuning:"))
                   for line in quiet.stderr.splitlines()), quiet.stderr[-2000:]


def test_the_cli_s_console_ends_a_live_line_on_a_terminal():
    """The CLI's console (tidy_console: the stream looked up at each write) under a live line, whose rich proxy
    sits in sys.stdout meanwhile: it must write under the proxy, not into it — into it, every redraw looped back
    for ever and every verb hung at its first stage on a terminal (found by bench/newcomer.py, 2026-11-26)."""
    code = textwrap.dedent("""
        import time
        from saturate.engine.console import tidy_console
        from saturate.engine.live import stage
        console = tidy_console(force_terminal=True, width=80)
        with stage(console, "probing the machine"):
            time.sleep(0.5)  # the live line redraws meanwhile
            print("a line printed meanwhile")
            console.print("note: from the console")
        print("after")
    """)
    out = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    for line in ("a line printed meanwhile", "note: from the console", "probing the machine", "after"):
        assert line in out.stdout, out.stdout


def _on_a_pty(cmd: list[str], cwd: os.PathLike, timeout: float) -> tuple[int | None, str]:
    """Run `cmd` on a pseudo-terminal, 80 columns; (its exit code, None if it ran past `timeout`; what it showed)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=cwd, env={**cli_env(), "OMP_NUM_THREADS": "1", "COLUMNS": "80", "TERM": "xterm"},
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the other side closed
                    data = b""
                if not data:
                    break
                chunks.append(data.decode(errors="replace"))
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = None
    finally:
        os.close(master)
    return rc, "".join(chunks)


@pytest.mark.slow
def test_a_run_on_a_terminal_shows_its_live_lines_and_ends(tmp_path, small_corpus):
    """What a person at a terminal sees: `saturate run` on a pseudo-terminal goes through its live stages (probing,
    preparing, the default plan's guard, training's progress) and ends with its summary."""
    rc, shown = _on_a_pty(saturate_cmd("run", "gpt-tiny", "--data", str(small_corpus), *TINY, "--effective-batch",
                                       "8", "--steps", "3", "--no-compile", "--run-dir", str(tmp_path / "run")),
                          tmp_path, timeout=300)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown)
    assert rc == 0, text[-3000:]
    for stage_ in ("probing the machine", "preparing the workload"):  # each live line: its stage and its seconds
        assert re.search(re.escape(stage_) + r"[^\n]*\(\d+ s\)", text), (stage_, text[-3000:])
    assert (tmp_path / "run" / "metrics.jsonl").exists()
