"""The presets by name, and `build_workload(name)`.

Every kind of workload is one module beside this one. The GPT presets are plain data (`gpt.PRESETS`);
the other kinds register a builder here as "module:function", imported only when that preset is
built, so an optional dependency (Transformers) is never imported for a preset that does not need it.
Adding a kind: write its module with a function returning a `Workload`, and add one line below.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from saturate.errors import ConfigError, unknown_name
from saturate.workloads.base import Workload
from saturate.workloads.gpt import PRESETS, gpt_workload

# Presets that are not GPTs: name -> (the "module:function" building its Workload, imported on use; description).
OTHER_PRESETS: dict[str, tuple[str, str]] = {
    "ts-lstm": ("saturate.workloads.timeseries:ts_lstm_workload",
                "an LSTM forecasting the next step of several series (synthetic, or a CSV via --data)"),
}


def preset_names() -> list[str]:
    return [*PRESETS, *OTHER_PRESETS]


def build_workload(
    preset: str = "gpt-tiny",
    *,
    data: Sequence[str] | None = None,
    tokenizer: str = "byte",
    text_field: str = "text",
    seed: int = 0,
    **overrides: Any,
) -> Workload:
    """A preset's Workload on its default data (data=None: the embedded corpus) or on the user's files.

    `overrides` replace fields of the preset's Optimization (e.g. steps=50, effective_batch=64) or
    parameters of its model (a GPT's n_layer, n_head, n_embd, seq_len; ts-lstm's hidden, window, …).
    """
    if preset not in PRESETS and preset not in OTHER_PRESETS:
        raise ConfigError(unknown_name("preset", preset, preset_names()))
    if preset in OTHER_PRESETS:
        module, _, function = OTHER_PRESETS[preset][0].partition(":")
        return getattr(importlib.import_module(module), function)(data=data, seed=seed, **overrides)
    return gpt_workload(preset, data=data, tokenizer=tokenizer, text_field=text_field, seed=seed, **overrides)
