"""Arguments every verb shares, below the verbs: where the workload comes from, and number checks.

    add_workload_args(parser)   --preset, --data, --workload, --hf, --task, --param, --effective-batch, …
    source_from_args(args)      -> workloads.source.Source
    source_record(src), recorded_source(run_dir)   a run's Source in its run.json, for `--resume --run-dir R`
    workload_from_args(args)    -> Workload (params: a sweep point's overrides)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from saturate.workloads.base import Workload
from saturate.workloads.source import Source, from_source, parse_params


def add_workload_args(p: argparse.ArgumentParser) -> None:
    from saturate.workloads.registry import preset_names

    p.add_argument("--preset", default="gpt-tiny", metavar="NAME",
                   help=f"model preset: {', '.join(preset_names())} (default: gpt-tiny)")
    p.add_argument("--data", action="append", metavar="PATH",
                   help="text files, folders or globs of .txt/.md/.py/.jsonl; repeatable "
                        "(default: the Python standard library's source, always on the machine); "
                        "ts-lstm: one .csv of numeric columns; --task sft: .jsonl conversations")
    p.add_argument("--text-field", default="text", help="the JSONL field holding the text (default: text)")
    p.add_argument("--tokenizer", default="byte", help="byte (default), bpe or bpe:VOCAB, trained locally")
    p.add_argument("--effective-batch", type=positive(int, "--effective-batch"), metavar="N",
                   help="samples per optimizer step, kept exactly by every plan (default: the preset's)")
    p.add_argument("--device", help="cuda, mps or cpu (default: the best one found)")
    p.add_argument("--seed", type=seed_value, default=0, help="model initialisation and sampling seed (default: 0)")
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


def source_from_args(args: argparse.Namespace) -> Source:
    """The Source the common workload arguments describe (`saturate run PRESET` names the preset positionally)."""
    return Source(
        preset=getattr(args, "preset_arg", None) or args.preset, workload=args.workload, hf=args.hf,
        task=args.task or "lm", data=args.data, text_field=args.text_field, tokenizer=args.tokenizer,
        effective_batch=args.effective_batch, seed=args.seed, params=parse_params(args.param or []),
    )


def source_record(src: Source) -> dict[str, Any]:
    """`src` as JSON data for run.json, its paths made absolute so a resume from another folder finds them."""
    record = dataclasses.asdict(src)
    record["data"] = [os.path.abspath(os.path.expanduser(d)) for d in src.data] if src.data else None
    record["hf"] = os.path.abspath(os.path.expanduser(src.hf)) if src.hf else None
    if src.workload and ":" in src.workload:
        where, _, function = src.workload.rpartition(":")
        if where.endswith(".py") or os.sep in where:  # a file, not a module name
            record["workload"] = f"{os.path.abspath(os.path.expanduser(where))}:{function}"
    return record


def recorded_source(run_dir: Path) -> Source | None:
    """The Source a run recorded in its run.json (None when it recorded none: a run started from Python)."""
    try:
        record = json.loads((Path(run_dir) / "run.json").read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(record, dict):
        return None
    known = {f.name for f in dataclasses.fields(Source)}
    try:
        return Source(**{k: v for k, v in record.items() if k in known})
    except TypeError:
        return None


def workload_from_args(args: argparse.Namespace, params: Mapping[str, Any] | None = None) -> Workload:
    """The Workload the common workload arguments describe; `params` (a sweep point) override --param."""
    return from_source(source_from_args(args), params)


def seed_value(text: str) -> int:
    """An argparse type: a seed, an integer in [0, 2**64) (what torch and the sample hash take)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seed must be an integer, got {text!r}") from None
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"--seed must be between 0 and 2**64 - 1, got {text}")
    return value


def positive(kind: type, name: str) -> Any:
    """An argparse type: a number of `kind` that must be > 0."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{name} must be {what}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {text}")
        return value

    return parse
