"""Corpus → token shards: tokenizers, file discovery, the shard format and the cache."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from saturate.data.corpus import content_hash, default_corpus, iter_documents, resolve_paths
from saturate.data.shards import MAGIC, open_shard, write_shard
from saturate.data.token_cache import TokenCorpus, cache_root, prepare_corpus
from saturate.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, parse_tokenizer_spec
from saturate.errors import ConfigError, DataError, SaturateError

SAMPLE = "héllo wörld — naïve café 🦊 日本語\n\tdef f(x):\n        return x * 2\n"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    # Nothing a test does may land in the user's real cache.
    monkeypatch.setenv("SATURATE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _small_corpus(root: Path) -> Path:
    folder = root / "corpus"
    _write(folder / "a.txt", "The quick brown fox jumps over the lazy dog. " * 40)
    _write(folder / "notes" / "b.md", "# Notes\n\nSome *markdown* with ünïcödé. " * 30)
    _write(folder / "c.py", "def add(a, b):\n    return a + b\n" * 30)
    return folder


def _leftover_temps(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


# --- tokenizers ------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_non_ascii():
    tok = ByteTokenizer()
    ids = tok.encode(SAMPLE)
    assert isinstance(tok, Tokenizer)
    assert ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer)
    assert len(ids) == len(SAMPLE.encode("utf-8")) > len(SAMPLE)  # multi-byte characters
    assert int(ids.max()) < 256 and tok.eot_id == 256 and tok.vocab_size == 257
    assert tok.decode(ids) == SAMPLE
    # End-of-text is dropped on decode; a list works as well as an array.
    assert tok.decode([*ids[:5].tolist(), tok.eot_id, *ids[5:].tolist()]) == SAMPLE
    assert tok.name == "byte"


def test_byte_tokenizer_decodes_a_split_character_without_raising():
    ids = ByteTokenizer().encode("🦊")
    assert ByteTokenizer().decode(ids[:2]) == "\ufffd"


def test_bpe_train_round_trip_and_save_load(tmp_path):
    texts = [SAMPLE * 3, "the cat sat on the mat; the cat sat on the hat\n" * 20]
    tok = BPETokenizer.train(texts, vocab_size=400)
    assert isinstance(tok, Tokenizer)
    assert tok.name.startswith(f"bpe-{tok.vocab_size}-") and len(tok.name.split("-")[2]) == 12
    assert 257 < tok.vocab_size <= 400
    unseen = "Zebra quizzes: ÆØÅ ∑ 🦀 <tag/>"
    for text in (SAMPLE, unseen):
        ids = tok.encode(text)
        assert ids.ndim == 1 and int(ids.max()) < tok.vocab_size
        assert tok.decode(ids) == text
    # Merges were learned: the repeated sentence takes fewer tokens than bytes.
    cat = "the cat sat on the mat"
    assert len(tok.encode(cat)) < len(cat.encode())

    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(path)
    assert _leftover_temps(path.parent) == []
    loaded = BPETokenizer.load(path)
    assert loaded.name == tok.name
    assert loaded.eot_id == tok.eot_id and loaded.vocab_size == tok.vocab_size
    np.testing.assert_array_equal(loaded.encode(SAMPLE), tok.encode(SAMPLE))
    batch = loaded.encode_batch([SAMPLE, unseen])
    np.testing.assert_array_equal(batch[1], tok.encode(unseen))


def test_bpe_load_rejects_missing_and_foreign_files(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        BPETokenizer.load(tmp_path / "nope.json")
    bad = _write(tmp_path / "bad.json", "{not json")
    with pytest.raises(DataError, match="not a valid tokenizer"):
        BPETokenizer.load(bad)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("byte", ("byte", None)),
        ("bpe", ("bpe", 8192)),
        ("bpe:4096", ("bpe", 4096)),
        (" BPE:300 ", ("bpe", 300)),
    ],
)
def test_parse_tokenizer_spec(spec, expected):
    assert parse_tokenizer_spec(spec) == expected


@pytest.mark.parametrize("spec", ["bpe:299", "bpe:1000001", "bpe:abc", "bpe:", "byte:5", "word", ""])
def test_parse_tokenizer_spec_rejects(spec):
    with pytest.raises(ConfigError) as info:
        parse_tokenizer_spec(spec)
    assert repr(spec) in str(info.value)
    assert isinstance(info.value, SaturateError)


# --- finding files and documents ----------------------------------------------------------------------


def test_resolve_paths_file_folder_glob(tmp_path):
    folder = _small_corpus(tmp_path)
    jsonl = _write(folder / "d.jsonl", '{"text": "x"}\n')
    _write(folder / "skip.csv", "a,b\n")
    _write(folder / ".git" / "HEAD.txt", "hidden")

    from_folder = resolve_paths([str(folder)])
    assert [p.relative_to(folder).as_posix() for p in from_folder] == [
        "a.txt",
        "c.py",
        "d.jsonl",
        "notes/b.md",
    ]

    assert resolve_paths([str(jsonl)]) == [jsonl]
    assert [p.name for p in resolve_paths([str(folder / "*.txt")])] == ["a.txt"]
    assert [p.name for p in resolve_paths([str(folder / "**" / "*.md")])] == ["b.md"]
    # Overlapping specs give each file once, sorted.
    both = resolve_paths([str(folder / "c.py"), str(folder), str(folder / "*.py")])
    assert both == from_folder


def test_resolve_paths_errors(tmp_path):
    folder = _small_corpus(tmp_path)
    with pytest.raises(DataError, match="does not exist") as info:
        resolve_paths([str(tmp_path / "missing")])
    assert "missing" in str(info.value)
    with pytest.raises(DataError, match="matches no .txt/.md/.py/.jsonl files"):
        resolve_paths([str(folder / "*.rst")])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="matches no"):
        resolve_paths([str(empty)])
    csv = _write(tmp_path / "table.csv", "a,b\n")
    with pytest.raises(DataError, match=r"table\.csv.*'\.csv'"):
        resolve_paths([str(csv)])


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_resolve_paths_unreadable_file(tmp_path):
    secret = _write(tmp_path / "secret.txt", "hidden")
    secret.chmod(0)
    try:
        with pytest.raises(DataError, match="secret.txt"):
            resolve_paths([str(secret)])
    finally:
        secret.chmod(0o644)


def test_iter_documents_text_and_jsonl(tmp_path):
    txt = _write(tmp_path / "a.txt", SAMPLE)
    _write(tmp_path / "empty.txt", "")
    jsonl = _write(
        tmp_path / "b.jsonl",
        json.dumps({"body": "first", "id": 1}) + "\n\n" + json.dumps({"body": "sécond"}) + "\n",
    )
    docs = list(iter_documents([txt, tmp_path / "empty.txt", jsonl], text_field="body"))
    assert docs == [SAMPLE, "first", "sécond"]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([{"text": "ok"}, {"body": "no text"}], r"b\.jsonl:2: no 'text' field \(keys: body\)"),
        ([{"text": "ok"}, {"text": "ok"}, "{oops"], r"b\.jsonl:3: invalid JSON"),
        ([{"text": 5}], r"b\.jsonl:1: field 'text' is int"),
        ([["a list"]], r"b\.jsonl:1: expected a JSON object"),
    ],
)
def test_iter_documents_jsonl_errors_name_file_and_line(tmp_path, lines, message):
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n"
    path = _write(tmp_path / "b.jsonl", text)
    with pytest.raises(DataError, match=message):
        list(iter_documents([path]))


def test_content_hash_follows_content_not_names_or_times(tmp_path):
    path = _write(tmp_path / "a.txt", SAMPLE)
    before = content_hash([path], "text")
    os.utime(path, (1_000_000, 1_000_000))
    assert content_hash([path], "text") == before
    renamed = path.rename(tmp_path / "renamed.md")
    assert content_hash([renamed], "text") == before
    _write(renamed, SAMPLE + "!")
    assert content_hash([renamed], "text") != before

    jsonl = _write(tmp_path / "c.jsonl", '{"text": "a", "body": "b"}\n')
    assert content_hash([jsonl], "text") != content_hash([jsonl], "body")


# --- shard format ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("vocab", "dtype"), [(257, "uint16"), (65536, "uint16"), (70_000, "uint32")])
def test_shard_round_trip(tmp_path, vocab, dtype):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=10_001, dtype=np.int64)
    tokens[-1] = vocab - 1
    path = tmp_path / "t.bin"
    write_shard(path, tokens, {"vocab_size": vocab, "tokenizer": "byte", "source_hash": "abc", "extra": [1]})
    assert _leftover_temps(tmp_path) == []

    shard = open_shard(path)
    assert isinstance(shard.tokens, np.memmap)
    assert shard.tokens.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(shard.tokens, tokens)
    assert shard.meta["n_tokens"] == len(tokens) == len(shard)
    assert shard.meta["dtype"] == dtype and shard.meta["version"] == 1 and shard.meta["extra"] == [1]
    assert shard.tokens.offset % 64 == 0
    with pytest.raises(ValueError):
        shard.tokens[0] = 1  # read-only map


def test_shard_with_no_tokens(tmp_path):
    path = tmp_path / "empty.bin"
    write_shard(
        path, np.zeros(0, dtype=np.int64), {"vocab_size": 257, "tokenizer": "byte", "source_hash": ""}
    )
    shard = open_shard(path)
    assert len(shard.tokens) == 0 and shard.meta["n_tokens"] == 0


def test_write_shard_rejects_ids_outside_vocab(tmp_path):
    with pytest.raises(DataError, match=r"0\.\.257"):
        write_shard(
            tmp_path / "t.bin", np.array([0, 257]), {"vocab_size": 257, "tokenizer": "b", "source_hash": ""}
        )
    assert list(tmp_path.iterdir()) == []


def test_truncated_shard_is_detected(tmp_path):
    path = tmp_path / "t.bin"
    write_shard(path, np.arange(1000), {"vocab_size": 1000, "tokenizer": "x", "source_hash": "h"})
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 2 * 10)  # ten uint16 tokens short
    with pytest.raises(DataError, match="truncated: header says 1000 tokens, file holds 990"):
        open_shard(path)
    with open(path, "r+b") as f:
        f.truncate(20)  # cut inside the header
    with pytest.raises(DataError, match="truncated"):
        open_shard(path)


def test_foreign_and_missing_files_are_not_shards(tmp_path):
    noise = tmp_path / "noise.bin"
    noise.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    text = _write(tmp_path / "readme.txt", "just some text, long enough to hold a header\n")
    tiny = tmp_path / "tiny.bin"
    tiny.write_bytes(b"SAT")
    for path in (noise, text, tiny, tmp_path):
        with pytest.raises(DataError, match="is not a saturate token shard"):
            open_shard(path)
    with pytest.raises(DataError, match="does not exist"):
        open_shard(tmp_path / "missing.bin")


def test_corrupt_header_is_detected(tmp_path):
    path = tmp_path / "t.bin"
    write_shard(path, np.arange(10), {"vocab_size": 300, "tokenizer": "x", "source_hash": "h"})
    data = bytearray(path.read_bytes())
    start = len(MAGIC) + 4
    data[start] = ord("[")  # the JSON header no longer parses
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match="corrupt header"):
        open_shard(path)


# --- prepare_corpus --------------------------------------------------------------------------------


def test_prepare_corpus_tokenises_once_then_hits_the_cache(tmp_path):
    folder = _small_corpus(tmp_path)
    first = prepare_corpus([str(folder)], seq_len=32)
    assert isinstance(first, TokenCorpus)
    assert first.cached is False and first.n_files == 3
    assert first.cache_dir.parent.parent == tmp_path / "cache"
    assert sorted(p.name for p in first.cache_dir.iterdir() if not p.name.startswith(".")) == [
        "train.bin",
        "val.bin",
    ]

    # The stream is the documents in path order, end-of-text between them; val is its last tenth.
    docs = list(iter_documents(resolve_paths([str(folder)])))
    tok = first.tokenizer
    stream = np.concatenate([first.train, first.val])
    assert first.n_tokens == len(stream) == sum(len(d.encode()) for d in docs) + len(docs) - 1
    assert int((stream == tok.eot_id).sum()) == len(docs) - 1
    assert tok.decode(stream) == "".join(docs)
    assert len(first.val) == int(np.ceil(first.n_tokens * 0.1))

    second = prepare_corpus([str(folder)], seq_len=32)
    assert second.cached is True
    assert second.fingerprint == first.fingerprint and second.cache_dir == first.cache_dir
    np.testing.assert_array_equal(second.train, first.train)
    np.testing.assert_array_equal(second.val, first.val)


def test_editing_a_file_changes_the_fingerprint(tmp_path):
    folder = _small_corpus(tmp_path)
    before = prepare_corpus([str(folder)], seq_len=32)
    (folder / "a.txt").write_text("A different first document. " * 40)
    after = prepare_corpus([str(folder)], seq_len=32)
    assert after.cached is False
    assert after.fingerprint != before.fingerprint and after.cache_dir != before.cache_dir


def test_truncated_cached_shard_is_rebuilt(tmp_path):
    folder = _small_corpus(tmp_path)
    first = prepare_corpus([str(folder)], seq_len=32)
    train_path = first.cache_dir / "train.bin"
    expected = np.array(first.train)
    del first
    with open(train_path, "r+b") as f:
        f.truncate(train_path.stat().st_size - 100)
    again = prepare_corpus([str(folder)], seq_len=32)
    assert again.cached is False
    np.testing.assert_array_equal(again.train, expected)
    assert open_shard(train_path).meta["n_tokens"] == len(expected)
    assert prepare_corpus([str(folder)], seq_len=32).cached is True


def test_prepare_corpus_with_bpe_reloads_its_tokenizer(tmp_path):
    folder = _small_corpus(tmp_path)
    first = prepare_corpus([str(folder)], tokenizer="bpe:400", seq_len=16)
    assert first.tokenizer.name.startswith("bpe-")
    assert (first.cache_dir / "tokenizer.json").is_file()
    assert first.vocab_size == first.tokenizer.vocab_size <= 400
    second = prepare_corpus([str(folder)], tokenizer="bpe:400", seq_len=16)
    assert second.cached is True and second.tokenizer.name == first.tokenizer.name
    assert second.fingerprint == first.fingerprint
    docs = list(iter_documents(resolve_paths([str(folder)])))
    assert second.tokenizer.decode(np.concatenate([second.train, second.val])) == "".join(docs)
    # A different tokenizer is different data.
    assert prepare_corpus([str(folder)], seq_len=16).fingerprint != first.fingerprint


def test_jsonl_corpus_uses_the_named_field(tmp_path):
    rows = [{"body": f"document number {i} " * 10, "text": "ignored"} for i in range(20)]
    path = _write(tmp_path / "data.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    corpus = prepare_corpus([str(path)], seq_len=16, text_field="body")
    text = corpus.tokenizer.decode(np.concatenate([corpus.train, corpus.val]))
    assert text == "".join(r["body"] for r in rows)
    assert prepare_corpus([str(path)], seq_len=16).fingerprint != corpus.fingerprint


def test_validation_split_is_at_least_one_window(tmp_path):
    path = _write(tmp_path / "small.txt", "x" * 300)
    corpus = prepare_corpus([str(path)], seq_len=50)
    assert len(corpus.val) == 51 and len(corpus.train) == 249  # 10 % would be only 30 tokens
    # A longer window on the same tiny corpus needs a different split, so it is not a stale hit.
    longer = prepare_corpus([str(path)], seq_len=100)
    assert len(longer.val) == 101 and longer.fingerprint != corpus.fingerprint
    assert prepare_corpus([str(path)], seq_len=100).cached is True


def test_empty_and_too_short_corpora(tmp_path):
    empty = _write(tmp_path / "empty" / "nothing.txt", "")
    with pytest.raises(DataError, match="is empty"):
        prepare_corpus([str(empty.parent)], seq_len=8)
    short = _write(tmp_path / "short.txt", "tiny text")
    with pytest.raises(DataError) as info:
        prepare_corpus([str(short)], seq_len=8)
    assert str(short) in str(info.value)
    assert "has 9 tokens; need at least 18 for a train split" in str(info.value)


def test_bad_arguments(tmp_path):
    path = _write(tmp_path / "a.txt", "x" * 100)
    with pytest.raises(ConfigError, match="seq_len"):
        prepare_corpus([str(path)], seq_len=0)
    with pytest.raises(ConfigError, match="val_fraction"):
        prepare_corpus([str(path)], seq_len=4, val_fraction=1.0)
    with pytest.raises(ConfigError, match="'wordpiece'"):
        prepare_corpus([str(path)], seq_len=4, tokenizer="wordpiece")


def test_unwritable_cache_folder(tmp_path, monkeypatch):
    path = _write(tmp_path / "a.txt", "x" * 100)
    blocker = _write(tmp_path / "not-a-folder", "a file where the cache folder should be")
    monkeypatch.setenv("SATURATE_CACHE", str(blocker))
    with pytest.raises(DataError, match="cache folder .*not-a-folder.* is not writable"):
        prepare_corpus([str(path)], seq_len=4)


def test_concurrent_preparers_tokenise_once(tmp_path):
    folder = _small_corpus(tmp_path)
    barrier = threading.Barrier(4)

    def prepare(_: int) -> TokenCorpus:
        barrier.wait()
        return prepare_corpus([str(folder)], seq_len=32)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(prepare, range(4)))
    assert sum(not r.cached for r in results) == 1
    assert len({r.fingerprint for r in results}) == 1
    for r in results[1:]:
        np.testing.assert_array_equal(r.train, results[0].train)
    assert _leftover_temps(results[0].cache_dir) == []


def test_cache_root_precedence(tmp_path, monkeypatch):
    assert cache_root() == tmp_path / "cache"
    monkeypatch.delenv("SATURATE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "saturate"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "saturate"


def test_default_corpus_prepares_with_byte_tokenizer():
    files = default_corpus()
    assert len(files) > 50 and files == sorted(files)
    assert all(p.suffix == ".py" for p in files)
    corpus = prepare_corpus(None, seq_len=256)
    assert corpus.n_files == len(files)
    assert corpus.n_tokens > 1_000_000
    assert corpus.vocab_size == 257 and corpus.train.dtype == np.uint16
    assert len(corpus.train) + len(corpus.val) == corpus.n_tokens
    assert 0.09 < len(corpus.val) / corpus.n_tokens < 0.11
    assert prepare_corpus(None, seq_len=256).cached is True


def test_a_shard_folder_is_used_as_it_is_with_the_same_fingerprint(tmp_path):
    text = _write(tmp_path / "t" / "a.txt", "hello shards " * 400)
    from_text = prepare_corpus([str(text)], seq_len=16)
    from_folder = prepare_corpus([str(from_text.cache_dir)], seq_len=16)
    assert from_folder.fingerprint == from_text.fingerprint
    assert np.array_equal(from_folder.train, from_text.train) and np.array_equal(from_folder.val, from_text.val)
    assert prepare_corpus([str(from_text.cache_dir / "train.bin")], seq_len=16).fingerprint == from_text.fingerprint


def test_a_foreign_or_truncated_shard_given_as_data_is_a_data_error(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    np.arange(1000, dtype=np.uint16).tofile(folder / "train.bin")  # nanoGPT-style raw tokens: no header
    (folder / "val.bin").write_bytes(b"")
    with pytest.raises(DataError, match="train.bin is not a saturate token shard"):
        prepare_corpus([str(folder)], seq_len=16)
    write_shard(folder / "train.bin", np.arange(500, dtype=np.uint16) % 257,
                {"vocab_size": 257, "tokenizer": "byte", "source_hash": "x"})
    write_shard(folder / "val.bin", np.arange(100, dtype=np.uint16) % 257,
                {"vocab_size": 257, "tokenizer": "byte", "source_hash": "x"})
    with open(folder / "val.bin", "r+b") as f:
        f.truncate(f.seek(0, 2) - 10)
    with pytest.raises(DataError, match="val.bin is truncated"):
        prepare_corpus([str(folder / "train.bin")], seq_len=16)
