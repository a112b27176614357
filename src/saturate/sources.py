"""Where a Workload comes from on the command line: a preset, the user's Python, a local Hugging Face
folder, chat JSONL for fine-tuning, or a CSV of series. Every verb (train, tune, run, doctor, sweep)
goes through `workload_from_args`, so each source works with all of them.

    --preset NAME                a registered preset (gpt-tiny, …, ts-lstm)
    --workload MODULE:FUNCTION   the user's function returning a saturate.Workload
    --hf PATH                    a causal LM from a local Transformers folder (config, weights, tokenizer)
    --task lm|sft                next-token pretraining (default) or chat/instruction fine-tuning
    --param KEY=VALUE            a workload parameter (model shape, window, …, or the user function's keyword)
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from saturate.errors import ConfigError
from saturate.workload import Workload


def add_source_args(p: argparse.ArgumentParser) -> None:
    """The flags that choose where the workload comes from (next to --preset and --data)."""
    p.add_argument("--workload", metavar="MODULE:FUNCTION",
                   help="your own workload: a function returning saturate.Workload (package.module:function or "
                        "path/to/file.py:function); replaces --preset")
    p.add_argument("--hf", metavar="PATH",
                   help="a causal language model from a local Hugging Face folder (config.json, optional weights "
                        "and tokenizer files); nothing is downloaded")
    p.add_argument("--task", choices=("lm", "sft"), default="lm",
                   help="lm: next-token training on text (default); sft: chat/instruction fine-tuning on --data "
                        "JSONL (messages or prompt/response records), loss on the responses only")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a workload parameter, repeatable: a preset's shape or optimisation field (n_embd=128, "
                        "lr=1e-3, window=90, hidden=256) or a keyword of your --workload function")


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
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ConfigError(f"--param {item!r}: expected KEY=VALUE with KEY a name (e.g. hidden=256)")
        out[key] = parse_value(value)
    return out


def workload_from_args(args: argparse.Namespace, params: Mapping[str, Any] | None = None) -> Workload:
    """The Workload the common workload arguments describe; `params` (a sweep point) override --param."""
    from saturate.workload import build_workload

    merged = {**parse_params(getattr(args, "param", None) or []), **dict(params or {})}
    effective = getattr(args, "effective_batch", None)
    task = getattr(args, "task", "lm") or "lm"
    preset = getattr(args, "preset_arg", None) or args.preset
    spec, hf_path = getattr(args, "workload", None), getattr(args, "hf", None)
    if spec and hf_path:
        raise ConfigError("--workload and --hf both name a model; give one")
    if spec:
        if task != "lm":
            raise ConfigError(f"--task {task} applies to presets and --hf models; a --workload builds its own data")
        from saturate.byo import load_workload

        w = load_workload(spec, merged)
        return with_effective_batch(w, effective)
    overrides = {**merged, **({"effective_batch": effective} if effective else {})}
    if hf_path:
        from saturate.hf import hf_workload

        return hf_workload(hf_path, task=task, data=args.data, text_field=args.text_field, tokenizer=args.tokenizer,
                           seed=args.seed, **overrides)
    if task == "sft":
        from saturate.sft import preset_sft_workload

        return preset_sft_workload(preset, data=args.data, tokenizer=args.tokenizer, seed=args.seed, **overrides)
    return build_workload(preset, data=args.data, tokenizer=args.tokenizer, text_field=args.text_field,
                          seed=args.seed, **overrides)


def with_effective_batch(w: Workload, effective: int | None) -> Workload:
    if effective and effective != w.optim.effective_batch:
        w.optim = dataclasses.replace(w.optim, effective_batch=effective)
    return w
