"""The token cache: text tokenised once into a train shard and a validation shard, keyed by content.

``prepare_corpus`` caches the shards under a key derived from the corpus content, the tokenizer and
the split, so every later run (and every torchrun rank) maps the same files instead of tokenising
again; concurrent builders of one key take a lock and build once. ``load_shard_folder`` uses shards
made elsewhere as they are. The shard format itself is in shards.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import secrets
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from saturate.data.corpus import content_hash, default_corpus, iter_documents, resolve_paths
from saturate.data.shards import FORMAT_VERSION, TokenShard, open_shard, shard_dtype, write_shard
from saturate.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, parse_tokenizer_spec
from saturate.errors import ConfigError, DataError

try:
    import fcntl
except ImportError:  # Windows: no advisory locks, but temp file + os.replace still keeps files whole
    fcntl = None

log = logging.getLogger(__name__)

_ENCODE_BATCH_CHARS = 1 << 22


@dataclass
class TokenCorpus:
    train: np.ndarray = field(repr=False)  # memmap of the training tokens
    val: np.ndarray = field(repr=False)  # memmap of the validation tokens (the end of the stream)
    tokenizer: Tokenizer
    vocab_size: int
    fingerprint: str  # identifies the data exactly, for resume checks
    n_files: int
    n_tokens: int  # train + val, end-of-text separators included
    cache_dir: Path  # folder holding train.bin, val.bin (and tokenizer.json for BPE)
    cached: bool  # True when the shards were already there and nothing was tokenised
    skipped: list[str] = field(default_factory=list)  # data files left out, each with why (binary, a FIFO…)


def cache_root() -> Path:
    """``$SATURATE_CACHE``, else ``$XDG_CACHE_HOME/saturate``, else ``~/.cache/saturate``."""
    if os.environ.get("SATURATE_CACHE"):
        return Path(os.environ["SATURATE_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "saturate"
    return Path.home() / ".cache" / "saturate"


def prepare_corpus(
    paths: Sequence[str] | None,
    *,
    tokenizer: str | Tokenizer = "byte",
    seq_len: int,
    val_fraction: float = 0.1,
    text_field: str = "text",
    cache_dir: Path | None = None,
) -> TokenCorpus:
    """Tokenise ``paths`` (default: the standard library's source) once into cached train/val shards.

    ``cache_dir`` replaces :func:`cache_root`; shards live in ``<cache_dir>/tokens/<key>/`` where the
    key hashes the file contents, the tokenizer spec, ``val_fraction`` and the shard format.
    ``tokenizer`` is a spec (``byte``, ``bpe[:N]``) or a ready Tokenizer (a Hugging Face one, say),
    whose ``name`` identifies it in the key.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ConfigError(f"seq_len must be a positive integer, got {seq_len!r}")
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction!r}")
    given: Tokenizer | None = None
    if isinstance(tokenizer, str):
        kind, vocab = parse_tokenizer_spec(tokenizer)
        spec = kind if vocab is None else f"{kind}:{vocab}"
    else:
        given, kind, vocab, spec = tokenizer, "given", None, tokenizer.name
    if (folder := _shard_folder(paths)) is not None:
        return load_shard_folder(folder, seq_len=seq_len, tokenizer=given)
    skipped: list[str] = []
    if paths is None:
        files, described = default_corpus(), "(the Python standard library)"
    else:
        files = resolve_paths(paths, skipped)
        described = repr(", ".join(map(str, paths)))
    if not files:
        raise DataError("corpus is empty: no data paths were given")

    source_hash = content_hash(files, text_field)
    key = _sha256_json(
        {"source": source_hash, "tokenizer": spec, "val_fraction": val_fraction, "format": FORMAT_VERSION}
    )
    folder = (Path(cache_dir) if cache_dir is not None else cache_root()) / "tokens" / key[:16]
    want = _CacheKey(
        kind=kind, spec=spec, source_hash=source_hash, seq_len=seq_len, val_fraction=val_fraction, given=given
    )

    found, _ = _open_cached(folder, want)
    cached = found is not None
    if not cached:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise DataError(f"cache folder {folder} is not writable: {err.strerror or err}") from None
        with _build_lock(folder):
            # Another process (a torchrun rank) may have built it while we waited for the lock.
            found, reason = _open_cached(folder, want)
            cached = found is not None
            if not cached:
                if reason:
                    log.warning("rebuilding token cache %s: %s", folder, reason)
                try:
                    _build(folder, files, text_field, want, vocab, described)
                except BaseException:
                    if {p.name for p in folder.iterdir()} <= {".lock"}:  # nothing built: no lock-only folder
                        shutil.rmtree(folder, ignore_errors=True)
                    raise
                found, reason = _open_cached(folder, want)
                if found is None:
                    raise DataError(f"token cache {folder} cannot be read back after writing: {reason}")

    train, val, tok = found
    n_train, n_val = len(train), len(val)
    fingerprint = _corpus_fingerprint(source_hash, tok.name, val_fraction, n_train, n_val)
    return TokenCorpus(
        train=train.tokens,
        val=val.tokens,
        tokenizer=tok,
        vocab_size=tok.vocab_size,
        fingerprint=fingerprint,
        n_files=len(files),
        n_tokens=n_train + n_val,
        cache_dir=folder,
        cached=cached,
        skipped=skipped,
    )


def _corpus_fingerprint(source_hash: str, tokenizer_name: str, val_fraction: float | None, n_train: int,
                        n_val: int) -> str:
    # The same corpus has the same fingerprint whether it was read as text or as its shard folder.
    return _sha256_json({"source": source_hash, "tokenizer": tokenizer_name, "val_fraction": val_fraction,
                         "format": FORMAT_VERSION, "split": [n_train, n_val]})


def _shard_folder(paths: Sequence[str] | None) -> Path | None:
    """A pre-tokenised corpus: one folder holding train.bin and val.bin, or one of those two files."""
    if paths is None or len(paths) != 1:
        return None
    path = Path(paths[0]).expanduser()
    if path.suffix == ".bin":
        return path.parent
    return path if path.is_dir() and (path / "train.bin").exists() else None


def load_shard_folder(folder: Path, *, seq_len: int, tokenizer: Tokenizer | None = None) -> TokenCorpus:
    """Use token shards as they are (a saturate cache folder, or shards made with write_shard).

    With `tokenizer`, the shards must have been made by it (same name)."""
    train, val = open_shard(folder / "train.bin"), open_shard(folder / "val.bin")
    tm, vm = train.meta, val.meta
    if (tm["tokenizer"], tm["vocab_size"]) != (vm["tokenizer"], vm["vocab_size"]):
        raise DataError(f"{folder}: train.bin ({tm['tokenizer']}) and val.bin ({vm['tokenizer']}) were made "
                        "with different tokenizers")
    if tokenizer is not None:
        if tokenizer.name != tm["tokenizer"]:
            raise DataError(f"{folder}: the shards were made with tokenizer {tm['tokenizer']}, not the model's "
                            f"{tokenizer.name}")
        tok: Tokenizer = tokenizer
    elif tm["tokenizer"] == "byte":
        tok = ByteTokenizer()
    else:
        tok = BPETokenizer.load(folder / "tokenizer.json")  # a missing file is a DataError naming it
        if tok.name != tm["tokenizer"]:
            raise DataError(f"{folder}/tokenizer.json is {tok.name} but the shards were made with {tm['tokenizer']}")
    if tok.vocab_size != tm["vocab_size"]:
        raise DataError(f"{folder}: shards say vocab_size {tm['vocab_size']}, "
                        f"tokenizer {tok.name} has {tok.vocab_size}")
    for shard in (train, val):
        if len(shard) < seq_len + 1:
            raise DataError(f"{shard.path} holds {len(shard)} tokens; a sequence needs {seq_len + 1}")
    return TokenCorpus(
        train=train.tokens,
        val=val.tokens,
        tokenizer=tok,
        vocab_size=tok.vocab_size,
        fingerprint=_corpus_fingerprint(tm["source_hash"], tok.name, tm.get("val_fraction"), len(train), len(val)),
        n_files=int(tm.get("n_files", 0)),
        n_tokens=len(train) + len(val),
        cache_dir=folder,
        cached=True,
    )


@dataclass(frozen=True)
class _CacheKey:
    kind: str
    spec: str
    source_hash: str
    seq_len: int
    val_fraction: float
    given: Tokenizer | None = field(default=None, compare=False)  # kind "given": a ready tokenizer

    def split(self, n_tokens: int) -> tuple[int, int]:
        """(n_train, n_val): the last val_fraction of the stream, and at least seq_len + 1 tokens."""
        # The epsilon keeps float noise (0.7 * 10 = 7.000000000000001) from taking an extra token.
        n_val = max(math.ceil(n_tokens * self.val_fraction - 1e-9), self.seq_len + 1)
        return n_tokens - n_val, n_val

    def min_tokens(self) -> int:
        need = self.seq_len + 1
        n = max(2 * need, int(need / (1.0 - self.val_fraction)))
        while self.split(n)[0] < need:
            n += 1
        return n


_Cached = tuple[TokenShard, TokenShard, Tokenizer]


def _open_cached(folder: Path, want: _CacheKey) -> tuple[_Cached | None, str]:
    """The cached shards and tokenizer if they are whole and belong together, else (None, why not)."""
    train_path, val_path = folder / "train.bin", folder / "val.bin"
    if not (train_path.exists() and val_path.exists()):
        return None, ""
    try:
        train, val = open_shard(train_path), open_shard(val_path)
        if want.given is not None:
            tok = want.given
        else:
            tok = BPETokenizer.load(folder / "tokenizer.json") if want.kind == "bpe" else ByteTokenizer()
    except DataError as err:
        return None, str(err)
    tm, vm = train.meta, val.meta
    # The build id ties the two shards to one build: a reader racing a rebuild must not pair an old
    # val.bin with a new train.bin, nor shards with a tokenizer.json from another training run.
    belongs = (
        tm.get("build_id") is not None
        and tm.get("build_id") == vm.get("build_id")
        and tm.get("split") == "train"
        and vm.get("split") == "val"
        and tm["source_hash"] == vm["source_hash"] == want.source_hash
        and tm.get("tokenizer_spec") == vm.get("tokenizer_spec") == want.spec
        and tm["tokenizer"] == vm["tokenizer"] == tok.name
        and tm["vocab_size"] == vm["vocab_size"] == tok.vocab_size
    )
    if not belongs:
        return None, "its shards and tokenizer do not belong to one build of this corpus"
    # Only a corpus so small that seq_len + 1 outweighs val_fraction splits differently per seq_len.
    if want.split(len(train) + len(val)) != (len(train), len(val)):
        return None, ""
    return (train, val, tok), ""


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """Serialise builders of one cache folder, so concurrent ranks tokenise once, not once each."""
    try:
        fd = os.open(folder / ".lock", os.O_WRONLY | os.O_CREAT, 0o666)
    except OSError as err:
        raise DataError(f"cache folder {folder} is not writable: {err.strerror or err}") from None
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when the descriptor closes, even on a crash
        yield
    finally:
        os.close(fd)


def _build(
    folder: Path, files: Sequence[Path], text_field: str, want: _CacheKey, vocab: int | None, described: str
) -> None:
    if want.given is not None:
        tok: Tokenizer = want.given
    elif want.kind == "bpe":
        tok = BPETokenizer.train(iter_documents(files, text_field), vocab)
    else:
        tok = ByteTokenizer()
    stream = _tokenize(files, text_field, tok)
    if stream.size == 0:
        raise DataError(f"corpus {described} is empty: its {len(files)} file(s) hold no text")
    n_train, n_val = want.split(stream.size)
    if n_train < want.seq_len + 1:
        raise DataError(
            f"corpus {described} has {stream.size} tokens; need at least {want.min_tokens()} for a train split and a "
            f"validation split of seq_len+1 ({want.seq_len + 1}) tokens each"
        )
    if isinstance(tok, BPETokenizer):
        tok.save(folder / "tokenizer.json")  # before the shards: a reader checks shards against it
    meta = {
        "tokenizer": tok.name,
        "tokenizer_spec": want.spec,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "source_hash": want.source_hash,
        "val_fraction": want.val_fraction,
        "n_files": len(files),
        "build_id": secrets.token_hex(8),
    }
    write_shard(folder / "train.bin", stream[:n_train], {**meta, "split": "train"})
    write_shard(folder / "val.bin", stream[n_train:], {**meta, "split": "val"})


def _tokenize(files: Sequence[Path], text_field: str, tok: Tokenizer) -> np.ndarray:
    """All documents encoded and joined with end-of-text between them, in the shard dtype.

    Peak memory is two copies of the stream: the per-document pieces and the joined array.
    """
    dtype = shard_dtype(tok.vocab_size)
    parts: list[np.ndarray] = []

    def keep(ids: np.ndarray) -> None:
        ids = np.asarray(ids)
        # Check before narrowing: a cast to uint16 would wrap a bad id silently.
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= tok.vocab_size):
            raise DataError(f"tokenizer {tok.name} produced ids outside [0, {tok.vocab_size})")
        parts.append(ids.astype(dtype, copy=False))

    encode_batch = getattr(tok, "encode_batch", None)
    batch: list[str] = []
    batch_chars = 0
    for doc in iter_documents(files, text_field):
        if encode_batch is None:
            keep(tok.encode(doc))
            continue
        # Batches let a Rust tokenizer use every core, and bound the text held at once.
        batch.append(doc)
        batch_chars += len(doc)
        if batch_chars >= _ENCODE_BATCH_CHARS:
            for ids in encode_batch(batch):
                keep(ids)
            batch, batch_chars = [], 0
    if batch:
        for ids in encode_batch(batch):
            keep(ids)

    parts = [p for p in parts if p.size]
    total = sum(p.size for p in parts) + max(len(parts) - 1, 0)
    stream = np.empty(total, dtype=dtype)
    pos = 0
    for i, part in enumerate(parts):
        if i:
            stream[pos] = tok.eot_id
            pos += 1
        stream[pos : pos + part.size] = part
        pos += part.size
    return stream


def _sha256_json(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode("utf-8")).hexdigest()
