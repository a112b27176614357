"""One Workload from a description of where it comes from: a preset, the user's Python, a local Hugging
Face folder, chat JSONL for fine-tuning, or a CSV of series. Every verb (train, tune, run, doctor, sweep)
goes through `from_source`, so each source works with all of them; the command line only parses flags
into a `Source` (see `saturate.cli.args`).

    preset       a registered preset (gpt-tiny, …, ts-lstm)
    workload     "module:function": the user's function returning a saturate.Workload
    hf           a causal LM from a local Transformers folder (config, weights, tokenizer)
    task         "lm" (next-token pretraining, default) or "sft" (chat/instruction fine-tuning)
    params       workload parameters (model shape, window, …, or the user function's keywords)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from saturate.errors import ConfigError
from saturate.workloads.base import Workload


@dataclass
class Source:
    """Where a workload comes from, as a user says it (flags, or a sweep's fixed settings)."""

    preset: str = "gpt-tiny"
    workload: str | None = None  # "module:function"
    hf: str | None = None  # a local Transformers folder
    task: str = "lm"
    data: Sequence[str] | None = None
    text_field: str = "text"
    tokenizer: str = "byte"
    effective_batch: int | None = None
    seed: int = 0
    params: dict[str, Any] = field(default_factory=dict)


def parse_value(text: str) -> Any:
    """'128' -> 128, '1e-3' -> 0.001, 'true' -> True, anything else stays a string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_params(items: Sequence[str]) -> dict[str, Any]:
    """["hidden=256", "lr=1e-3"] -> {"hidden": 256, "lr": 0.001}."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ConfigError(f"--param {item!r}: expected KEY=VALUE with KEY a name (e.g. hidden=256)")
        out[key] = parse_value(value)
    return out


def from_source(src: Source, params: Mapping[str, Any] | None = None) -> Workload:
    """The Workload `src` describes; `params` (a sweep point) override src.params.

    `batch_coupled` and `micro_batch` are taken by saturate for every source (workloads/coupling.py),
    never passed to the builder."""
    merged = {**src.params, **dict(params or {})}
    coupling = {k: merged.pop(k) for k in ("batch_coupled", "micro_batch") if k in merged}
    return with_coupling(_build(src, merged), coupling)


def _build(src: Source, merged: dict[str, Any]) -> Workload:
    from saturate.workloads.registry import build_workload

    effective, task = src.effective_batch, src.task or "lm"
    if src.workload and src.hf:
        raise ConfigError("--workload and --hf both name a model; give one")
    if src.workload:
        if task != "lm":
            raise ConfigError(f"--task {task} applies to presets and --hf models; a --workload builds its own data")
        from saturate.workloads.custom import load_workload

        return with_effective_batch(load_workload(src.workload, merged), effective)
    overrides = {**merged, **({"effective_batch": effective} if effective else {})}
    if src.hf:
        from saturate.workloads.hf import hf_workload

        return hf_workload(src.hf, task=task, data=src.data, text_field=src.text_field, tokenizer=src.tokenizer,
                           seed=src.seed, **overrides)
    if task == "sft":
        from saturate.workloads.sft import preset_sft_workload

        return preset_sft_workload(src.preset, data=src.data, tokenizer=src.tokenizer, seed=src.seed, **overrides)
    return build_workload(src.preset, data=src.data, tokenizer=src.tokenizer, text_field=src.text_field,
                          seed=src.seed, **overrides)


def with_coupling(w: Workload, params: dict[str, Any]) -> Workload:
    """Set `--param batch_coupled=` / `micro_batch=` on the workload, checked."""
    if "batch_coupled" in params:
        value = params["batch_coupled"]
        if not isinstance(value, bool):
            raise ConfigError(f"--param batch_coupled={value!r}: expected true or false")
        w.batch_coupled = value
    if "micro_batch" in params:
        value = params["micro_batch"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"--param micro_batch={value!r}: expected a whole number >= 1")
        w.micro_batch = value
    return w


def with_effective_batch(w: Workload, effective: int | None) -> Workload:
    if effective and effective != w.optim.effective_batch:
        w.optim = dataclasses.replace(w.optim, effective_batch=effective)
    return w
