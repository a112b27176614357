"""The policy in force: the default, or with `SATURATE_POLICY`'s fields changed (read once, at import)."""

from __future__ import annotations

import os
import sys
from typing import Any

from saturate.errors import ConfigError
from saturate.policy.thresholds import Policy

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENV = "SATURATE_POLICY"


def load_policy(path: str | None) -> Policy:
    """The default policy with the fields of the TOML file `path` changed (None or "": the default)."""
    if not path:
        return Policy()
    try:
        with open(path, "rb") as f:
            changes = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{ENV}={path}: cannot read it as TOML ({e})") from e
    try:
        return Policy().replaced(changes)
    except ValueError as e:
        raise ConfigError(f"{ENV}={path}: {e}") from e


def overridden() -> str | None:
    """The file the policy in force was read from, or None (the default)."""
    return os.environ.get(ENV) or None


def policy_record() -> dict[str, Any]:
    """What a tuning's JSON records of the policy it decided with: every field, and the file that changed any."""
    return {"policy": POLICY.to_dict(), "policy_file": overridden()}


def check() -> None:
    """Raise ConfigError, one line, when `SATURATE_POLICY` named a file that was refused (the command line calls it
    first; the default policy is in force meanwhile, so an import never fails on it)."""
    if PROBLEM is not None:
        raise ConfigError(PROBLEM)


try:
    POLICY: Policy = load_policy(overridden())
    PROBLEM: str | None = None
except ConfigError as _e:
    POLICY, PROBLEM = Policy(), str(_e)
