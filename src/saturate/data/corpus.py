"""Which files make up a corpus, the documents in them, and a hash of their content."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import stat
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from saturate.errors import DataError

TEXT_SUFFIXES = (".txt", ".md", ".py")
JSONL_SUFFIX = ".jsonl"
DATA_SUFFIXES = (*TEXT_SUFFIXES, JSONL_SUFFIX)
_SUFFIX_LIST = "/".join(DATA_SUFFIXES)
_HASH_CHUNK = 1 << 20
_SNIFF = 1 << 16  # bytes read to tell text from binary (git reads 8000)

log = logging.getLogger(__name__)


def default_corpus() -> list[Path]:
    """The embedded default: the top-level ``*.py`` files of the Python standard library.

    They are on every machine that runs Python and need no download.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    if not files:
        raise DataError(f"default corpus: no *.py files in the standard library folder {stdlib}")
    return files


def resolve_paths(specs: Sequence[str], skipped: list[str] | None = None) -> list[Path]:
    """Expand files, folders (recursive) and globs into a sorted, de-duplicated list of data files.

    Files that cannot be training text are skipped with a warning naming each, and listed in `skipped`:
    special files (a FIFO would block the read for ever; sockets, devices) and binary files (NUL bytes
    in their first 64 KiB: an executable named `.txt`). When every file is skipped that is the error, in
    one line naming the first and why (not a warning per file, then "corpus is empty").
    """
    found: dict[str, Path] = {}
    left_out: list[tuple[Path, str]] = []
    for spec in specs:
        for path in _expand(str(spec)):
            if (why := _not_text(path)) is not None:
                left_out.append((path, why))
                continue
            # abspath, not resolve: keep the names the user gave (symlinks stay symlinks) but drop dups.
            found.setdefault(os.path.abspath(path), path)
    if left_out and not found:
        (first, why), more = left_out[0], len(left_out) - 1
        also = f" (and {more} more data file{'s' if more > 1 else ''}, all skipped)" if more else ""
        raise DataError(f"no text to train on: data file {first} is not text ({why}), so it was skipped{also}")
    for path, why in left_out:
        log.warning("saturate: warning: skipping data file %s: %s", path, why)
        if skipped is not None:
            skipped.append(f"{path} ({why})")
    return [Path(p) for p in sorted(found)]


def _not_text(path: Path) -> str | None:
    """Why `path` is not a text file to train on, or None. Never opens a special file (a FIFO blocks)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        raise DataError(f"cannot read data file '{path}': {err.strerror or err}") from None
    if not stat.S_ISREG(mode):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        return f"{kind}, not a regular file"
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF)
    except OSError as err:
        raise DataError(f"cannot read data file '{path}': {err.strerror or err}") from None
    if b"\0" in head:
        return "binary: it holds NUL bytes"
    return None


def _expand(spec: str) -> list[Path]:
    path = Path(spec).expanduser()
    if path.exists() and not path.is_dir() and not path.is_file():  # named explicitly: refused, never opened
        raise DataError(f"data path '{spec}' is {_not_text(path)}")
    if path.is_file():
        if path.suffix.lower() not in DATA_SUFFIXES:
            raise DataError(f"data file '{spec}' has suffix '{path.suffix}'; expected one of {_SUFFIX_LIST}")
        return [path]
    if path.is_dir():
        files = _walk(path)
        if not files:
            raise DataError(f"data folder '{spec}' matches no {_SUFFIX_LIST} files")
        return files
    if any(ch in spec for ch in "*?["):
        files = []
        for match in sorted(glob.glob(os.path.expanduser(spec), recursive=True)):
            m = Path(match)
            if m.is_dir():
                files.extend(_walk(m))
            elif m.is_file() and m.suffix.lower() in DATA_SUFFIXES:
                files.append(m)
        if not files:
            raise DataError(f"data path '{spec}' matches no {_SUFFIX_LIST} files")
        return files
    raise DataError(f"data path '{spec}' does not exist")


def _walk(folder: Path) -> list[Path]:
    files = []
    for root, dirs, names in os.walk(folder):
        # Hidden folders (.git, .venv, editor state) are never training text.
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files.extend(
            Path(root, n) for n in names if not n.startswith(".") and Path(n).suffix.lower() in DATA_SUFFIXES
        )
    return sorted(files)


def iter_documents(files: Sequence[Path], text_field: str = "text") -> Iterator[str]:
    """Yield each non-empty document: a whole text file, or one JSONL line's ``text_field``."""
    for path in files:
        path = Path(path)
        if path.suffix.lower() == JSONL_SUFFIX:
            yield from _iter_jsonl(path, text_field)
            continue
        try:
            text = path.read_bytes().decode("utf-8", errors="replace")
        except OSError as err:
            raise DataError(f"cannot read data file '{path}': {err.strerror or err}") from None
        if text:
            yield text


def _iter_jsonl(path: Path, text_field: str) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield from _parse_jsonl(path, f, text_field)
    except OSError as err:
        raise DataError(f"cannot read data file '{path}': {err.strerror or err}") from None


def json_object(line: str, where: str) -> dict[str, Any]:
    """One JSONL record, which must be a JSON object; a DataError naming `where` (file:line) otherwise."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


def _parse_jsonl(path: Path, lines: Iterable[str], text_field: str) -> Iterator[str]:
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record = json_object(line, f"{path}:{lineno}")
        if text_field not in record:
            keys = ", ".join(map(str, list(record)[:8])) or "none"
            raise DataError(f"{path}:{lineno}: no '{text_field}' field (keys: {keys})")
        text = record[text_field]
        if not isinstance(text, str):
            raise DataError(
                f"{path}:{lineno}: field '{text_field}' is {type(text).__name__}, expected a string"
            )
        if text:
            yield text


def content_hash(files: Sequence[Path], text_field: str) -> str:
    """sha256 over the files' bytes in order: renaming or touching a file keeps it, editing changes it."""
    h = hashlib.sha256()
    for path in files:
        path = Path(path)
        # The kind, not the suffix: a .txt renamed to .md gives the same documents, a .jsonl does not,
        # and the field read from a .jsonl decides which text it yields.
        is_jsonl = path.suffix.lower() == JSONL_SUFFIX
        h.update(f"jsonl:{text_field}\0".encode() if is_jsonl else b"text\0")
        try:
            with open(path, "rb") as f:
                # Length-prefix each file so no two different file lists hash alike by concatenation.
                h.update(os.fstat(f.fileno()).st_size.to_bytes(8, "little"))
                while chunk := f.read(_HASH_CHUNK):
                    h.update(chunk)
        except OSError as err:
            raise DataError(f"cannot read data file '{path}': {err.strerror or err}") from None
    return h.hexdigest()
