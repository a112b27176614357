"""Hugging Face Transformers causal LMs from local files: `--hf PATH`.

PATH is a folder as `save_pretrained` writes it: `config.json`, optionally weights
(`model.safetensors`, sharded or `.bin`) and tokenizer files. With weights the model is loaded
(`from_pretrained`), without them it is initialised from the config (`from_config`). Nothing is
ever downloaded: HF_HUB_OFFLINE is set before Transformers is imported and every load passes
`local_files_only=True`.

The model runs with SDPA attention where its class supports it (else eager, and the run says so);
activation checkpointing goes through the model's own switch. Text is tokenised by the folder's
tokenizer into saturate's cached token shards (the cache key holds a hash of the tokenizer's
files), so the sampling, resume and tuning are the same as for the GPT presets. A tokenizer with
more tokens than the model's embedding has rows is refused before anything trains.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from saturate.errors import ConfigError, DataError, unknown_name
from saturate.workloads.base import Optimization, Workload
from saturate.workloads.chunked_loss import chunk_rows, linear_cross_entropy

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt",
                   "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
# The ROCm guide's GPT-2 fine-tuning: micro-batch 32 × accumulation 4 at 2e-4 (shared/GUIDES.md §3).
DEFAULT_OPTIM = Optimization(effective_batch=128, lr=2e-4, warmup_steps=100, steps=1000, eval_every=100,
                             weight_decay=0.01)


def transformers_module() -> Any:
    """Import Transformers in offline mode; a clear error when it is not installed."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # before the import: huggingface_hub reads it once
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    try:
        import transformers
    except ImportError:
        raise ConfigError("--hf needs Hugging Face Transformers: pip install 'saturate[hf]' "
                          "(or pip install transformers)") from None
    transformers.logging.set_verbosity_error()  # config/loss-type chatter; errors still raise
    transformers.logging.disable_progress_bar()  # "Loading weights" bars on every model build
    return transformers


class HFTokenizer:
    """A Transformers tokenizer behind saturate's Tokenizer protocol (name, vocab_size, eot_id, encode…)."""

    def __init__(self, tokenizer: Any, folder: Path) -> None:
        self.hf = tokenizer
        tokenizer.model_max_length = int(1e30)  # documents are cut into windows later, not here
        digest = hashlib.sha256()
        for name in TOKENIZER_FILES:  # the identity of the tokenizer: its files' contents
            if (folder / name).is_file():
                digest.update(name.encode() + (folder / name).read_bytes())
        self.vocab_size: int = len(tokenizer)
        eot = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id
        if eot is None:
            raise DataError(f"--hf {folder}: the tokenizer has no end-of-text (eos) token to separate documents")
        self.eot_id: int = int(eot)
        self.name: str = f"hf-{self.vocab_size}-{digest.hexdigest()[:12]}"
        self.chat_template: str | None = getattr(tokenizer, "chat_template", None)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.hf(text, add_special_tokens=False)["input_ids"], dtype=np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # A fast tokenizer's Rust backend directly, when it would give what the Transformers call gives (no
        # truncation or padding of its own, which the call would switch off): the call builds offsets, masks and a
        # BatchEncoding per text, 1.7x the backend's time on the 1.1M-token peers corpus (3.3 s against 2.0 s).
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is not None and backend.truncation is None and backend.padding is None:
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # fast: no offsets (tokenizers 0.21)
            return [np.asarray(e.ids, dtype=np.int64) for e in encode(list(texts), add_special_tokens=False)]
        return [np.asarray(ids, dtype=np.int64) for ids in self.hf(list(texts), add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self.hf.decode(np.asarray(ids, dtype=np.int64).reshape(-1).tolist())

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r})"


@dataclass
class HFFolder:
    """What a local Transformers folder holds, read once."""

    path: Path
    config: Any
    weights: list[Path]  # empty: initialise from the config
    tokenizer: HFTokenizer | None
    attention: str  # "sdpa", or "eager" where the model class has no SDPA
    parameters: int
    non_embedding_parameters: int  # without position embeddings (for FLOPs)
    fingerprint: dict[str, str]

    @property
    def vocab_rows(self) -> int:
        return int(self.config.vocab_size)

    @property
    def max_positions(self) -> int | None:
        for key in ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"):
            v = getattr(self.config, key, None)
            if isinstance(v, int) and v > 0:
                return v
        return None

    def build(self) -> nn.Module:
        """A fresh model on the CPU in fp32 (loaded from the weights, or initialised from the config)."""
        tf = transformers_module()
        if self.weights:
            model = tf.AutoModelForCausalLM.from_pretrained(self.path, local_files_only=True, dtype=torch.float32,
                                                            attn_implementation=self.attention)
        else:
            model = tf.AutoModelForCausalLM.from_config(self.config, attn_implementation=self.attention)
        model.config.use_cache = False  # training: no key/value cache
        model.set_activation_checkpointing = _checkpointing_switch(model)  # the Stepper's hook
        _loss_forward(model)  # `hf_lm_loss`'s forward, whole or in chunks of logits (plan.loss_chunk)
        return model.float()

    def export_extras(self, model: nn.Module, out_dir: Path) -> list[Path]:
        """config.json (and the folder's tokenizer files, when they tokenized the data) beside the exported
        model.safetensors, so `AutoModelForCausalLM.from_pretrained(run_dir)` opens the trained model."""
        from saturate.atomic import atomic_write_bytes

        config = model.config.to_dict()
        config["use_cache"] = True  # off only for training
        written = [out_dir / "config.json"]
        atomic_write_bytes(written[0], (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
        if self.tokenizer is not None:
            for name in TOKENIZER_FILES + ("chat_template.jinja",):
                if (self.path / name).is_file():
                    atomic_write_bytes(out_dir / name, (self.path / name).read_bytes())
                    written.append(out_dir / name)
        return written

    def flops_per_token(self, seq_len: int) -> float | None:
        """6·N + 12·L·C·T (as for saturate's GPT), from the config; None when it lacks the fields."""
        layers = getattr(self.config, "num_hidden_layers", None)
        width = getattr(self.config, "hidden_size", None)
        if not isinstance(layers, int) or not isinstance(width, int):
            return None
        return 6.0 * self.non_embedding_parameters + 12.0 * layers * width * seq_len


def _checkpointing_switch(model: Any) -> Any:
    def set_activation_checkpointing(enabled: bool) -> None:
        if not enabled:
            (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
        elif hasattr(model, "activation_checkpointing_enable"):  # Transformers 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    return set_activation_checkpointing


# Config fields that change the logits after the output projection (Gemma's softcapping, Cohere's scale, …): with
# any set, the chunked loss (a plain linear map, then cross-entropy) would not be the model's.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _loss_forward(model: Any) -> None:
    """Give the model a forward that, called with `saturate_targets`, returns the mean cross-entropy — from the
    whole logits as the model makes them, or, after `set_loss_chunk(n)`, from its last hidden states through
    `workloads.chunked_loss` n rows at a time (the logits never whole). Without targets it is the model's own."""
    plain = model.forward
    chunk: list[int | None] = [None]

    def forward(*args: Any, saturate_targets: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if saturate_targets is None:
            return plain(*args, **kwargs)
        if chunk[0] is None:
            logits = plain(*args, **kwargs).logits
            return F.cross_entropy(logits.view(-1, logits.size(-1)), saturate_targets.reshape(-1))
        hidden = model.base_model(*args, **kwargs).last_hidden_state
        return linear_cross_entropy(hidden, model.get_output_embeddings().weight, saturate_targets, chunk[0])

    def set_loss_chunk(n: int | None) -> None:
        head = model.get_output_embeddings()
        changed = [k for k in LOGIT_TRANSFORMS if getattr(model.config, k, None) not in (None, 1, 1.0)]
        if n is not None and (not isinstance(head, nn.Linear) or head.bias is not None or changed):
            why = f"its config sets {changed[0]}" if changed else "its output layer is not a linear map without bias"
            raise ConfigError(f"plan.loss_chunk: {type(model).__name__}'s logits are not its last hidden states "
                              f"times the output weights ({why})")
        chunk[0] = n

    model.forward = forward
    model.set_loss_chunk = set_loss_chunk


def open_folder(path: str | os.PathLike[str]) -> HFFolder:
    """Read a local Transformers folder; every problem is one ConfigError naming it."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"--hf {path}: no such folder")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"--hf {folder}: no config.json (a Hugging Face model folder holds config.json, and "
                          "optionally weights and tokenizer files, as save_pretrained writes them)")
    tf = transformers_module()
    try:
        config = tf.AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as e:
        raise ConfigError(f"--hf {folder}/config.json cannot be read: {_first_line(e)}") from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"--hf {folder}: model type {config.model_type!r} is not a causal language model "
                          "Transformers can build (AutoModelForCausalLM)")
    weights = [folder / n for n in WEIGHT_FILES if (folder / n).is_file()]
    tokenizer = _tokenizer(tf, folder)
    if tokenizer is None and weights:
        raise ConfigError(f"--hf {folder}: weights but no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, …); "
                          "trained weights need the tokenizer they were trained with")
    if tokenizer is not None and tokenizer.vocab_size > int(config.vocab_size):
        raise ConfigError(f"--hf {folder}: the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding "
                          f"has {config.vocab_size} rows; the tokenizer does not belong to this model")
    attention, parameters, non_embedding = _shape(tf, config, folder)
    weight_hash = hashlib.sha256()
    for w in weights:  # the weights' identity, for resume checks: size and a hash of their first MiB
        weight_hash.update(f"{w.name}:{w.stat().st_size}".encode())
        with open(w, "rb") as f:
            weight_hash.update(f.read(1 << 20))
    fingerprint = {"config": hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()[:16],
                   "weights": weight_hash.hexdigest()[:16] if weights else "none", "attention": attention}
    return HFFolder(folder, config, weights, tokenizer, attention, parameters, non_embedding, fingerprint)


def _tokenizer(tf: Any, folder: Path) -> HFTokenizer | None:
    if not any((folder / n).is_file() for n in TOKENIZER_FILES[:5]):
        return None
    try:
        tok = tf.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:
        raise ConfigError(f"--hf {folder}: the tokenizer files cannot be loaded: {_first_line(e)}") from None
    return HFTokenizer(tok, folder)


def _shape(tf: Any, config: Any, folder: Path) -> tuple[str, int, int]:
    """The attention implementation to use and the parameter counts, from a model built on the meta device."""
    for attention in ("sdpa", "eager"):
        try:
            with torch.device("meta"):
                model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
            break
        except (ValueError, ImportError):
            continue
        except Exception as e:
            raise ConfigError(f"--hf {folder}: the model cannot be built from its config: {_first_line(e)}") from None
    else:
        raise ConfigError(f"--hf {folder}: the model cannot be built with SDPA or eager attention")
    params = {id(p): (n, p.numel()) for n, p in model.named_parameters()}  # tied weights counted once
    total = sum(n for _, n in params.values())
    positions = sum(n for name, n in params.values() if re.search(r"wpe|position_embed|embed_positions", name))
    return attention, total, total - positions


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def hf_lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy; batch is (inputs, targets), each (B, T), already shifted."""
    x, y = batch
    return model(input_ids=x, use_cache=False, saturate_targets=y)


def hf_workload(path: str | os.PathLike[str], *, task: str = "lm", data: Sequence[str] | None = None,
                text_field: str = "text", tokenizer: str = "byte", seed: int = 0, **params: Any) -> Workload:
    """A causal LM from a local folder, trained on `data` (text for task "lm", chat JSONL for "sft").

    params: seq_len (default: the model's context, at most 1024) and any Optimization field.
    `tokenizer` (a saturate spec) is used only when the folder has no tokenizer and no weights.
    """
    from saturate.data.loaders import FixedWindows, RandomWindows
    from saturate.data.token_cache import prepare_corpus

    optim_keys = {f.name for f in dataclasses.fields(Optimization)}
    unknown = sorted(set(params) - optim_keys - {"seq_len"})
    if unknown:
        raise ConfigError("--hf: " + unknown_name("parameter", unknown[0], ["seq_len", *sorted(optim_keys)]))
    hf = open_folder(path)
    seq_len = params.pop("seq_len", None) or min(hf.max_positions or 1024, 1024)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ConfigError(f"--hf {hf.path}: seq_len must be an integer >= 2, got {seq_len!r}")
    if hf.max_positions is not None and seq_len > hf.max_positions:
        raise ConfigError(f"--hf {hf.path}: seq_len {seq_len} is longer than the model's {hf.max_positions} positions")
    optim = DEFAULT_OPTIM.with_values(params, f"--hf {hf.path}")
    tok: Any = hf.tokenizer if hf.tokenizer is not None else tokenizer
    name = "hf-" + (re.sub(r"[^A-Za-z0-9._+-]", "-", hf.path.resolve().name).lstrip(".-_+") or "model")
    info = {"hf": str(hf.path), "model_type": hf.config.model_type, "parameters": f"{hf.parameters:,}",
            "weights": "local" if hf.weights else "none (initialised from config.json)", "attention": hf.attention}
    if task == "sft":
        from saturate.workloads.sft import sft_workload

        masking = getattr(transformers_module(), "masking_utils", None)
        if not hasattr(masking, "find_packed_sequence_indices"):
            raise ConfigError("--task sft with --hf needs Transformers >= 4.56 (it keeps packed conversations apart "
                              "by their position ids); pip install -U 'saturate[hf]'")

        chat_tok = tok if not isinstance(tok, str) else _saturate_tokenizer(tok, hf)
        return sft_workload(f"{name}-sft", data, chat_tok, seq_len, build_model=hf.build, forward=hf_forward,
                            flops_per_token=hf.flops_per_token(seq_len), optim=optim, seed=seed,
                            model_identity={"hf": hf.fingerprint}, info=info, export_extras=hf.export_extras)
    if task != "lm":
        raise ConfigError(f"--task {task}: expected lm or sft")
    corpus = prepare_corpus(data, tokenizer=tok, seq_len=seq_len, text_field=text_field)
    if corpus.vocab_size > hf.vocab_rows:
        raise ConfigError(f"--hf {hf.path}: tokenizer {corpus.tokenizer.name} has {corpus.vocab_size} tokens but the "
                          f"model's embedding has {hf.vocab_rows} rows")
    info.update({"tokenizer": corpus.tokenizer.name, "corpus_tokens": corpus.n_tokens, "seq_len": seq_len})
    per_token = hf.flops_per_token(seq_len)
    return Workload(
        name=name,
        build_model=hf.build,
        train_data=RandomWindows(corpus.train, seq_len, seed=seed),
        val_data=FixedWindows(corpus.val, seq_len, n=optim.eval_samples),
        loss_fn=hf_lm_loss,
        optim=optim,
        tokens_per_sample=seq_len,
        flops_per_sample=per_token * seq_len if per_token else None,
        loss_chunk_rows=chunk_rows(hf.vocab_rows),
        sdpa=hf.attention == "sdpa",
        identity={"model": {"hf": hf.fingerprint}, "data": {"corpus": corpus.fingerprint, "seed": seed,
                                                             "seq_len": seq_len}},
        info=info,
        guide_plans=("rocm-after",),  # the guide that fine-tunes GPT-2 through Transformers
        export_extras=hf.export_extras,
    )


def hf_forward(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Logits for packed rows: position ids that restart at 0 mark each sequence, and Transformers
    (>= 4.56) then masks attention to stay inside it (its packed-sequence detection)."""
    return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


def _saturate_tokenizer(spec: str, hf: HFFolder) -> Any:
    from saturate.data.tokenizer import ByteTokenizer, parse_tokenizer_spec

    kind, _ = parse_tokenizer_spec(spec)
    if kind != "byte":
        raise ConfigError(f"--hf {hf.path} --task sft: the folder has no tokenizer; only --tokenizer byte can stand "
                          "in for one in fine-tuning")
    if hf.vocab_rows < ByteTokenizer.vocab_size:
        raise ConfigError(f"--hf {hf.path}: the byte tokenizer needs {ByteTokenizer.vocab_size} embedding rows, the "
                          f"model has {hf.vocab_rows}")
    return ByteTokenizer()
