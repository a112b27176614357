"""Never silent for long (issue 31): engine/live.py's stages, on a terminal and off one, quiet, nested, and the
tuner's trials announced. No timing is asserted: the elapsed seconds are read from the line, not waited for."""

from __future__ import annotations

import io
import json
import re
from types import SimpleNamespace

import pytest
from rich.console import Console

from conftest import TINY, run_saturate
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

    def paired(self, a, b, stage, *, cap_s, min_gain):
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
