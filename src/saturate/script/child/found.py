"""What the hooks found in a user's script: the model that owns the followed optimizer's parameters, and
the DataLoaders it made with their settings (`hooks.Script` records them; this reads them out)."""

from __future__ import annotations

import os
import sys
import sysconfig
import traceback
import weakref
from typing import Any

from saturate.script.child import coupled


def model_of(optimizer: Any, roots: list[weakref.ref]) -> tuple[Any, dict[str, Any] | None]:
    """The top-level module (of those whose forward ran, `roots`) owning most of `optimizer`'s parameters, and
    what the report says of it: its class under any wrappers (DDP, compile), its size, its batch-coupled layers."""
    import torch

    owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
    best, best_n = None, 0
    for ref in roots:
        module = ref()
        if module is None:
            continue
        n = sum(1 for p in module.parameters() if id(p) in owned)
        if n > best_n:
            best, best_n = module, n
    if best is None:
        return None, None
    inner, wrappers = best, []
    while isinstance(getattr(inner, "module", getattr(inner, "_orig_mod", None)), torch.nn.Module):
        wrappers.append(type(inner).__name__)  # DistributedDataParallel, OptimizedModule (compile)
        inner = getattr(inner, "module", getattr(inner, "_orig_mod", None))
    from saturate.doctor.loop_facts import is_compiled

    return best, {"class": type(inner).__name__, "wrapped_in": wrappers, "compiled": is_compiled(best),
                  "parameters": sum(p.numel() for p in best.parameters()), **coupled.record(inner)}


def live_loaders(loaders: dict[Any, dict[str, Any]]) -> list[dict[str, Any]]:
    """The DataLoaders still alive, what was recorded of them and their settings now, the most used first."""
    found = [(info["ref"](), recorded(info)) for info in loaders.values()]
    alive = sorted([(loader, info) for loader, info in found if loader is not None], key=lambda x: -x[1]["batches"])
    return [{**info, **loader_settings(loader)} for loader, info in alive]


def recorded(info: dict[str, Any]) -> dict[str, Any]:
    """What the report says of a DataLoader: its site, batches, settings as written, and its fingerprint
    (`data/fingerprint.py`: the print's record with its dataset's)."""
    out = {k: v for k, v in info.items() if k not in ("ref", "settings", "print", "dataset", "asked")}
    if "print" in info:
        out["fingerprint"] = {**info["print"].record(), "dataset": info.get("dataset")}
    return out


def iterated_loaders(loaders: dict[Any, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every DataLoader that gave batches, alive or not (at exit the script's are gone), with its settings as
    made, the most used first."""
    used = [info for info in loaders.values() if info["batches"]]
    return [{**recorded(info), **info["settings"]} for info in sorted(used, key=lambda i: -i["batches"])]


def loader_settings(loader: Any) -> dict[str, Any]:
    batch_size = loader.batch_size if loader.batch_size is not None else \
        getattr(loader.batch_sampler, "batch_size", None)  # a batch sampler's (Accelerate's, a Trainer's)
    return {"batch_size": batch_size, "num_workers": loader.num_workers,
            "prefetch_factor": loader.prefetch_factor, "pin_memory": loader.pin_memory,
            "persistent_workers": loader.persistent_workers, "class": type(loader).__name__,
            "sets_batch_size": loader.batch_size is not None,  # False: batches from a batch_sampler of its own
            "batches_per_epoch": _batches(loader),
            "in_order": getattr(loader, "in_order", True)}  # False: workers' batches as they finish (torch ≥ 2.6)


def _batches(loader: Any) -> int | None:
    """The batches one pass over `loader` gives (`len(loader)`), or None: a stream without a length."""
    try:
        return int(len(loader))
    except Exception:  # TypeError for a stream; a dataset's own __len__ may raise anything
        return None


# The standard library's folders: under a virtual environment sys.prefix is the environment's, and the standard
# library lives under the base interpreter's (sys.base_prefix: /usr/lib/python3.12 on the GPU image, whose
# CUDA sync warnings were placed at warnings.py instead of the user's loss.item()).
STDLIB = tuple(sorted({os.path.join(p, "lib") + os.sep for p in (sys.prefix, sys.base_prefix)}
                      | {os.path.dirname(sysconfig.get_paths()["stdlib"]) + os.sep}))


def is_stdlib(filename: str) -> bool:
    """Whether a frame's file is the standard library's (not a package installed beside it)."""
    return filename.startswith(STDLIB) and "-packages" not in filename


def caller_site() -> str | None:
    """`file.py:line` of the innermost frame that is the user's code (not torch's, a library's or ours)."""
    skip = ("site-packages", "dist-packages", f"{os.sep}torch{os.sep}", f"{os.sep}saturate{os.sep}")
    for frame in reversed(traceback.extract_stack()[:-1]):
        name = frame.filename
        if name.startswith("<") or any(s in name for s in skip) or is_stdlib(name):
            continue
        return f"{shown_path(name)}:{frame.lineno}"
    return None


def read_site() -> str | None:
    """Where a host read happened: `train.py:323` in the user's code; inside a library (a Trainer's logging),
    the library's line and the user's call that led there — `transformers/trainer.py:2480 (from run_clm.py:652)`:
    the line to change may be a library setting (`logging_steps`), not the call."""
    libraries = ("site-packages", "dist-packages")
    ours = (f"{os.sep}torch{os.sep}", f"{os.sep}saturate{os.sep}")
    inner = None
    for frame in reversed(traceback.extract_stack()[:-1]):
        name = frame.filename
        library = any(s in name for s in libraries)
        if name.startswith("<") or is_stdlib(name) or any(s in name for s in ours):
            continue
        if library:
            if inner is None:
                package = name.split("-packages" + os.sep, 1)[-1]
                inner = f"{package}:{frame.lineno}"
            continue
        user = f"{shown_path(name)}:{frame.lineno}"
        return f"{inner} (from {user})" if inner else user
    return inner


def shown_path(name: str) -> str:
    """A script's path as reports show it: relative to the working folder when under it, else absolute."""
    path = os.path.abspath(name)
    cwd = os.getcwd()
    return os.path.relpath(path, cwd) if path.startswith(cwd.rstrip(os.sep) + os.sep) else path


def weights_changed(roots: list[Any], last: tuple[int, Any] | None) -> tuple[bool, tuple[int, Any] | None]:
    """Whether a few values of the first weight of the first module called at the top level (`roots`: weak
    references) changed since `last` (this function's previous sample), and the new sample. Before any optimizer
    step, gradient accumulation leaves them as they are: a change is a weight updated by hand."""
    import torch

    module = next((m for m in (r() for r in roots) if m is not None), None)
    weight = next((p for p in module.parameters() if p.numel()), None) if module is not None else None
    if weight is None:
        return False, last
    with torch.no_grad():
        sample = (id(weight), weight.detach().reshape(-1)[:8].to("cpu", copy=True))
    return last is not None and last[0] == sample[0] and not torch.equal(last[1], sample[1]), sample


def torch_threads() -> int | None:
    """torch's intra-op threads in this process now."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None
