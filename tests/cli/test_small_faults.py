"""The small ones, each provoked for real: refused values, an export killed mid-write, a corpus build that
fails, a tune that fails; none leaves a traceback or a stray file or folder behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import cli_env, run_main
from saturate.cli import main
from saturate.data.token_cache import cache_root, prepare_corpus
from saturate.errors import DataError

TINY = ("--param", "n_layer=1", "--param", "n_embd=32", "--param", "n_head=2", "--param", "seq_len=32")


@pytest.mark.parametrize("flag, value, message", [
    ("--effective-batch", "0", "--effective-batch must be > 0, got 0"),
    ("--seed", "-1", "--seed must be between 0 and 2**64 - 1, got -1"),
])
def test_refused_values(flag, value, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == f"saturate: error: {message}\n"  # one line: no usage above it


@pytest.mark.parametrize("argv, message", [
    (("run", "--effective-batch", "0"), "--effective-batch must be > 0, got 0"),
    (("run", "--steps", "-1"), "--steps must be > 0, got -1"),  # not after tuning and sizing the side-by-side
    (("run", "--minutes", "0"), "--minutes must be > 0, got 0"),
    (("tune", "--steps", "-1"), "--steps must be > 0, got -1"),  # not after running trials
    (("tune", "--budget", "-5"), "--budget must be > 0, got -5"),
    (("train", "--steps", "2.5"), "--steps must be a whole number, got '2.5'"),
    (("train", "--log-every", "0"), "--log-every must be > 0, got 0"),
    (("train", "--keep", "0"), "--keep must be > 0, got 0"),
    (("sweep", "--grid", "lr=1e-3", "--steps", "0"), "--steps must be > 0, got 0"),
    (("doctor", "--stesp", "3"), "unrecognized arguments: --stesp 3 (did you mean '--steps'?)"),
    (("probe", "--device"), "argument --device: expected one argument"),
])
def test_argument_errors_are_one_line_for_every_verb(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    proc = run_main(capsys, *argv)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"saturate: error: {message}"] and proc.stdout == ""
    assert list(tmp_path.iterdir()) == []  # no run folder, no plan


def test_help_still_shows_the_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("usage: saturate train")


def test_data_that_is_all_binary_is_named_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prog.txt").write_bytes(b"\x7fELF\x02\x01\x01\0\0\0" * 100)  # an executable named .txt
    proc = run_main(capsys, "train", "--data", "prog.txt", "--steps", "1")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["saturate: error: no text to train on: data file prog.txt is not text "
                                        "(binary: it holds NUL bytes), so it was skipped"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prog.txt"]


SLOW_EXPORT = textwrap.dedent("""
    import pathlib, sys, time
    import safetensors.torch

    def save_model(model, filename, *args, **kwargs):  # half a file, then hang until killed
        pathlib.Path(filename).write_bytes(b"half an export" * 1000)
        pathlib.Path(sys.argv[1]).write_text("writing")
        time.sleep(600)

    safetensors.torch.save_model = save_model
    from saturate.cli import main
    sys.exit(main(sys.argv[2:]))
""")


@pytest.mark.slow
def test_an_export_killed_mid_write_leaves_no_temporary_for_ever(tmp_path, small_corpus, capsys):
    run_dir, marker, script = tmp_path / "run", tmp_path / "writing", tmp_path / "slow_export.py"
    script.write_text(SLOW_EXPORT)
    argv = ["train", "--data", str(small_corpus), *TINY, "--effective-batch", "4", "--steps", "2", "--no-progress",
            "--run-dir", str(run_dir)]
    proc = subprocess.Popen([sys.executable, str(script), str(marker), *argv], env=cli_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(2400):
            if marker.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert marker.exists(), "the export never started"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert list(run_dir.glob(".model.safetensors.tmp-*")), "the killed export left its temporary"
    assert main(["train", "--resume", "--run-dir", str(run_dir), "--no-progress"]) == 0  # redoes the export
    assert not list(run_dir.glob(".*.tmp-*")) and (run_dir / "model.safetensors").is_file()


def test_a_failed_corpus_build_leaves_no_cache_folder(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    before = set((cache_root() / "tokens").glob("*")) if (cache_root() / "tokens").is_dir() else set()
    with pytest.raises(DataError, match="is empty"):
        prepare_corpus([str(tmp_path / "empty.txt")], seq_len=32)
    after = set((cache_root() / "tokens").glob("*")) if (cache_root() / "tokens").is_dir() else set()
    assert after == before  # no folder holding only the builders' .lock


def test_a_failed_tune_leaves_no_folder(tmp_path, small_corpus, capsys, monkeypatch):
    from saturate.errors import ConfigError
    from saturate.tune import api

    def fails(*a, **k):
        raise ConfigError("every trial failed")

    monkeypatch.setattr(api, "search", fails)
    out = tmp_path / "tune"
    code = main(["tune", "--data", str(small_corpus), *TINY, "--effective-batch", "4", "--out", str(out)])
    assert code == 2 and "every trial failed" in capsys.readouterr().err
    assert not out.exists()
