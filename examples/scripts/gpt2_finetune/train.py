"""GPT-2 fine-tuning written the way the ROCm guide's job was before tuning: a Hugging Face
`Trainer` with `per_device_train_batch_size=8`, `gradient_accumulation_steps=1`, no loader workers,
fp32 and plain (unfused) AdamW. It never imports saturate:

    python train.py --size small --max-steps 200
    saturate doctor -- python train.py --size small      # why is it slow?
    saturate tune -- python train.py --size small        # the TrainingArguments to change, measured

The model is GPT-2 built from a `GPT2Config` (no download); the text is some of the Python standard
library's source (or the files under --data), as bytes: token ids 0..255, no tokenizer to fetch.
`--size toy` is a model small enough for tests on a CPU.
"""

import argparse
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

# (layers, heads, width): the guide's tiny (~50M), small (117M) and medium (345M) GPT-2, and a toy for tests
SIZES = {"toy": (2, 2, 64), "tiny": (6, 8, 512), "small": (12, 12, 768), "medium": (24, 16, 1024)}


class ByteWindows(Dataset):
    """Consecutive windows of `max_length` bytes of a text; labels are the inputs (the model shifts them)."""

    def __init__(self, data: bytes, max_length: int) -> None:
        self.data, self.max_length = data, max_length

    def __len__(self) -> int:
        return len(self.data) // self.max_length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.tensor(list(self.data[i * self.max_length:(i + 1) * self.max_length]), dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def read_bytes(paths: list[str]) -> bytes:
    if not paths:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        paths = [str(p) for p in sorted(stdlib.glob("*.py"))[:60]]
    return b"\n".join(Path(p).read_bytes() for p in paths)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--max-length", type=int, default=256, help="tokens per sample (the guide's MAX_LENGTH)")
    parser.add_argument("--max-steps", type=int, default=500)
    parser.add_argument("--data", nargs="*", default=[])
    parser.add_argument("--output-dir", default="gpt2-finetuned")
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    args = parser.parse_args()

    set_seed(42)
    n_layer, n_head, n_embd = SIZES[args.size]
    config = GPT2Config(vocab_size=256, n_positions=max(args.max_length, 64), n_embd=n_embd, n_layer=n_layer,
                        n_head=n_head, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    train_dataset = ByteWindows(read_bytes(args.data), args.max_length)

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        dataloader_num_workers=0,
        learning_rate=5e-5,
        warmup_steps=min(100, args.max_steps // 10),
        max_steps=args.max_steps,
        fp16=args.fp16,
        gradient_checkpointing=args.gradient_checkpointing,
        optim="adamw_torch",
        logging_steps=10,
        save_strategy="steps",
        save_steps=args.max_steps,
        report_to="none",
        seed=42,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset)
    trainer.train()
    trainer.save_model()
    print(f"saved {training_args.output_dir}")


if __name__ == "__main__":
    main()
