"""The README and the task pages under docs/ as a reader meets them: every ```python block runs as written, at
tiny sizes; every `saturate …` command (in ```bash blocks, `$ `-prompted lines of ```text blocks, and inline
`code`) is parsed by saturate's own parser, so a renamed or removed option, verb, preset or reference plan fails
here; every ```toml plan loads; every relative link leads to a file and heading that exist; and the README stays short.

Python blocks run in a scratch folder with saturate's presets shrunk (one layer, a few steps), `probe()` not
measuring peaks and the tuner's trials shortened. A block that is a fragment of the reader's own code gets the
names it uses (`model`, `loader`, …) from a prelude below; a block that needs a whole Transformers script is
listed as covered elsewhere. Commands that answer in a second (`env`, `probe --no-peaks`, `monitor --once`,
`--version`) are run for real; the rest are parsed: those that train for minutes, need a GPU, torchrun or the
reader's own script are run for real by the tests of their verbs (tests/cli, tests/script, tests/run, …).
benchmarks.md and architecture.md are records and a design note, not instructions, and are left out.
"""

from __future__ import annotations

import functools
import re
import shlex
import shutil
from pathlib import Path

import pytest

import saturate
from saturate.tune import api, measure

ROOT = Path(__file__).resolve().parents[1]
NOT_INSTRUCTIONS = {"benchmarks.md", "architecture.md"}
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in NOT_INSTRUCTIONS)]
README_MAX_LINES = 260
LINE_MAX = 110
# The README's two set-up commands, word for word (.ci/run runs the second as it is).
SETUP = ("bash scripts/setup.sh && python3 -m saturate run", "bash scripts/setup.sh --dev && python3 -m pytest -q")

FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", flags=re.S | re.M)


def rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def fenced(page: Path) -> list[tuple[str, str]]:
    """(language, body) of every fenced block of `page`."""
    return FENCE.findall(page.read_text())


def prose(page: Path) -> str:
    """`page` without its fenced blocks."""
    return FENCE.sub("", page.read_text())


BLOCKS = [(rel(p), i, body) for p in PAGES for i, body in enumerate(b for lang, b in fenced(p) if lang == "python")]

# --- Python blocks ---------------------------------------------------------------------------------------------

# Names a fragment uses from the reader's own program.
LOOP_PRELUDE = """
import torch
import torch.nn.functional as F
dev = "cpu"
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader([(torch.randn(8), i % 4) for i in range(256)], batch_size=8)
"""
PRELUDES = {"prof.data(loader)": LOOP_PRELUDE}
ELSEWHERE = {"SaturateCallback()": "tests/integrations/test_transformers_callback.py (needs a Trainer)"}


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    """A scratch folder holding what the pages' paths name, and saturate shrunk to seconds (a tuning: 8 s)."""
    (tmp_path / "notes").mkdir()
    for name in ("textwrap.py", "difflib.py"):
        shutil.copy(Path(functools.__file__).with_name(name), tmp_path / "notes" / name)
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    real_build, real_probe, real_custom = saturate.build_workload, saturate.probe, saturate.custom_workload
    real_tune = saturate.tune
    monkeypatch.setattr(saturate, "tune", lambda *a, **kw: real_tune(*a, **{**kw, "try_compile": False,
                                                                         "budget_s": 8}))
    shape = {"n_layer": 1, "n_head": 2, "n_embd": 32, "seq_len": 32, "effective_batch": 4, "steps": 2}
    monkeypatch.setattr(saturate, "build_workload", lambda *a, **kw: real_build(*a, **{**kw, **shape}))
    monkeypatch.setattr(saturate, "probe", lambda *a, **kw: real_probe(measure_peaks=False, device="cpu"))
    monkeypatch.setattr(saturate, "custom_workload", lambda *a, **kw: real_custom(*a, **{**kw, "steps": 2}))
    monkeypatch.setattr(api, "RealMeasurer", functools.partial(measure.RealMeasurer, min_seconds=0.05, min_steps=1,
                                                               max_steps=2))


def test_the_readme_has_python_blocks():
    assert sum(page == "README.md" for page, _, _ in BLOCKS) >= 1
    assert len(BLOCKS) >= 4


@pytest.mark.slow
@pytest.mark.parametrize(("page", "index", "code"), BLOCKS, ids=[f"{p}-{i + 1}" for p, i, _ in BLOCKS])
def test_a_python_block_runs_as_written(page, index, code, tiny, capsys):
    if skip := next((why for marker, why in ELSEWHERE.items() if marker in code), None):
        pytest.skip(f"covered by {skip}")
    prelude = next((p for marker, p in PRELUDES.items() if marker in code), "")
    namespace: dict = {"__name__": "readme"}
    exec(compile(prelude + code, f"{page} python block {index + 1}", "exec"), namespace)
    if "def workload(" in code:  # a workload definition: it must build, and train a step
        from saturate import RunConfig, train

        w = namespace["workload"]()
        result = train(w, None, RunConfig(run_dir=Path("runs/readme"), steps=1, progress=False, tensorboard=False))
        assert result.steps == 1


TOML = [(rel(p), body) for p in PAGES for lang, body in fenced(p) if lang == "toml"]


@pytest.mark.parametrize(("page", "text"), TOML, ids=[p for p, _ in TOML])
def test_a_plan_file_shown_is_one_saturate_loads(page, text, tmp_path):
    from saturate import Plan

    (tmp_path / "plan.toml").write_text(text)
    Plan.load(tmp_path / "plan.toml")

# --- commands -------------------------------------------------------------------------------------------------

_COMMAND = re.compile(r"^(?:saturate(?=\s|$)|python3? -m saturate(?=\s|$)|.*\btorchrun\b.*\s-m saturate(?=\s|$))")
_INLINE = re.compile(r"`((?:saturate|python3 -m saturate|torchrun [^`]*-m saturate) [^`]*|saturate)`")
# Shell variables of the SLURM recipes, as a job would set them.
_SHELL = {"RESUME": "--resume"}


def _logical_lines(body: str) -> list[str]:
    return body.replace("\\\n", " ").splitlines()


def commands(page: Path) -> list[str]:
    """Every saturate command `page` gives the reader."""
    found = []
    for lang, body in fenced(page):
        for line in _logical_lines(body):
            line = line.strip()
            if lang in ("bash", "sh", "shell"):
                parts = line.split(" && ")  # `bash scripts/setup.sh && python3 -m saturate run`
            elif line.startswith("$ "):
                parts = [line[2:]]
            else:  # printed output: a line starting "saturate tune gpt-tiny on …" is not a command
                continue
            found += [part for part in (re.sub(r"^(srun|\$)\s+", "", p.strip()) for p in parts) if _COMMAND.match(part)]
    text = re.sub(r"^#.*$", "", prose(page), flags=re.M)  # a heading names a verb: `saturate sweep`
    found += [m.group(1) for m in _INLINE.finditer(text.replace("\n", " "))]
    return found


def saturate_argv(command: str) -> list[str]:
    """The arguments the command gives saturate (after `saturate`, `python3 -m saturate` or torchrun's `-m
    saturate`), shell variables filled in as a job would."""
    command = re.sub(r"\$\{?(\w+)\}?", lambda m: _SHELL.get(m.group(1), "x"), command)
    words = shlex.split(command, comments=True)
    if words[0] == "saturate":
        return words[1:]
    at = next(i for i in range(len(words) - 1) if words[i:i + 2] == ["-m", "saturate"])
    return words[at + 2:]


COMMANDS = [(rel(p), c) for p in PAGES for c in commands(p)]


def test_the_pages_give_commands():
    assert sum(page == "README.md" for page, _ in COMMANDS) >= 10
    assert {page for page, _ in COMMANDS} >= {rel(p) for p in PAGES if p.name in ("doctor.md", "scripts.md",
                                                                                   "distributed.md")}


@pytest.mark.parametrize(("page", "command"), COMMANDS, ids=[f"{p}: {c[:60]}" for p, c in COMMANDS])
def test_a_command_is_one_saturate_accepts(page, command, capsys):
    from saturate import REFERENCE_PLANS
    from saturate.cli import build_parser
    from saturate.workloads.registry import preset_names

    argv = saturate_argv(command)
    script = None
    if "--" in argv:  # as cli.main splits it: the reader's own command after `--`
        cut = argv.index("--")
        argv, script = argv[:cut], argv[cut + 1:]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        if e.code == 0:  # --version, --help
            return
        pytest.fail(f"{page}: `{command}` is refused: {capsys.readouterr().err.strip()}")
    from saturate.cli import _option_strings

    options = set(_option_strings(build_parser()))
    abbreviated = [w.split("=")[0] for w in argv if w.startswith("--") and w.split("=")[0] not in options]
    assert not abbreviated, f"{page}: `{command}` abbreviates {abbreviated}: spell options out in the docs"
    if script is not None:
        assert hasattr(args, "script"), f"{page}: `saturate {args.command}` takes no command after `--`"
        assert script, f"{page}: nothing after `--` in `{command}`"
    preset = getattr(args, "preset", None) or getattr(args, "preset_arg", None)
    if preset is not None:
        assert preset in preset_names(), f"{page}: no preset {preset!r} (`{command}`)"
    plan = getattr(args, "plan", None)
    if plan is not None and "/" not in str(plan) and not str(plan).endswith(".toml"):
        assert plan in REFERENCE_PLANS, f"{page}: no reference plan {plan!r} (`{command}`)"


def _quick(argv: list[str]) -> bool:
    """A command that answers in about a second on any machine: run for real, not only parsed."""
    return argv[:1] == ["env"] or argv[:1] == ["--version"] or (argv[:1] == ["probe"] and "--no-peaks" in argv) \
        or (argv[:1] == ["monitor"] and "--once" in argv)


QUICK = [(page, c) for page, c in COMMANDS if _quick(saturate_argv(c))]


def test_some_commands_are_quick_enough_to_run():
    assert QUICK


@pytest.mark.parametrize(("page", "command"), QUICK, ids=[f"{p}: {c[:60]}" for p, c in QUICK])
def test_a_quick_command_runs(page, command, capsys):
    from conftest import run_main

    done = run_main(capsys, *saturate_argv(command))
    assert done.returncode == 0, f"{page}: `{command}` exited {done.returncode}: {done.stderr.strip()}"
    assert done.stdout.strip()

# --- links, length, layout ------------------------------------------------------------------------------------

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of `page`."""
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose(page), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


LINKS = [(rel(p), target) for p in [*PAGES, *(ROOT / "docs" / n for n in sorted(NOT_INSTRUCTIONS))]
         for target in _LINK.findall(prose(p)) if not re.match(r"[a-z]+:", target)]


def test_the_pages_link_to_each_other():
    assert {t for p, t in LINKS if p == "README.md"} >= {f"docs/{p.name}" for p in PAGES if p.name != "README.md"}


@pytest.mark.parametrize(("page", "target"), LINKS, ids=[f"{p} -> {t}" for p, t in LINKS])
def test_a_relative_link_leads_somewhere(page, target):
    path, _, anchor = target.partition("#")
    dest = (ROOT / page).parent / path if path else ROOT / page
    assert dest.exists(), f"{page}: {target} names no file"
    if anchor:
        assert dest.suffix == ".md" and anchor in anchors(dest), f"{page}: {target}: no such heading in {dest.name}"


def test_the_readme_stays_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to a page under docs/"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_lines_fit_and_end_cleanly(page):
    bad = [f"{rel(page)}:{i}: {'trailing space' if line != line.rstrip() else f'{len(line)} characters'}"
           for i, line in enumerate(page.read_text().splitlines(), 1)
           if line != line.rstrip() or len(line) > LINE_MAX]
    assert not bad, "\n".join(bad)


def test_the_setup_commands_are_word_for_word():
    readme = (ROOT / "README.md").read_text()
    for command in SETUP:
        assert f"```bash\n{command}\n```" in readme
    assert SETUP[1] in (ROOT / ".ci" / "run").read_text()
