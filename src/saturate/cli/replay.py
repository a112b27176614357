"""`saturate train --config run.toml`: a run's settings (engine/runfile.py writes them) as the defaults of the
train command, so that flags given with --config win over the file.

The file is checked whole first: an unknown section or key is one line with the nearest known one ("did you
mean"), a missing or unreadable file one line. --data and --param given on the command line replace / extend
the file's (a --param of the same name wins); --plan replaces the file's [plan].
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from saturate.engine.runfile import RUN_KEYS, WORKLOAD_KEYS
from saturate.errors import ConfigError
from saturate.plan import Plan


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str], path: Path) -> argparse.Namespace:
    """Parse `argv` again with the run.toml at `path` as the train command's defaults."""
    settings = read_run_toml(path)
    train = _verb_parser(parser, "train")
    work, run = settings.get("workload", {}), settings.get("run", {})
    defaults: dict[str, Any] = {k: v for k, v in work.items() if k in WORKLOAD_KEYS and k not in ("data", "params")}
    defaults.update(run)  # [run]'s keys are the train flags' own names
    if "log_to" in defaults:
        defaults["log_to"] = ",".join(defaults["log_to"])
    defaults["param"] = [f"{k}={v}" for k, v in work.get("params", {}).items()]  # the flags' own --param follow
    saved = {a.dest: a.default for a in train._actions}
    train.set_defaults(**defaults)
    try:
        args = parser.parse_args(list(argv))
    finally:
        train.set_defaults(**{k: saved.get(k) for k in defaults})
    if args.data is None:
        args.data = work.get("data")
    args.config_plan = Plan.from_dict(settings["plan"], source=f"{path} [plan]") if "plan" in settings else None
    if work.get("python") and args.workload is None and args.hf is None:
        raise ConfigError(f"{path}: the workload {work.get('name', '')!r} was built in Python, not from flags; name it "
                          "with --workload MODULE:FUNCTION (or --hf PATH)")
    return args


def read_run_toml(path: Path) -> dict[str, Any]:
    """run.toml's tables, every key checked against what `train` knows."""
    from saturate.plan import read_toml

    path = Path(path)
    data = read_toml(path, f"--config {path}")
    plan_keys = [f for f in Plan.__dataclass_fields__ if f != "provenance"]
    known = {"workload": [*WORKLOAD_KEYS, "name", "python"], "run": list(RUN_KEYS), "plan": [*plan_keys, "provenance"]}
    for section, table in data.items():
        if section not in known:
            if homes := [f"[{name}]" for name, keys in known.items() if section in keys]:  # `steps = 5` at the top
                raise ConfigError(f"{path}: {section!r} is not a section but a key of {' or '.join(homes)}: "
                                  f"put it under {homes[0]}")
            raise ConfigError(f"{path}: unknown section [{section}]{_did_you_mean(section, known)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {section} must be a table ([{section}])")
        for key in table:
            if key not in known[section]:
                raise ConfigError(f"{path}: unknown key {key!r} in [{section}]{_did_you_mean(key, known[section])}")
    return data


def _did_you_mean(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(choices)})"


def _verb_parser(parser: argparse.ArgumentParser, verb: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[verb]
    raise KeyError(verb)
