"""Chat / instruction fine-tuning (`--task sft`): the masked loss and the workloads over packed conversations.

The conversations are read, rendered with a chat template, packed into rows of `seq_len` tokens
and cached by saturate.data.chat; a training sample is one packed row.

The loss of a row is the mean over its response tokens; a batch's loss is the mean over its rows.
That keeps every micro-batch × accumulation split of a step equal (the engine's mean of micro-batch
means is then the mean over the step's rows), so the tuner may change the split without changing
what is learned.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from saturate.data.chat import (
    BUILTIN_TEMPLATE,
    IGNORE,
    PackedRows,
    builtin_jinja,
    jsonl_files,
    prepare,
    read_conversations,
)
from saturate.errors import ConfigError, DataError
from saturate.workloads.base import Optimization, Workload

Forward = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]  # (model, ids, positions) -> logits


class SFTLoss:
    """Per row, the mean cross-entropy over its response tokens; the batch loss is the mean over rows."""

    def __init__(self, forward: Forward) -> None:
        self.forward = forward

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["labels"]  # (B, T)
        logits = self.forward(model, batch["input_ids"], batch["position_ids"])  # (B, T, V)
        per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                                    reduction="none").view(labels.shape)
        targets = (labels != IGNORE).sum(-1).clamp(min=1)
        return (per_token.sum(-1) / targets).mean()


def gpt_forward(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids, position_ids=position_ids)


def sft_workload(name: str, data: Sequence[str] | None, tokenizer: Any, seq_len: int, *,
                 build_model: Callable[[], nn.Module], forward: Forward, flops_per_token: float | None,
                 optim: Optimization, seed: int = 0, model_identity: dict[str, Any] | None = None,
                 info: dict[str, Any] | None = None,
                 export_extras: Callable[[nn.Module, Path], list[Path]] | None = None) -> Workload:
    """A fine-tuning Workload over packed conversations, for any model with a `forward(model, ids, positions)`."""
    from saturate.workloads.custom import Epochs

    files = jsonl_files(data)
    train, val, meta = prepare(files, tokenizer, seq_len)
    val_rows = val[: optim.eval_samples] if len(val) else None
    if export_extras is not None and meta["template"].startswith(BUILTIN_TEMPLATE) and hasattr(tokenizer, "hf"):
        export_extras = _with_template(export_extras, tokenizer)  # the exported tokenizer renders what was trained
    return Workload(
        name=name,
        build_model=build_model,
        train_data=Epochs(PackedRows(train), seed=seed),
        val_data=PackedRows(val_rows) if val_rows is not None and len(val_rows) else None,
        loss_fn=SFTLoss(forward),
        optim=optim,
        tokens_per_sample=max(1, round(meta["real_tokens_per_row"])),  # measured: conversation tokens per row
        flops_per_sample=flops_per_token * seq_len if flops_per_token else None,
        identity={"model": model_identity or {}, "data": {"sft": meta["key"], "seed": seed}},
        info={**(info or {}), "task": "sft", "conversations": meta["conversations"],
              "rows": f"{meta['train_rows']} × {seq_len} tokens ({100 * meta['fill']:.0f} % filled)",
              "template": meta["template"], "tokenizer": tokenizer.name,
              **({"dropped": meta["dropped"]} if meta["dropped"] else {}),
              **({"truncated": meta["truncated"]} if meta["truncated"] else {})},
        export_extras=export_extras,
    )


def preset_sft_workload(preset: str, *, data: Sequence[str] | None, tokenizer: str = "byte", seed: int = 0,
                        **overrides: Any) -> Workload:
    """Fine-tune a GPT preset's shape on chat JSONL, with the byte tokenizer (or a BPE trained on the chats)."""
    from saturate.workloads.gpt import GPT, GPTConfig, export_config, flops_per_token, preset_with
    from saturate.workloads.registry import OTHER_PRESETS

    if preset in OTHER_PRESETS:
        raise ConfigError(f"--task sft fine-tunes a language model; {preset} is not one (use a gpt-* preset or --hf)")
    p, optim = preset_with(preset, overrides)
    tok = _preset_tokenizer(tokenizer, data)
    cfg = GPTConfig(n_layer=p.n_layer, n_head=p.n_head, n_embd=p.n_embd, seq_len=p.seq_len,
                    vocab_size=tok.vocab_size)
    return sft_workload(f"{preset}-sft", data, tok, cfg.seq_len, build_model=lambda: GPT(cfg), forward=gpt_forward,
                        flops_per_token=flops_per_token(cfg), optim=optim, seed=seed,
                        model_identity=cfg.to_dict(), info={"preset": preset},
                        export_extras=export_config(cfg, preset, tok.name))


def _preset_tokenizer(spec: str, data: Sequence[str] | None) -> Any:
    from saturate.data.corpus import content_hash
    from saturate.data.token_cache import cache_root
    from saturate.data.tokenizer import BPETokenizer, ByteTokenizer, parse_tokenizer_spec

    kind, vocab = parse_tokenizer_spec(spec)
    if kind == "byte":
        return ByteTokenizer()
    files = jsonl_files(data)
    key = hashlib.sha256(f"{content_hash(files, 'messages')}:{spec}".encode()).hexdigest()[:16]
    path = cache_root() / "sft" / f"bpe-{key}.json"
    if path.exists():
        try:
            return BPETokenizer.load(path)
        except DataError:
            pass
    texts = (m["content"] for c in read_conversations(files) for m in c)
    tok = BPETokenizer.train(texts, vocab)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(path)
    return tok


def _with_template(export: Callable[[nn.Module, Path], list[Path]], tokenizer: Any) -> Callable[..., list[Path]]:
    """`export`, then the built-in chat template written beside the tokenizer files it copied (as
    chat_template.jinja, and in tokenizer_config.json for Transformers that read it there)."""
    template = builtin_jinja(tokenizer.hf.convert_ids_to_tokens(tokenizer.eot_id))

    def write(model: nn.Module, out_dir: Path) -> list[Path]:
        from saturate.atomic import atomic_write_bytes

        written = export(model, out_dir)
        atomic_write_bytes(out_dir / "chat_template.jinja", template.encode())
        config = out_dir / "tokenizer_config.json"
        if config.is_file():
            data = json.loads(config.read_text())
            atomic_write_bytes(config, (json.dumps({**data, "chat_template": template}, indent=2) + "\n").encode())
        return [*written, out_dir / "chat_template.jinja"]

    return write
