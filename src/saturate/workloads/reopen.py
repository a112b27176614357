"""`load_model(run_dir)`: a finished run's trained model, rebuilt and its exported weights loaded.

    a GPT preset run (lm or sft)   model.json (the GPTConfig, written beside model.safetensors) -> GPT
    an --hf run                    config.json and the tokenizer files -> Transformers' from_pretrained
    anything else                  load_model(run_dir, build=…): a function returning the untrained model
                                   (a custom workload's build_model), since only its code knows the model
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch.nn as nn

from saturate.errors import ConfigError
from saturate.workloads.base import Workload


def load_model(run_dir: str | Path, build: Callable[[], nn.Module] | Workload | None = None) -> nn.Module:
    """The model a run trained, on the CPU in fp32, in eval mode, with its model.safetensors loaded.

    `build` (a Workload, or a function returning the model) is needed only when the run folder cannot say
    how to rebuild the model: a --workload or Python-built model.
    """
    run_dir = Path(run_dir)
    weights = run_dir / "model.safetensors"
    if not run_dir.is_dir():
        raise ConfigError(f"load_model: {run_dir} is not a run folder (no such folder)")
    if not weights.is_file():
        raise ConfigError(f"load_model: {run_dir} has no model.safetensors; the run did not finish (continue it "
                          f"with: saturate train --resume --run-dir {run_dir})")
    if build is not None:
        model = build.build_model() if isinstance(build, Workload) else build()
    elif (run_dir / "model.json").is_file():
        model = _gpt(run_dir / "model.json")
    elif (run_dir / "config.json").is_file():
        from saturate.workloads.hf import transformers_module

        return transformers_module().AutoModelForCausalLM.from_pretrained(run_dir, local_files_only=True).eval()
    else:
        raise ConfigError(f"load_model: {run_dir} was trained from {_origin(run_dir)}, whose model only its code can "
                          "build: pass build=, a function returning the untrained model (or the Workload), e.g. "
                          "load_model(run_dir, build=saturate.load_workload('module:function').build_model)")
    from safetensors.torch import load_model as load_weights

    try:
        load_weights(model, str(weights))
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"load_model: {weights} does not fit the model built ({first[:200]})") from None
    return model.eval()


def _gpt(path: Path) -> nn.Module:
    from saturate.workloads.gpt import GPT, GPTConfig

    try:
        record = json.loads(path.read_text())
        if record.get("kind") != "saturate-gpt":
            raise ValueError(f"kind {record.get('kind')!r}, expected 'saturate-gpt'")
        return GPT(GPTConfig(**record["config"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"load_model: {path} is not a saturate model config ({e})") from None


def _origin(run_dir: Path) -> str:
    """How run.toml says the workload was made: 'the workload my.mod:fn', or its name."""
    from saturate.plan import tomllib

    try:
        work = tomllib.loads((run_dir / "run.toml").read_text()).get("workload", {})
    except (OSError, ValueError):
        return "a workload it does not name (no readable run.toml)"
    if work.get("workload"):
        return f"the workload {work['workload']}"
    return f"the workload {work.get('name', '?')!r}, built in Python"
