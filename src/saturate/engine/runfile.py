"""run.toml: how a run was started, written (atomically) into its folder by every `train`/`run`, so that
`saturate train --config run.toml` replays it (`saturate.cli.replay` reads it back).

    [workload]  where the model and data come from: preset, workload (MODULE:FUNCTION), hf, task, data (absolute
                paths), text_field, tokenizer, effective_batch, and [workload.params] (--param); a workload built
                in Python records only its name (python = true)
    [run]       steps, minutes, seed, device, log_every, eval_every, ckpt_every, keep, log_to, early_stop
    [plan]      the plan's settings at the start (an OOM or host-memory relief later is in plan.toml)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomli_w

from saturate.atomic import atomic_write_bytes

HEADER = "# How this run was started. Replay it with: saturate train --config run.toml (flags given with it win)\n"
WORKLOAD_KEYS = ("preset", "workload", "hf", "task", "data", "text_field", "tokenizer", "effective_batch", "params")
RUN_KEYS = ("steps", "minutes", "seed", "device", "log_every", "eval_every", "ckpt_every", "keep", "log_to",
            "early_stop")


def run_settings(cfg: Any, workload_name: str, plan: dict[str, Any], device: str, eval_every: int,
                 ckpt_every: int, total_steps: int) -> dict[str, Any]:
    """The run's settings as run.toml holds them (None left out: TOML has no null)."""
    source = cfg.source
    if source is None:
        work: dict[str, Any] = {"name": workload_name, "python": True}
    else:
        work = {k: source.get(k) for k in WORKLOAD_KEYS}
    run = {
        "steps": cfg.steps if cfg.steps is not None or cfg.minutes is None else total_steps,
        "minutes": cfg.minutes, "seed": cfg.seed, "device": device, "log_every": cfg.log_every,
        "eval_every": eval_every, "ckpt_every": ckpt_every, "keep": cfg.keep_checkpoints,
        "log_to": list(dict.fromkeys(n for n in (["tensorboard"] if cfg.tensorboard else []) + list(cfg.log_to)
                                     if isinstance(n, str))),
        "early_stop": cfg.early_stop,
    }
    return _no_none({"workload": work, "run": run, "plan": {k: v for k, v in plan.items() if k != "provenance"}})


def recorded_cadence(run_dir: Path) -> dict[str, int]:
    """The cadence a run recorded in its run.toml ([run] log_every, eval_every, ckpt_every, keep), as RunConfig
    fields, for a resume that does not set its own; {} when the file is missing or unreadable."""
    from saturate.errors import ConfigError
    from saturate.plan import read_toml

    try:
        run = read_toml(Path(run_dir) / "run.toml", "run.toml").get("run", {})
    except ConfigError:  # missing or unreadable: the defaults
        return {}
    fields = {"log_every": "log_every", "eval_every": "eval_every", "ckpt_every": "ckpt_every",
              "keep": "keep_checkpoints"}
    return {field: run[key] for key, field in fields.items()
            if isinstance(run, dict) and type(run.get(key)) is int and run[key] >= 1}


def write_run_toml(path: Path, settings: dict[str, Any]) -> None:
    atomic_write_bytes(path, (HEADER + tomli_w.dumps(settings)).encode())


def _no_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _no_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}
