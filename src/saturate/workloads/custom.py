"""Bring your own workload: a model, a dataset and a loss from the user's Python, in the same engine.

Two ways in, the same checks:

    def workload() -> saturate.Workload:              # referenced as --workload package.module:workload
        return saturate.custom_workload("my-cnn", model=make_cnn, dataset=train_set, loss=nn.CrossEntropyLoss(),
                                        effective_batch=64, lr=1e-3)

`custom_workload` turns a finite map-style dataset into the engine's global-index samples (epochs,
reshuffled deterministically by seed), wraps a criterion `loss(output, target)` or takes a
`step(model, batch) -> loss`, and checks everything on one small batch before any training:
samples can be read, are a function of their index, batch together, and the loss is a finite
scalar with a gradient. FLOPs per sample, when not given, are counted once on that batch with
PyTorch's FLOP counter (forward + backward), so MFU is reported for any model.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import inspect
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import Dataset, IterableDataset, default_collate

from saturate.errors import ConfigError, SaturateError, did_you_mean
from saturate.workloads.base import Optimization, Workload

UNBOUNDED = 2**62  # the length of a dataset whose indices are unbounded (RandomWindows and the like)
PROBE_BATCH = 2  # samples in the batch every check runs on
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
# why a stream is refused: a workload's samples are read by index, so loader workers cannot replay them
STREAM_WHY = (": samples are read by their index, so that resume, any micro-batch split and any number of loader "
              "workers train on the same samples (a stream's workers could each replay it)")
_CHECKED = "_saturate_checked"  # set on a Workload once check_workload has proven it


class Epochs(Dataset):
    """A finite dataset seen through global sample indices: index i is item perm_e[i mod n] of epoch
    e = i // n, with perm_e a permutation fixed by (seed, e). The order depends on nothing but the
    index, so resume, any micro-batch split and DataLoader workers all see the same samples."""

    def __init__(self, dataset: Any, seed: int = 0, shuffle: bool = True) -> None:
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self.n = self.distinct_samples = len(dataset)
        if self.n < 1:
            raise ConfigError("the dataset is empty")
        self._epoch, self._perm = -1, np.arange(0)

    def __len__(self) -> int:
        return UNBOUNDED

    def item(self, index: int) -> int:
        """Which item of the underlying dataset global sample `index` is."""
        epoch, pos = divmod(int(index), self.n)
        if not self.shuffle:
            return pos
        if epoch != self._epoch:  # one permutation per epoch, computed when the epoch is first reached
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._epoch = epoch
        return int(self._perm[pos])

    def __getitem__(self, index: int) -> Any:
        return self.dataset[self.item(index)]


def custom_workload(
    name: str,
    *,
    model: Callable[[], nn.Module] | nn.Module,
    dataset: Any,
    effective_batch: int,
    lr: float,
    loss: Callable[[Any, Any], torch.Tensor] | None = None,
    step: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    val_dataset: Any = None,
    tokens_per_sample: int = 1,
    flops_per_sample: float | None = None,
    shuffle: bool = True,
    seed: int = 0,
    evaluate: Callable[[nn.Module, torch.device, int], dict[str, float]] | None = None,
    identity: Mapping[str, Any] | None = None,
    guide_plans: tuple[str, ...] = (),
    info: Mapping[str, Any] | None = None,
    **optim: Any,
) -> Workload:
    """A checked Workload from a model builder, a dataset and a loss (or a step function).

    model: a function returning a fresh model on the CPU in fp32 (called once per trial and run), or
        a module (deep-copied each time, so every build starts from the same weights).
    dataset: map-style (`len` and `[i]`); a finite one is read in epochs reshuffled by `seed`.
    loss: a criterion `loss(model(inputs...), target)` for batches `(inputs..., target)`; or
    step: `step(model, batch) -> loss` for anything else (dict batches, several outputs, …).
    effective_batch, lr: samples per optimizer step and the peak learning rate at that batch.
    optim: any other Optimization field (steps, warmup_steps, weight_decay, grad_clip, eval_every, …).
    tokens_per_sample: for tokens/s (the sequence length of a language model; 1 otherwise).
    flops_per_sample: model FLOPs (forward + backward) per sample; counted on one batch when omitted.
    """
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__") or not hasattr(dataset,
                                                                                                      "__len__"):
        raise ConfigError(f"workload {name!r}: the dataset is a {type(dataset).__name__}, not map-style "
                          f"(it needs len() and [index]){STREAM_WHY}; wrap an iterable in a list or a Dataset")
    if len(dataset) < 1:
        raise ConfigError(f"workload {name!r}: the dataset is empty")
    if (loss is None) == (step is None):
        raise ConfigError(f"workload {name!r}: give exactly one of loss= (a criterion on (output, target)) "
                          "or step= (a function (model, batch) -> loss)")
    build = _builder(model, name)
    loss_fn = step if step is not None else _criterion_step(loss)
    steps = int(optim.get("steps", 1000))
    optim.setdefault("warmup_steps", max(0, min(100, steps // 10)))
    optimization = Optimization(effective_batch=effective_batch, lr=lr).with_values(optim, f"workload {name!r}")
    train_data = dataset if len(dataset) >= UNBOUNDED else Epochs(dataset, seed=seed, shuffle=shuffle)
    w = Workload(name=name, build_model=build, train_data=train_data, val_data=val_dataset, loss_fn=loss_fn,
                 optim=optimization, tokens_per_sample=tokens_per_sample, flops_per_sample=flops_per_sample,
                 identity=dict(identity or {}), info=dict(info or {}), evaluate=evaluate,
                 guide_plans=tuple(guide_plans))
    check_workload(w, f"workload {name!r}")
    if not isinstance(train_data, Epochs):
        w.info.setdefault("samples", "unbounded (drawn by index)")
    else:
        w.info.setdefault("samples", f"{train_data.n:,} per epoch" + (" (reshuffled each epoch)" if shuffle else ""))
    return w


def _builder(model: Callable[[], nn.Module] | nn.Module, name: str) -> Callable[[], nn.Module]:
    if isinstance(model, nn.Module):
        template = copy.deepcopy(model).cpu()
        return lambda: copy.deepcopy(template)
    if not callable(model):
        raise ConfigError(f"workload {name!r}: model= must be a function returning an nn.Module, or a module; "
                          f"got {type(model).__name__}")
    return model


def _criterion_step(criterion: Callable[[Any, Any], torch.Tensor]) -> Callable[[nn.Module, Any], torch.Tensor]:
    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        if not isinstance(batch, (list, tuple)) or len(batch) < 2:
            raise ConfigError("loss= needs batches of (inputs..., target); give step=(model, batch) -> loss "
                              f"for batches of type {type(batch).__name__}")
        *inputs, target = batch
        return criterion(model(*inputs), target)

    step.criterion = criterion  # type: ignore[attr-defined]  # for repr / identity
    return step


# --- checks ---------------------------------------------------------------------------------------


def check_workload(w: Any, where: str) -> Workload:
    """Prove on one small batch that `w` can train; fill FLOPs and identity when missing.

    Raises ConfigError naming `where` and the problem. A workload is checked once.
    """
    if not isinstance(w, Workload):
        raise ConfigError(f"{where} returned a {type(w).__name__}, not a saturate.Workload "
                          "(build one with saturate.custom_workload(...))")
    if getattr(w, _CHECKED, False):
        return w
    if not isinstance(w.name, str) or not _NAME.match(w.name):
        raise ConfigError(f"{where}: workload name {w.name!r} must start with a letter or digit and hold only "
                          "letters, digits, '.', '_', '+' or '-' (it names run folders)")
    if not callable(w.build_model) or not callable(w.loss_fn):
        raise ConfigError(f"{where}: build_model and loss_fn must be callables")
    data = w.train_data
    if isinstance(data, IterableDataset) or not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
        raise ConfigError(f"{where}: train_data is a {type(data).__name__}, not map-style (it needs len() and "
                          f"[index]){STREAM_WHY}")
    if len(data) < 1:
        raise ConfigError(f"{where}: train_data is empty")
    if len(data) < UNBOUNDED and not isinstance(data, Epochs):
        # A finite dataset: read it in epochs (reshuffled by seed 0) so that every global index exists.
        data = w.train_data = Epochs(data)
    n = PROBE_BATCH
    first = _read(data, 0, where, "train_data")
    again = _read(data, 0, where, "train_data")
    if not _same(first, again):
        raise ConfigError(f"{where}: train_data[0] returned different values on two reads; a sample must be a "
                          "function of its index (seed any randomness from the index)")
    samples = [first] + [_read(data, i, where, "train_data") for i in range(1, n)]
    try:
        batch = default_collate(samples)
    except Exception as e:
        raise ConfigError(f"{where}: samples cannot be batched together ({_first_line(e)}); every sample must "
                          "have the same shapes") from None
    if w.val_data is not None:
        if not hasattr(w.val_data, "__getitem__") or not hasattr(w.val_data, "__len__"):
            raise ConfigError(f"{where}: val_data is a {type(w.val_data).__name__}, not map-style")
        if len(w.val_data) < 1:
            raise ConfigError(f"{where}: val_data is empty")
        _read(w.val_data, 0, where, "val_data")
    try:
        model = w.build_model()
    except SaturateError:
        raise
    except Exception as e:
        raise ConfigError(f"{where}: building the model raised {_first_line(e)}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{where}: the model builder returned a {type(model).__name__}, not an nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"{where}: the model has no trainable parameters")
    model.train()
    flops = _probe_loss(model, w.loss_fn, batch, where)
    if w.flops_per_sample is None and flops > 0:
        w.flops_per_sample = flops / n
        w.info.setdefault("flops_per_sample", f"{w.flops_per_sample:.3g} (counted)")
    if not w.identity:
        w.identity = default_identity(model, data)
    w.info.setdefault("parameters", f"{sum(p.numel() for p in model.parameters()):,}")
    setattr(w, _CHECKED, True)
    return w


def _read(data: Any, i: int, where: str, what: str) -> Any:
    try:
        return data[i]
    except Exception as e:
        raise ConfigError(f"{where}: {what}[{i}] raised {_first_line(e)}") from None


def _probe_loss(model: nn.Module, loss_fn: Callable, batch: Any, where: str) -> float:
    """Forward + backward on the probe batch under the FLOP counter; returns the FLOPs counted."""
    from torch.utils.flop_counter import FlopCounterMode

    from saturate.workloads.flops import register_attention_flops

    register_attention_flops()  # CPU attention counts 0 without it
    # oneDNN's fused RNN kernels are invisible to the FLOP counter; without them nn.LSTM/GRU run as
    # matmuls it can count. Only this probe runs that way.
    counter = FlopCounterMode(display=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # toggling oneDNN warns about TF32 on Intel GPUs
        with torch.backends.mkldnn.flags(enabled=False):
            try:
                with counter:
                    loss = loss_fn(model, batch)
                    ok = isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()
                    if ok and loss.requires_grad:
                        loss.reshape(()).backward()
            except SaturateError as e:
                raise ConfigError(f"{where}: {e}") from None
            except Exception as e:
                raise ConfigError(f"{where}: the loss on a batch of {PROBE_BATCH} samples raised "
                                  f"{_first_line(e)}") from None
    if not ok:
        shape = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ConfigError(f"{where}: the loss must be a scalar float tensor (the batch mean), got {shape}")
    if not loss.requires_grad:
        raise ConfigError(f"{where}: the loss has no gradient (is it computed from the model's output?)")
    if not math.isfinite(float(loss.detach())):
        raise ConfigError(f"{where}: the loss on the first batch is {float(loss.detach())}")
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def count_flops(model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any) -> float:
    """Model FLOPs of one forward + backward of `loss_fn(model, batch)` (PyTorch's FLOP counter)."""
    return _probe_loss(model, loss_fn, batch, "FLOP count")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _digest(obj: Any, h: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, np.ndarray):
        h.update(f"{obj.dtype}{obj.shape}".encode() + np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _digest(x, h)
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(str(k).encode())
            _digest(obj[k], h)
    else:
        h.update(repr(obj).encode())


def default_identity(model: nn.Module, data: Any) -> dict[str, Any]:
    """What resume must match when the user gave no identity: the model's structure and parameter
    shapes, and the dataset's size and first samples."""
    h = hashlib.sha256()
    for i in range(4):
        try:
            _digest(data[i], h)
        except Exception:
            break
    size = data.n if isinstance(data, Epochs) else len(data)
    return {
        "model": {"class": type(model).__name__, "structure": hashlib.sha256(str(model).encode()).hexdigest()[:16],
                  "shapes": hashlib.sha256(str([(k, tuple(v.shape)) for k, v in model.state_dict().items()])
                                           .encode()).hexdigest()[:16]},
        "data": {"class": type(getattr(data, "dataset", data)).__name__, "size": size,
                 "samples": h.hexdigest()[:16], "seed": getattr(data, "seed", None)},
    }


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


# --- module:function ------------------------------------------------------------------------------


def load_workload(spec: str, params: Mapping[str, Any] | None = None) -> Workload:
    """Import `package.module:function` (or `path/to/file.py:function`), call it with `params` as keyword
    arguments, and check the Workload it returns. Every problem is one ConfigError naming `spec`."""
    params = dict(params or {})
    module_name, sep, func_name = spec.rpartition(":")
    if not sep or not module_name or not func_name.isidentifier():
        raise ConfigError(f"--workload {spec!r}: expected package.module:function or path/to/file.py:function")
    module = _import(module_name, spec)
    try:
        fn = getattr(module, func_name)
    except AttributeError:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                        and getattr(v, "__module__", None) == module.__name__)
        hint = f" (its functions: {', '.join(public[:8])})" if public else ""
        raise ConfigError(f"--workload {spec}: module {module.__name__!r} has no attribute {func_name!r}{hint}") \
            from None
    if not callable(fn):
        raise ConfigError(f"--workload {spec}: {func_name} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind(**params)
    except TypeError as e:
        names = list(inspect.signature(fn).parameters)
        if stray := [k for k in params if k not in names]:  # a mistyped keyword: name it, and its near miss
            raise ConfigError(f"--workload {spec}: {func_name}() has no parameter {stray[0]!r}"
                              f"{did_you_mean(stray[0], names)}; it takes: {', '.join(names) or 'none'}") from None
        given = ", ".join(f"{k}={v!r}" for k, v in params.items()) or "no parameters"
        raise ConfigError(f"--workload {spec}: {func_name}() cannot be called with {given} ({e}; it takes: "
                          f"{', '.join(names) or 'none'})") from None
    except ValueError:
        pass  # no signature to check (a builtin); the call below reports any problem
    try:
        w = fn(**params)
    except SaturateError as e:
        raise type(e)(f"--workload {spec}: {e}") from None
    except Exception as e:
        raise ConfigError(f"--workload {spec}: calling {func_name}() raised {_first_line(e)}") from None
    w = check_workload(w, f"--workload {spec}")
    w.info.setdefault("source", spec)
    if params:
        w.identity.setdefault("params", dict(sorted(params.items())))
    return w


def _import(module_name: str, spec: str) -> Any:
    path = Path(module_name)
    if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
        if path.suffix != ".py":
            path = path.with_suffix(".py")
        if not path.is_file():
            raise ConfigError(f"--workload {spec}: file {path} does not exist")
        folder, module_name = str(path.resolve().parent), path.stem
        if folder not in sys.path:
            sys.path.insert(0, folder)  # so DataLoader workers started by spawn import it by name too
    elif os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # the `saturate` script does not put the current folder on the path
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ConfigError(f"--workload {spec}: cannot import module {module_name!r} (no module named "
                              f"{e.name!r}); run from the folder that holds it or add that folder to PYTHONPATH") \
                from None
        raise ConfigError(f"--workload {spec}: importing {module_name!r} failed: {_first_line(e)}") from None
    except SyntaxError as e:
        raise ConfigError(f"--workload {spec}: {e.filename}:{e.lineno}: syntax error: {e.msg}") from None
    except SaturateError as e:
        raise type(e)(f"--workload {spec}: {e}") from None
    except Exception as e:
        raise ConfigError(f"--workload {spec}: importing {module_name!r} raised {_first_line(e)}") from None
