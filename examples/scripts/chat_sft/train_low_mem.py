"""Chat fine-tuning written the way the low-memory guide's job was before tuning, launched with Accelerate:

    accelerate launch --multi_gpu --num_processes 3 train_low_mem.py train [--is_keep_training=True]
    saturate doctor -- accelerate launch --multi_gpu --num_processes 3 train_low_mem.py train

16 conversations per process × accumulation 8, pinned memory off, and the guide's fixed host-RAM
thresholds: with less than 12 GB available it raises the accumulation and turns off loader workers
(else 4 workers), below 8 GB an "ultra low memory" mode also shortens the sequences. It resumes from
its latest saved state (scheduler included) with `--is_keep_training=True`. It never imports saturate.

The model is a small Llama built from a `LlamaConfig` (no download); the text is byte-level (ids
0..255 plus four chat tokens); the conversations are `chat.jsonl` beside this file (`make_data.py`).
On a machine without a GPU, `ACCELERATE_USE_CPU=1` runs the processes on the CPU (gloo).
`--size toy` is a model small enough for tests on a CPU.
"""

import argparse
import json
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup

USER, ASSISTANT, END, PAD = 256, 257, 258, 259  # chat tokens after the 256 byte ids
SIZES = {"toy": (1, 2, 32), "small": (4, 4, 256), "medium": (12, 12, 768)}  # layers, heads, width
HERE = Path(__file__).resolve().parent


def available_ram_gb() -> float:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) / 2**20


class ChatDataset(Dataset):
    """Conversations tokenised on every read: user turns masked out of the labels (-100), padded to max_length."""

    def __init__(self, path: Path, max_length: int) -> None:
        with open(path) as f:
            self.conversations = [json.loads(line)["messages"] for line in f if line.strip()]
        self.max_length = max_length

    def __len__(self) -> int:
        return len(self.conversations)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, labels = [], []
        for message in self.conversations[i]:
            role = USER if message["role"] == "user" else ASSISTANT
            text = list(message["content"].encode("utf-8")) + [END]
            ids += [role] + text
            labels += [-100] + (text if role == ASSISTANT else [-100] * len(text))
        ids, labels = ids[:self.max_length], labels[:self.max_length]
        pad = self.max_length - len(ids)
        return {"input_ids": torch.tensor(ids + [PAD] * pad),
                "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
                "labels": torch.tensor(labels + [-100] * pad)}


def latest_state(folder: Path, processes: int) -> Path | None:
    """The newest state every process finished saving: a Ctrl-C can land in the middle of `save_state`, which
    writes each process's RNG state last."""
    states = sorted(folder.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    done = [p for p in states if all((p / f"random_states_{rank}.pkl").exists() for rank in range(processes))]
    return done[-1] if done else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["train"])
    parser.add_argument("--is_keep_training", default="False", choices=["True", "False"])
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--data", default=str(HERE / "chat.jsonl"))
    parser.add_argument("--batch-size", type=int, default=16, help="conversations per process and micro-step")
    parser.add_argument("--grad-accum", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--num-workers", default="auto", help="auto: the guide's host-RAM thresholds")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--output-dir", default="chat-sft-out")
    args = parser.parse_args()

    free = available_ram_gb()
    accum, max_length, workers = args.grad_accum, args.max_length, 4
    if free < 12:  # the guide's fixed thresholds: less RAM, more accumulation, no workers
        accum, workers = accum * 2, 0
    if free < 8:
        print(f"ultra low memory mode ({free:.1f} GB available)")
        max_length = min(max_length, 192)
    if args.num_workers != "auto":
        workers = int(args.num_workers)

    accelerator = Accelerator(gradient_accumulation_steps=accum)
    set_seed(42)
    accelerator.print(f"batch {args.batch_size} × {accelerator.num_processes} processes × accumulation {accum}, "
                      f"{workers} workers, max length {max_length}, {free:.1f} GB RAM available")
    n_layer, n_head, width = SIZES[args.size]
    config = LlamaConfig(vocab_size=260, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=n_layer,
                         num_attention_heads=n_head, num_key_value_heads=n_head, max_position_embeddings=max_length,
                         pad_token_id=PAD, bos_token_id=USER, eos_token_id=END)
    model = LlamaForCausalLM(config)
    loader = DataLoader(ChatDataset(Path(args.data), max_length), batch_size=args.batch_size, shuffle=True,
                        num_workers=workers, pin_memory=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    scheduler = get_cosine_schedule_with_warmup(optimizer, min(100, args.max_steps // 10), args.max_steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    states = Path(args.output_dir) / "states"
    step = 0
    if args.is_keep_training == "True" and (latest := latest_state(states, accelerator.num_processes)) is not None:
        accelerator.load_state(str(latest))  # model, optimizer, scheduler and RNG states
        step = int(latest.name.split("_")[1])
        accelerator.print(f"resumed from {latest}")
    model.train()
    while step < args.max_steps:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            if step % 10 == 0:
                accelerator.print(f"step {step}: loss {loss.item():.3f}")
            if step % args.save_every == 0 or step == args.max_steps:
                accelerator.save_state(str(states / f"step_{step}"))
            if step == args.max_steps:
                break
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(os.path.join(args.output_dir, "final"))
        print(f"saved {args.output_dir}/final")
    accelerator.end_training()


if __name__ == "__main__":
    main()
