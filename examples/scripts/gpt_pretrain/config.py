"""Model and training settings, one function per size, as the A6000 guide's job has them."""

from dataclasses import asdict, dataclass


@dataclass
class Config:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    batch_size: int  # micro-batch
    grad_accum: int  # micro-batches per optimizer step
    lr: float
    max_steps: int
    num_workers: int = 0
    out_dir: str = "out"


def get_tiny_config() -> Config:
    return Config(n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=4, grad_accum=2, lr=1e-3, max_steps=40)


def get_small_config() -> Config:
    return Config(n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=12, grad_accum=10, lr=6e-4,
                  max_steps=200)


def get_mid_config() -> Config:  # between tiny and small: tens of milliseconds a step on a CPU core
    return Config(n_layer=2, n_head=4, n_embd=128, block_size=128, batch_size=4, grad_accum=2, lr=6e-4,
                  max_steps=400)


def get_medium_config() -> Config:
    return Config(n_layer=24, n_head=16, n_embd=1024, block_size=1024, batch_size=12, grad_accum=10, lr=3e-4,
                  max_steps=5000)


def get_config(name: str) -> Config:
    cfg = {"tiny": get_tiny_config, "mid": get_mid_config, "small": get_small_config,
           "medium": get_medium_config}[name]()
    print("config:", asdict(cfg))
    return cfg
