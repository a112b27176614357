"""The one exception type the command line turns into a single line and a non-zero exit, and the wording of
an unknown name ("did you mean …")."""

from __future__ import annotations

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


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """" (did you mean 'gpt-tiny'?)" when `word` is close to one of `choices`, else ""."""
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_name(what: str, word: str, choices: Iterable[str]) -> str:
    """One line for an unknown name: "unknown preset 'gpt-tine' (did you mean 'gpt-tiny'?); known: a, b"."""
    choices = list(choices)
    return f"unknown {what} {word!r}{did_you_mean(word, choices)}; known: {', '.join(choices)}"
