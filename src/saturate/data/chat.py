"""Chat / instruction data for fine-tuning (`--task sft`): conversations packed into fixed token budgets.

Input: JSONL records, one conversation each — `{"messages": [{"role": …, "content": …}, …]}`
(`conversations` with `from`/`value` is read too) or `{"prompt": …, "response": …}` (optionally
`system`). Each conversation is rendered with a chat template (the tokenizer's own when it has one,
else a plain `<|role|>` template) and tokenised once; only the assistant's tokens are targets.

Batching by token budget, without padding everything to the longest: conversations are packed
whole into rows of exactly `seq_len` positions (best-fit decreasing, so sequences of similar
length end up together and rows are nearly full). Position ids restart at 0 for each conversation
and attention stays inside it (saturate's GPT builds the block-diagonal causal mask from them;
Transformers ≥ 4.56 detects the packed sequences the same way), so a packed row trains exactly as
its conversations would alone. The packing is deterministic and cached by content, tokenizer and
template: a training "sample" is one packed row, read in epochs reshuffled by seed, so the engine,
the tuner's memory fit (fixed-size samples) and exact resume are those of pretraining.

The masked loss and the workloads built on these rows are in saturate/workloads/sft.py.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from saturate.atomic import atomic_path, atomic_write_bytes
from saturate.data.corpus import json_object
from saturate.data.loaders import MappedTokens
from saturate.errors import ConfigError, DataError

FORMAT = 1
IGNORE = -100  # label of a position that is not a target
ROLES = {"system", "user", "assistant", "tool"}
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}
BUILTIN_TEMPLATE = "builtin-1"  # "<|role|>\ncontent\n" per message; the assistant's content ends with end-of-text


def builtin_jinja(end_of_text: str) -> str:
    """The built-in template as a Transformers chat template (Jinja), `end_of_text` the tokenizer's token that
    ends a response: exported with a fine-tuned model, so `apply_chat_template` renders what it was trained on."""
    return ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>\n{{ m['content'] }}"
            + end_of_text.replace("{", "{{ '{' }}")
            + "\n{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

Message = dict[str, str]


# --- reading ----------------------------------------------------------------------------------------


def jsonl_files(paths: Sequence[str] | None) -> list[Path]:
    if not paths:
        raise ConfigError("--task sft needs --data: JSONL files (or folders of them) with one conversation per line")
    files: list[Path] = []
    for spec in paths:
        path = Path(spec).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.jsonl") if not any(part.startswith(".") for part in p.parts))
            if not found:
                raise DataError(f"data folder {path} holds no .jsonl files")
            files.extend(found)
        elif path.is_file():
            if path.suffix.lower() != ".jsonl":
                raise DataError(f"data file {path}: --task sft reads .jsonl conversations, not {path.suffix or 'that'}")
            files.append(path)
        else:
            raise DataError(f"data path {path} does not exist")
    return files


def read_conversations(files: Sequence[Path]) -> list[list[Message]]:
    """Every record as a list of {role, content}; a malformed record is a DataError naming file and line."""
    out: list[list[Message]] = []
    for path in files:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"cannot read {path}: {e}") from None
        for n, line in enumerate(lines, 1):
            if line.strip():
                out.append(parse_record(line, f"{path}:{n}"))
    if not out:
        raise DataError(f"no conversations in {', '.join(map(str, files))}")
    return out


def parse_record(line: str, where: str) -> list[Message]:
    record = json_object(line, where)
    if "messages" in record or "conversations" in record:
        raw = record.get("messages", record.get("conversations"))
        if not isinstance(raw, list) or not raw:
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        messages = [_message(m, f"{where}: message {i + 1}") for i, m in enumerate(raw)]
    elif "prompt" in record and ("response" in record or "completion" in record):
        response = record.get("response", record.get("completion"))
        messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
        messages += [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": response}]
        answer = "response" if "response" in record else "completion"
        field = {"system": "system", "user": "prompt", "assistant": answer}
        for m in messages:
            if not isinstance(m["content"], str):
                raise DataError(f"{where}: '{field[m['role']]}' must be a string")
    else:
        keys = ", ".join(sorted(map(str, record))[:6]) or "none"
        raise DataError(f"{where}: a record needs 'messages' (a list of {{role, content}}) or 'prompt' and "
                        f"'response'; it has: {keys}")
    if not any(m["role"] == "assistant" and m["content"] for m in messages):
        raise DataError(f"{where}: no assistant message with content; nothing to learn from this record")
    return messages


def _message(m: Any, where: str) -> Message:
    if not isinstance(m, dict):
        raise DataError(f"{where} must be an object with 'role' and 'content'")
    role, content = m.get("role", m.get("from")), m.get("content", m.get("value"))
    if not isinstance(role, str) or not isinstance(content, str):
        raise DataError(f"{where} needs string 'role' and 'content' (or 'from' and 'value'); it has: "
                        f"{', '.join(sorted(map(str, m)))}")
    role = ROLE_ALIASES.get(role.lower(), role.lower())
    if role not in ROLES:
        raise DataError(f"{where} has role {role!r}; expected one of {', '.join(sorted(ROLES))}")
    return {"role": role, "content": content}


# --- templates -------------------------------------------------------------------------------------


class ChatFormat:
    """Turns a conversation into token ids and a mask of the response tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.uses_tokenizer_template = bool(template)
        self.name = (f"tokenizer-{hashlib.sha256(template.encode()).hexdigest()[:12]}" if template
                     else BUILTIN_TEMPLATE)

    def encode(self, messages: list[Message]) -> tuple[np.ndarray, np.ndarray]:
        ids: list[np.ndarray] = []
        mask: list[np.ndarray] = []

        def add(text: str, target: bool) -> None:
            if text:
                part = np.asarray(self.tok.encode(text), dtype=np.int64)
                ids.append(part)
                mask.append(np.full(len(part), target))

        if self.uses_tokenizer_template:
            self._with_template(messages, add)
        else:
            for m in messages:
                if m["role"] == "assistant":
                    add("<|assistant|>\n", False)
                    add(m["content"], True)
                    ids.append(np.array([self.tok.eot_id]))
                    mask.append(np.array([True]))  # learn to stop
                    add("\n", False)
                else:
                    add(f"<|{m['role']}|>\n{m['content']}\n", False)
        return np.concatenate(ids), np.concatenate(mask)

    def _with_template(self, messages: list[Message], add: Callable[[str, bool], None]) -> None:
        """The tokenizer's template, rendered one message at a time: the text each message adds is its
        span, and an assistant message's span after the generation prompt is the response."""
        render = self.tok.render_chat
        done = ""
        for k, m in enumerate(messages):
            if m["role"] == "assistant":
                head = render(messages[:k], add_generation_prompt=True) if k else ""
                full = render(messages[: k + 1])
                if not (head.startswith(done) and full.startswith(head)):
                    raise _NotIncremental
                add(head[len(done):], False)
                add(full[len(head):], True)
            else:
                full = render(messages[: k + 1])
                if not full.startswith(done):
                    raise _NotIncremental
                add(full[len(done):], False)
            done = full


class _NotIncremental(Exception):
    """The tokenizer's chat template renders a prefix of a conversation differently from the whole."""


# --- packing ---------------------------------------------------------------------------------------


@dataclass
class Packed:
    rows: np.ndarray  # (R, 3, T) int32: input ids, labels (IGNORE where no target), position ids
    conversations: int
    dropped: int  # conversations with no response token within the first seq_len + 1 tokens
    truncated: int
    real_tokens: int  # positions holding a conversation (not padding)
    target_tokens: int


def pack(encoded: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int) -> Packed:
    """Best-fit decreasing: conversations (as input/target pairs) into rows of seq_len positions."""
    items: list[tuple[np.ndarray, np.ndarray]] = []
    dropped = truncated = 0
    for ids, mask in encoded:
        if len(ids) > seq_len + 1:
            ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
            truncated += 1
        labels = np.where(mask[1:], ids[1:], IGNORE)
        if len(ids) < 2 or not (labels != IGNORE).any():
            dropped += 1
            continue
        items.append((ids[:-1], labels))
    if not items:
        return Packed(np.zeros((0, 3, seq_len), np.int32), len(encoded), dropped, truncated, 0, 0)
    order = sorted(range(len(items)), key=lambda i: (-len(items[i][0]), i))  # longest first, then file order
    free: list[tuple[int, int]] = []  # (free positions, row) kept sorted: the best fit is a bisect away
    rows: list[list[int]] = []
    for i in order:
        n = len(items[i][0])
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            space, row = free.pop(at)
        else:
            space, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(i)
        if space - n > 0:
            bisect.insort(free, (space - n, row))
    out = np.empty((len(rows), 3, seq_len), dtype=np.int32)
    real = targets = 0
    for r, members in enumerate(rows):
        pos = 0
        for i in members:
            ids, labels = items[i]
            n = len(ids)
            out[r, 0, pos : pos + n] = ids
            out[r, 1, pos : pos + n] = labels
            out[r, 2, pos : pos + n] = np.arange(n)
            pos += n
            targets += int((labels != IGNORE).sum())
        real += pos
        out[r, 0, pos:] = pad_id
        out[r, 1, pos:] = IGNORE
        out[r, 2, pos:] = np.arange(seq_len - pos)  # padding is its own sequence: nothing attends to it
    return Packed(out, len(encoded), dropped, truncated, real, targets)


class PackedRows(MappedTokens, Dataset):
    """Row i of a packed split as {"input_ids", "labels", "position_ids"}, each (seq_len,) int64."""

    def __init__(self, rows: np.ndarray) -> None:
        self.tokens = rows  # named for MappedTokens: spawn workers map the cached file, not a copy

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = torch.from_numpy(np.asarray(self.tokens[index], dtype=np.int64))
        return {"input_ids": row[0], "labels": row[1], "position_ids": row[2]}


# --- cache -----------------------------------------------------------------------------------------


def prepare(files: Sequence[Path], tokenizer: Any, seq_len: int, val_fraction: float = 0.1,
            cache: Path | None = None) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Packed train and validation rows (memory-mapped) and their statistics, built once per content."""
    from saturate.data.corpus import content_hash
    from saturate.data.token_cache import cache_root

    fmt = ChatFormat(tokenizer)
    key_src = {"source": content_hash(list(files), "messages"), "tokenizer": tokenizer.name, "template": fmt.name,
               "seq_len": seq_len, "val_fraction": val_fraction, "format": FORMAT}
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:16]
    folder = (cache or cache_root()) / "sft" / key
    meta_path = folder / "meta.json"
    if meta_path.exists():
        try:
            meta = json.loads(meta_path.read_text())
            train = np.load(folder / "train.npy", mmap_mode="r")
            val = np.load(folder / "val.npy", mmap_mode="r")
            if meta.get("key") == key and train.shape[1:] == val.shape[1:] == (3, seq_len):
                return train, val, meta | {"cached": True}
        except (OSError, ValueError):
            pass  # damaged: rebuilt below, never trusted
    conversations = read_conversations(files)
    n_val = max(1, round(val_fraction * len(conversations))) if len(conversations) >= 2 else 0
    split = len(conversations) - n_val
    encoded, fallback = _encode_all(conversations, fmt, tokenizer)
    if any(int(ids.max()) >= tokenizer.vocab_size for ids, _ in encoded):
        raise DataError(f"tokenizer {tokenizer.name} produced ids outside its vocabulary of {tokenizer.vocab_size}")
    train, val = pack(encoded[:split], seq_len, tokenizer.eot_id), pack(encoded[split:], seq_len, tokenizer.eot_id)
    if len(train.rows) == 0:
        raise DataError(f"no training conversation has a response within the first {seq_len + 1} tokens "
                        f"({train.dropped} dropped); raise seq_len or shorten the prompts")
    meta = {"key": key, "key_source": key_src, "template": fallback or fmt.name,
            "conversations": len(conversations), "train_rows": len(train.rows), "val_rows": len(val.rows),
            "dropped": train.dropped + val.dropped, "truncated": train.truncated + val.truncated,
            "real_tokens_per_row": train.real_tokens / len(train.rows),
            "target_tokens": train.target_tokens, "fill": train.real_tokens / (len(train.rows) * seq_len)}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, rows in (("train.npy", train.rows), ("val.npy", val.rows)):
            with atomic_path(folder / name) as tmp, open(tmp, "wb") as f:
                np.save(f, rows)
        atomic_write_bytes(meta_path, json.dumps(meta, indent=1).encode())  # last: marks the folder complete
    except OSError as e:
        raise DataError(f"cannot write the packed conversations to {folder}: {e.strerror or e}") from None
    return (np.load(folder / "train.npy", mmap_mode="r"), np.load(folder / "val.npy", mmap_mode="r"),
            meta | {"cached": False})


def _encode_all(conversations: list[list[Message]], fmt: ChatFormat,
                tokenizer: Any) -> tuple[list[tuple[np.ndarray, np.ndarray]], str | None]:
    try:
        return [fmt.encode(c) for c in conversations], None
    except _NotIncremental:
        plain = ChatFormat.__new__(ChatFormat)
        plain.tok, plain.uses_tokenizer_template, plain.name = tokenizer, False, BUILTIN_TEMPLATE
        note = f"{BUILTIN_TEMPLATE} (the tokenizer's chat template does not render conversations incrementally)"
        return [plain.encode(c) for c in conversations], note
