"""The one exception type the command line turns into a single line and a non-zero exit."""


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
