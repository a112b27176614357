"""Token shards on disk: a validated header, then tokens memory-mapped straight into NumPy.

Layout of a shard::

    b"SATTOK\\x00\\x01"            8-byte magic (the last two bytes are the format generation)
    uint32 little-endian H        header length
    H bytes of UTF-8 JSON         metadata, space-padded so the tokens start on a 64-byte boundary
    n_tokens x uint16|uint32 LE   the token ids

The token cache that fills shards from text (``prepare_corpus``) is in token_cache.py.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from saturate.atomic import atomic_write
from saturate.errors import DataError

MAGIC = b"SATTOK\x00\x01"
FORMAT_VERSION = 1
REQUIRED_KEYS = ("version", "dtype", "n_tokens", "vocab_size", "tokenizer", "source_hash")
_PREFIX = len(MAGIC) + 4
_ALIGN = 64  # a cache line, and a multiple of every token dtype's size
_MAX_HEADER = 1 << 20  # a real header is a few hundred bytes; a bigger one means a foreign or corrupt file
_WRITE_CHUNK = 1 << 24  # tokens converted and written at a time, so writing never copies the whole array
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def shard_dtype(vocab_size: int) -> np.dtype:
    """The narrowest token dtype for ``vocab_size``: uint16 up to 65536 ids, else uint32."""
    return _DTYPES["uint16"] if vocab_size <= 1 << 16 else _DTYPES["uint32"]


def write_shard(path: Path, tokens: np.ndarray, meta: dict) -> None:
    """Write ``tokens`` with ``meta`` (which must hold ``vocab_size``) to ``path`` atomically."""
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be a 1-D integer array, got {tokens.dtype} with shape {tokens.shape}")
    if "vocab_size" not in meta:
        raise ValueError("shard metadata needs 'vocab_size'")
    vocab_size = int(meta["vocab_size"])
    dtype = shard_dtype(vocab_size)
    hi = -1
    if tokens.size:
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab_size:
            raise DataError(f"cannot write {path}: token ids span {lo}..{hi}, outside [0, {vocab_size})")
    header = {
        **meta,
        "version": FORMAT_VERSION,
        "dtype": dtype.name,
        "n_tokens": int(tokens.size),
        "vocab_size": vocab_size,
        "max_id": hi,  # checked against the vocabulary, and against the ids themselves, on every open
    }
    raw = json.dumps(header, sort_keys=True).encode("utf-8")
    raw += b" " * (-(_PREFIX + len(raw)) % _ALIGN)

    def write(f: BinaryIO) -> None:
        f.write(MAGIC)
        f.write(struct.pack("<I", len(raw)))
        f.write(raw)
        for start in range(0, tokens.size, _WRITE_CHUNK):
            f.write(np.ascontiguousarray(tokens[start : start + _WRITE_CHUNK], dtype=dtype).data)

    try:
        atomic_write(path, write)  # `path` is never seen half-written, even by a concurrent rank
    except OSError as err:
        raise DataError(f"cannot write token shard {path}: {err.strerror or err}") from None


@dataclass
class TokenShard:
    path: Path
    tokens: np.ndarray  # read-only np.memmap of n_tokens ids
    meta: dict

    def __len__(self) -> int:
        return len(self.tokens)


def open_shard(path: Path) -> TokenShard:
    """Map a shard read-only after checking its magic, header and size against each other."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(_PREFIX)
            if len(prefix) < _PREFIX or prefix[:6] != MAGIC[:6]:
                raise DataError(f"{path} is not a saturate token shard")
            if prefix[: len(MAGIC)] != MAGIC:
                raise DataError(f"{path} is a saturate token shard of an unknown format generation")
            (header_len,) = struct.unpack("<I", prefix[len(MAGIC) :])
            if header_len > _MAX_HEADER:
                raise DataError(f"{path} has a corrupt header (length {header_len})")
            if size < _PREFIX + header_len:
                raise DataError(
                    f"{path} is truncated: its {header_len}-byte header is cut short at {size} bytes"
                )
            raw = f.read(header_len)
    except FileNotFoundError:
        raise DataError(f"token shard {path} does not exist") from None
    except IsADirectoryError:
        raise DataError(f"{path} is not a saturate token shard") from None
    except OSError as err:
        raise DataError(f"cannot read token shard {path}: {err.strerror or err}") from None

    meta = _parse_header(path, raw)
    dtype = _DTYPES[meta["dtype"]]
    n_tokens = meta["n_tokens"]
    offset = _PREFIX + header_len
    expected = offset + n_tokens * dtype.itemsize
    if size < expected:
        held = (size - offset) // dtype.itemsize
        raise DataError(f"{path} is truncated: header says {n_tokens} tokens, file holds {held}")
    if size > expected:
        raise DataError(f"{path} is corrupt: {size - expected} bytes follow its {n_tokens} tokens")
    if n_tokens == 0:
        # mmap cannot map zero bytes; an empty read-only array stands in.
        tokens = np.zeros(0, dtype=dtype)
        tokens.flags.writeable = False
    else:
        tokens = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(n_tokens,))
    _check_ids(path, tokens, meta)
    return TokenShard(path=path, tokens=tokens, meta=meta)


def _check_ids(path: Path, tokens: np.ndarray, meta: dict) -> None:
    """Every id below the vocabulary: an id beyond it (a damaged file, shards of another tokenizer) would
    index past the model's embedding mid-run. One pass over the ids (memory bandwidth, in chunks)."""
    vocab, recorded = meta["vocab_size"], meta.get("max_id")
    if isinstance(recorded, int) and recorded >= vocab:
        raise DataError(f"{path} has a corrupt header: max_id {recorded} for vocab_size {vocab}")
    if vocab >= 1 << (8 * tokens.dtype.itemsize):
        return  # the dtype cannot hold an id beyond the vocabulary
    for start in range(0, len(tokens), _WRITE_CHUNK):
        chunk = tokens[start : start + _WRITE_CHUNK]
        if chunk.size and int(chunk.max()) >= vocab:
            at = start + int(np.argmax(chunk >= vocab))
            raise DataError(f"{path} holds token id {int(tokens[at])} at position {at}, beyond its vocabulary of "
                            f"{vocab} (a damaged shard, or one made with another tokenizer)")


def _parse_header(path: Path, raw: bytes) -> dict:
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path} has a corrupt header: {err}") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path} has a corrupt header: not a JSON object")
    missing = [k for k in REQUIRED_KEYS if k not in meta]
    if missing:
        raise DataError(f"{path} has a corrupt header: missing {', '.join(missing)}")
    if meta["version"] != FORMAT_VERSION:
        raise DataError(
            f"{path} has shard format version {meta['version']!r}; this saturate reads {FORMAT_VERSION}"
        )
    if meta["dtype"] not in _DTYPES:
        raise DataError(f"{path} has unknown token dtype {meta['dtype']!r}")
    for key in ("n_tokens", "vocab_size"):
        if not isinstance(meta[key], int) or isinstance(meta[key], bool) or meta[key] < 0:
            raise DataError(f"{path} has a corrupt header: {key} is {meta[key]!r}")
    if _DTYPES[meta["dtype"]] != shard_dtype(meta["vocab_size"]):
        raise DataError(
            f"{path} has a corrupt header: dtype {meta['dtype']} for vocab_size {meta['vocab_size']}"
        )
    return meta
