"""Data that is not what it claims, made for real: a FIFO and an executable among the text files of a --data
folder, a token shard holding ids beyond its vocabulary. None hangs the run or ends it in a traceback."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from saturate.cli import main
from saturate.data.shards import open_shard, write_shard
from saturate.data.token_cache import prepare_corpus
from saturate.errors import DataError
from saturate.workloads import build_workload


@contextlib.contextmanager
def no_hang(seconds: int = 60) -> Iterator[None]:
    """Fail, rather than hang, if the block blocks (a read of a FIFO with no writer never returns)."""
    def fail(signum, frame):
        raise AssertionError(f"blocked for {seconds} s")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def mixed_folder(small_corpus: Path) -> Path:
    """The small corpus plus a FIFO named like text and an executable named like text."""
    os.mkfifo(small_corpus / "pipe.txt")
    shutil.copyfile(sys.executable, small_corpus / "tool.txt")
    return small_corpus


def test_fifo_and_binary_files_in_a_data_folder_are_skipped_and_named(mixed_folder, caplog):
    with no_hang(), caplog.at_level(logging.WARNING):
        workload = build_workload("gpt-tiny", data=[str(mixed_folder)], n_layer=1, n_embd=32, n_head=2, seq_len=32)
    assert workload.info["corpus_files"] == 2  # the two text files
    assert workload.info["skipped_files"] == (f"{mixed_folder / 'pipe.txt'} (a FIFO, not a regular file); "
                                              f"{mixed_folder / 'tool.txt'} (binary: it holds NUL bytes)")
    warned = [r.getMessage() for r in caplog.records]
    assert f"saturate: warning: skipping data file {mixed_folder / 'tool.txt'}: binary: it holds NUL bytes" in warned
    assert f"saturate: warning: skipping data file {mixed_folder / 'pipe.txt'}: a FIFO, not a regular file" in warned


def test_a_fifo_named_as_data_is_refused_without_reading_it(tmp_path):
    os.mkfifo(tmp_path / "pipe.txt")
    with no_hang(), pytest.raises(DataError, match=r"data path '.*pipe.txt' is a FIFO, not a regular file$"):
        prepare_corpus([str(tmp_path / "pipe.txt")], seq_len=32)


def _shards(folder: Path, n: int = 4000) -> None:
    folder.mkdir()
    ids = np.arange(n, dtype=np.int64) % 200
    meta = {"tokenizer": "byte", "vocab_size": 257, "source_hash": "x", "val_fraction": 0.1}
    write_shard(folder / "train.bin", ids[: n - 500], meta)
    write_shard(folder / "val.bin", ids[n - 500:], meta)


def test_a_shard_with_ids_beyond_its_vocabulary_is_one_line(tmp_path, capsys):
    folder = tmp_path / "shards"
    _shards(folder)
    assert open_shard(folder / "train.bin").meta["max_id"] == 199
    with open(folder / "train.bin", "r+b") as f:  # damage: one id overwritten with 0xFFFF, far past 257
        f.seek(-2 * 100, os.SEEK_END)
        f.write(b"\xff\xff")
    code = main(["train", "--data", str(folder), "--param", "n_layer=1", "--param", "n_embd=32", "--param",
                 "n_head=2", "--param", "seq_len=32", "--steps", "1", "--no-progress", "--run-dir",
                 str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"saturate: error: {folder / 'train.bin'} holds token id 65535 at position 3400, "
                                 "beyond its vocabulary of 257 (a damaged shard, or one made with another tokenizer)"]
