"""The one exception type the command line turns into a single line and a non-zero exit, and the wording of
an unknown name ("did you mean …") and of a file where a folder is wanted."""

from __future__ import annotations

import os
from collections.abc import Iterable


class SaturateError(Exception):
    """A problem the user can fix (bad config, bad data, impossible request, full disk).

    The message is one line that names the problem; the CLI prints it without a traceback
    unless ``--debug`` is given.
    """


class ConfigError(SaturateError, ValueError):
    """A Plan, preset or command-line value that is wrong."""


class DataError(SaturateError):
    """Missing, empty, unreadable or corrupt training data."""


class CheckpointError(SaturateError):
    """A checkpoint that cannot be written, read or resumed from."""


def file_not_folder(path: str | os.PathLike[str], what: str, flag: str, empty: bool = False) -> str | None:
    """One line when `path`, a folder a command is to write into, is an existing file (said as such, not as the
    "File exists" that mkdir would give), or with `empty` a folder holding anything; else None."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{what} {path} is a file, not a folder; choose another {flag}"
    if empty and os.path.isdir(path) and any(os.scandir(path)):
        return f"{what} {path} is not empty; choose another {flag}"
    return None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """" (did you mean 'gpt-tiny'?)" when `word` is close to one of `choices`, else ""."""
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_name(what: str, word: str, choices: Iterable[str]) -> str:
    """One line for an unknown name: "unknown preset 'gpt-tine' (did you mean 'gpt-tiny'?); known: a, b"."""
    choices = list(choices)
    return f"unknown {what} {word!r}{did_you_mean(word, choices)}; known: {', '.join(choices)}"
