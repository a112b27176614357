"""Tokenizers: raw UTF-8 bytes, or a byte-level BPE trained locally with Hugging Face `tokenizers`.

A tokenizer's ``name`` is its identity in cache keys and data fingerprints, so two tokenizers with
the same name must map every text to the same ids.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from saturate.atomic import atomic_write_bytes
from saturate.errors import ConfigError, DataError

EOT_TOKEN = "<|endoftext|>"
DEFAULT_BPE_VOCAB = 8192
MIN_BPE_VOCAB = 300  # 256 byte symbols + the end-of-text token + room for a few merges
MAX_BPE_VOCAB = 1_000_000


@runtime_checkable
class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, end-of-text as 256: nothing to train, nothing to save."""

    name = "byte"
    vocab_size = 257
    eot_id = 256

    def encode(self, text: str) -> np.ndarray:
        # frombuffer is a zero-copy view of the encoded bytes; callers widen it when they need to.
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() > self.eot_id):
            raise ValueError(f"ids must be in [0, {self.eot_id}], got {arr.min()}..{arr.max()}")
        # A model may emit a split multi-byte character or end-of-text mid-sample; neither should raise.
        return arr[arr != self.eot_id].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class BPETokenizer:
    """A byte-level BPE (GPT-2 style) held in a ``tokenizers.Tokenizer``; lossless on any text."""

    def __init__(self, hf_tokenizer, json_text: str, *, source: str = "<memory>") -> None:
        eot_id = hf_tokenizer.token_to_id(EOT_TOKEN)
        if eot_id is None:
            raise DataError(f"tokenizer {source} has no {EOT_TOKEN!r} token; it was not made by saturate")
        self._hf = hf_tokenizer
        # The name hashes the exact JSON we save, so a loaded tokenizer keeps the name it was saved under.
        self._json = json_text
        self.vocab_size: int = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        self.eot_id: int = eot_id
        digest = hashlib.sha256(json_text.encode("utf-8")).hexdigest()[:12]
        self.name: str = f"bpe-{self.vocab_size}-{digest}"

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Train on ``texts`` (any iterable, consumed once). The vocabulary may come out smaller
        than ``vocab_size`` when the text has fewer distinct merges to offer."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        hf = HFTokenizer(models.BPE())
        # No prefix space: encode/decode must round-trip the text exactly, including its first word.
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT_TOKEN],
            # All 256 byte symbols up front, so text unseen in training still encodes.
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(texts, trainer=trainer)
        return cls(hf, hf.to_str())

    @classmethod
    def load(cls, path: str | os.PathLike) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        try:
            json_text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise DataError(f"tokenizer file {path} does not exist") from None
        except (OSError, UnicodeDecodeError) as err:
            raise DataError(f"cannot read tokenizer file {path}: {err}") from None
        try:
            hf = HFTokenizer.from_str(json_text)
        except Exception as err:  # the Rust side raises plain Exception on malformed JSON
            raise DataError(f"{path} is not a valid tokenizer file: {err}") from None
        return cls(hf, json_text, source=str(path))

    def save(self, path: str | os.PathLike) -> None:
        try:
            atomic_write_bytes(path, self._json.encode("utf-8"))
        except OSError as err:
            raise DataError(f"cannot write tokenizer file {path}: {err}") from None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._hf.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Encode several texts at once; the Rust side spreads them over the CPU cores."""
        encodings = self._hf.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._hf.decode(np.asarray(ids, dtype=np.int64).reshape(-1).tolist())

    def __repr__(self) -> str:
        return f"BPETokenizer(name={self.name!r})"


def parse_tokenizer_spec(spec: str) -> tuple[str, int | None]:
    """``"byte"`` -> ``("byte", None)``; ``"bpe"`` -> ``("bpe", 8192)``; ``"bpe:N"`` -> ``("bpe", N)``."""
    kind, sep, arg = spec.strip().lower().partition(":")
    if kind == "byte" and not sep:
        return "byte", None
    if kind == "bpe":
        if not sep:
            return "bpe", DEFAULT_BPE_VOCAB
        try:
            vocab = int(arg)
        except ValueError:
            vocab = None
        if vocab is not None and MIN_BPE_VOCAB <= vocab <= MAX_BPE_VOCAB:
            return "bpe", vocab
        raise ConfigError(
            f"tokenizer {spec!r}: BPE vocabulary must be an integer in [{MIN_BPE_VOCAB}, {MAX_BPE_VOCAB}]"
        )
    raise ConfigError(f"tokenizer {spec!r} is not one of 'byte', 'bpe', 'bpe:<vocab>'")
