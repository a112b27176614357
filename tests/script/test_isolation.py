"""Trials that touch nothing: a doctor run, a trial or a side-by-side round reads the user's folders as they are and
writes into a scratch layer (isolation.py, child/overlay_exec.py); the full run of `run --` starts from exactly
what a plain run would. Provoked with a loop that snapshots every few steps and resumes when a snapshot exists
(the PyTorch DDP tutorial's pattern, nanoGPT's `init_from='resume'`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import cli_env, saturate_cmd
from saturate.script import isolation
from saturate.script.isolation import Layers, folders, run_folder, unavailable

needs_overlay = pytest.mark.skipif(unavailable() is not None, reason=f"no overlay here: {unavailable()}")

# snapshot every 5 steps to the path after --snapshot (another folder than the working one), resume from it when
# it exists, say so on stdout (its length in a name saturate does not read as one: a run of a few seconds is not
# tuned, and the test times trials)
LOOP = """
import os, sys, torch
from torch.utils.data import DataLoader, TensorDataset
until, snap = int(sys.argv[1]), sys.argv[sys.argv.index("--snapshot") + 1]
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
start = 0
if os.path.exists(snap):
    state = torch.load(snap)
    model.load_state_dict(state["model"])
    start = state["step"]
    print("RESUMED", start, flush=True)
print("from", start, flush=True)
loader = DataLoader(TensorDataset(torch.randn(512, 8)), batch_size=16)
step = start
while step < until:
    for (x,) in loader:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step % 5 == 0:
            torch.save({"model": model.state_dict(), "step": step}, snap)
        if step == until:
            break
with open("log.txt", "a") as f:
    f.write(f"ran {start}..{until}\\n")
"""


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _project(root: Path) -> tuple[Path, Path]:
    work, runs = root / "work", root / "runs"
    work.mkdir(parents=True)
    runs.mkdir()
    (work / "loop.py").write_text(LOOP)
    return work, runs


def test_the_covered_folders_are_the_working_one_and_those_named_on_the_command_line(tmp_path, monkeypatch):
    (tmp_path / "work" / "config").mkdir(parents=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.bin").write_bytes(b"x")
    monkeypatch.chdir(tmp_path / "work")
    found = folders(["python", "train.py", "config/a.py", f"--data={tmp_path / 'data' / 'train.bin'}",
                     "--out", str(tmp_path / "runs" / "new" / "ckpt"), "--lr", "0.1", "/usr/lib/x", "out-dir"])
    # config/ lies inside the working folder; the not-yet-made runs/new/ckpt is covered at its nearest folder
    # (tmp_path itself, which holds the working folder too); the system's folders never
    assert found == [tmp_path.resolve()]
    found = folders(["python", "train.py", f"--data={tmp_path / 'data' / 'train.bin'}"])
    assert found == [(tmp_path / "data").resolve(), (tmp_path / "work").resolve()]


def test_a_run_folder_is_made_outside_every_covered_folder(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.chdir(tmp_path / "tmp")  # the working folder is the temporary folder itself
    folder = run_folder("saturate-test-", ["python", "train.py"])
    try:
        assert not folder.resolve().is_relative_to((tmp_path / "tmp").resolve()), folder
    finally:
        isolation.remove(folder)


@needs_overlay
def test_a_covered_run_creates_changes_and_deletes_only_in_its_scratch_layer(tmp_path):
    user = tmp_path / "user"
    (user / "sub").mkdir(parents=True)
    (user / "keep.txt").write_text("mine")
    (user / "sub" / "gone.txt").write_text("mine too")
    before = _tree(user)
    layers = Layers([user], tmp_path / "run" / "layers")
    code = ("import os; open('keep.txt', 'w').write('theirs'); os.remove('sub/gone.txt'); "
            "open('made.txt', 'w').write('new'); print(open('keep.txt').read(), os.path.exists('sub/gone.txt'))")
    out = subprocess.run(layers.wrap([sys.executable, "-S", "-c", code]), cwd=user, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["theirs", "False"]  # the run sees its own writes
    assert _tree(user) == before  # the user does not
    # a deletion is a change too (the overlay's whiteout)
    assert layers.written() == [user / "keep.txt", user / "made.txt", user / "sub" / "gone.txt"]
    isolation.remove(tmp_path / "run")
    assert not (tmp_path / "run").exists()


@needs_overlay
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a file system inside the folder")
def test_a_file_system_mounted_inside_a_covered_folder_is_seen_and_covered_too(tmp_path):
    """A container's bind mount of the data inside the project: the folder's overlay alone would hide it."""
    user = tmp_path / "user"
    (user / "data").mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(user / "data")], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (user / "data" / "x.txt").write_text("on the inner mount")
        layers = Layers([user], tmp_path / "run" / "layers")
        code = "print(open('data/x.txt').read()); open('data/x.txt', 'w').write('changed'); open('data/new', 'w')"
        out = subprocess.run(layers.wrap([sys.executable, "-S", "-c", code]), cwd=user, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == "on the inner mount", out.stderr
        assert (user / "data" / "x.txt").read_text() == "on the inner mount" and not (user / "data" / "new").exists()
        assert layers.written() == [user / "data" / "new", user / "data" / "x.txt"]
    finally:
        subprocess.run(["umount", "-l", str(user / "data")], capture_output=True)


@needs_overlay
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root to become another user")
def test_an_unprivileged_user_is_covered_too_and_keeps_its_own_uid():
    tmp_path = Path(tempfile.mkdtemp())  # pytest's own folders are closed to other users
    user, nobody = tmp_path / "user", 65534
    user.mkdir()
    (user / "keep.txt").write_text("mine")
    layers = Layers([user], tmp_path / "run" / "layers")
    other = shutil.which("python3", path="/usr/bin:/bin")  # an interpreter that user may run (ours may be in /root)
    if other is None:
        pytest.skip("no system python3 for another user")
    cmd = layers.wrap([other, "-S", "-c", "import os; open('keep.txt', 'w').write('x'); print(os.getuid())"])
    for p in [tmp_path, *tmp_path.rglob("*")]:
        os.chown(p, nobody, nobody)
    tmp_path.chmod(0o755)
    out = subprocess.run(["setpriv", f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups", *cmd], cwd=user,
                         capture_output=True, text=True, timeout=60)
    try:
        if "unshare" in out.stderr:
            pytest.skip(f"user namespaces refused to an unprivileged user here: {out.stderr.strip()}")
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == str(nobody) and (user / "keep.txt").read_text() == "mine"
    finally:
        isolation.remove(tmp_path)


def test_off_says_so_in_one_line(monkeypatch):
    monkeypatch.setenv(isolation.ENV, "off")
    unavailable.cache_clear()
    try:
        assert Layers.of(["python", "train.py"], Path("/nonexistent")) is None
        assert isolation.notice(["python", "train.py"]).startswith("trials are not isolated here (SATURATE_ISOLATION")
    finally:
        monkeypatch.delenv(isolation.ENV)
        unavailable.cache_clear()


def _saturate(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(saturate_cmd(*args), env={**cli_env(), "OMP_NUM_THREADS": "1", "COLUMNS": "200", **env},
                          cwd=cwd, capture_output=True, text=True, timeout=600)


@needs_overlay
def test_the_doctor_leaves_the_folders_as_they_were_and_says_where_its_writes_went(tmp_path):
    work, runs = _project(tmp_path)
    before = _tree(tmp_path)
    out = _saturate("doctor", "--", sys.executable, "loop.py", "300", "--snapshot", str(runs / "snap.pt"), cwd=work)
    assert out.returncode == 0, out.stderr[-2000:]
    assert _tree(tmp_path) == before
    assert "RESUMED" not in out.stdout + out.stderr
    line = next(x for x in out.stdout.splitlines() if "its writes:" in x)
    assert "snap.pt" in line and "scratch layer" in line, line


@pytest.mark.slow
@needs_overlay
def test_run_leaves_what_a_plain_run_leaves_and_its_full_run_starts_fresh(tmp_path):
    plain_work, plain_runs = _project(tmp_path / "plain")
    # long enough that the first trial cannot reach the script's end (a short job gets no other trial): 3000 steps
    # did on a Zen 4 (0.43 ms a step)
    steps = "12000"
    done = subprocess.run([sys.executable, "loop.py", steps, "--snapshot", str(plain_runs / "snap.pt")],
                          cwd=plain_work, env={**cli_env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "RESUMED" not in done.stdout, done.stderr

    work, runs = _project(tmp_path / "saturated")
    logs = tmp_path / "trial-logs"
    out = _saturate("run", "--trial-steps", "4", "--trial-seconds", "2", "--json", "--", sys.executable, "loop.py",
                    steps, "--snapshot", str(runs / "snap.pt"), cwd=work, SATURATE_TRIAL_LOGS=str(logs))
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(out.stdout)
    assert d["full_run"]["optimizer_steps"] == int(steps)
    # no trial, no round (each one's output in its log) and not the full run resumed from a trial's snapshot
    trials = [p.read_text() for p in sorted(logs.glob("*.log"))]
    assert len(trials) >= 3 and all(t.startswith("from 0") and "RESUMED" not in t for t in trials), trials
    assert "from 0" in out.stderr and "RESUMED" not in out.stderr
    # the same files as the plain run, the log written once by the full run from step 0
    assert _tree(tmp_path / "saturated").keys() == _tree(tmp_path / "plain").keys()
    assert (work / "log.txt").read_text() == f"ran 0..{steps}\n"
    import torch

    assert torch.load(runs / "snap.pt")["step"] == int(steps)


@needs_overlay
def test_folders_an_overlay_cannot_cover_are_said_once_and_runs_go_uncovered(tmp_path):
    """(A network file system may refuse to be an overlay's lower layer: then trials would fail, not run.)"""
    missing = tmp_path / "gone"
    why = isolation.uncoverable((missing,))
    assert why is not None and why.endswith(f"an overlay on {missing}: No such file or directory")
    assert isolation.uncoverable((tmp_path,)) is None
