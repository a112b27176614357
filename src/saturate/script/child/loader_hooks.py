"""The DataLoader hooks in a user's unchanged script: each loader's site and settings as made, the overrides applied
at its construction, the wait for each batch handed to the Profiler, and each loader's fingerprint
(`data/fingerprint.py`: its sampler's indices and its first batches' samples, and its first epoch's size), and how
long each iteration of it waited for its first batch (its workers started, their buffers filled).

`hooks.Script.loaders` maps id(DataLoader) to what is recorded of it; `found.live_loaders` and
`found.iterated_loaders` read it out for the report.
"""

from __future__ import annotations

import inspect
import time
import weakref
from typing import Any

from saturate.data.fingerprint import LoaderPrint, dataset_record
from saturate.doctor import selftime
from saturate.script.child import found, split_source
from saturate.script.child.found import caller_site

STARTS = 8  # iterations of a loader whose first batch's wait is kept (each epoch's, where workers restart)


def install(script: Any) -> None:
    """Wrap the DataLoader's construction, its iterators' construction, their next index and next batch."""
    import torch.utils.data.dataloader as dl

    from saturate.doctor.loop_facts import batch_len

    loader_init, loader_iter = dl.DataLoader.__init__, dl.DataLoader.__iter__
    iter_init, iter_next, next_index = (dl._BaseDataLoaderIter.__init__, dl._BaseDataLoaderIter.__next__,
                                        dl._BaseDataLoaderIter._next_index)
    signature = inspect.signature(loader_init)
    changing = bool(script.overrides.loader or script.overrides.train_loader)

    def init(loader: Any, *args: Any, **kwargs: Any) -> None:
        as_written, split = None, None
        new = id(loader) not in script.loaders
        frame = split_source.user_frame(caller_site()) if new else None  # the user's code making it, if any
        if frame is not None:
            split = split_source.find(frame)
        bound = signature.bind(loader, *args, **kwargs) if changing and new else None
        resized = bound is not None and made_at_train_site(script, bound)
        if resized and frame is not None and (names := script.overrides.train_loader.get("set")):
            script.split_set = split_source.apply(frame, dict(names))  # the loop's split, where it keeps it
        if bound is not None and (changes := script.overrides.loader_changes(bound, resized)):
            as_written = {k: bound.arguments.get(k, signature.parameters[k].default) for k in changes}
            bound.arguments.update(changes)
            if not bound.arguments.get("num_workers"):  # settings that need workers go with them
                bound.arguments["prefetch_factor"] = None
                bound.arguments["persistent_workers"] = False
            args, kwargs = bound.args[1:], bound.kwargs
        selftime.foreign(loader_init, loader, *args, **kwargs)
        if id(loader) not in script.loaders:
            script.loaders[id(loader)] = {"site": loader_site(script, loader), "batches": 0,
                                          "ref": weakref.ref(loader), "as_written": as_written,
                                          "settings": found.loader_settings(loader), "print": LoaderPrint(),
                                          "dataset": dataset_record(loader.dataset), "starts": [],
                                          "epoch_batches": _length(loader), "split": split}

    def made_iter(it: Any, loader: Any, *args: Any, **kwargs: Any) -> None:
        # held by its iterator before it asks its sampler for indices (workers ask at once): `for x in
        # DataLoader(...)` keeps no other reference to the loader, and torch's iterator none
        it._saturate_loader = loader
        iter_init(it, loader, *args, **kwargs)

    def make_iter(loader: Any) -> Any:
        info = script.loaders.get(id(loader))
        if info is not None:
            info["asked"] = time.perf_counter()  # its first batch's wait: workers started (again), buffers filled
        it = loader_iter(loader)
        if info is not None:
            info["print"].new_epoch()
        return it

    def index(it: Any) -> Any:
        got = next_index(it)
        info = script.loaders.get(id(getattr(it, "_saturate_loader", None)))
        if info is not None:
            see_index(info["print"], got)
        return got

    def fetch(it: Any) -> Any:
        """The next batch, fingerprinted (an epoch's end noted)."""
        info = script.loaders.get(id(getattr(it, "_saturate_loader", None)))
        try:
            batch = iter_next(it)
        except StopIteration:
            if info is not None:
                info["print"].end_epoch()
            raise
        if info is not None:
            if info.get("asked") is not None:
                if len(info["starts"]) < STARTS:
                    info["starts"].append(time.perf_counter() - info["asked"])
                info["asked"] = None
            see_batch(info["print"], batch)
        return batch

    def next_batch(it: Any) -> Any:
        batch = fetch_batch(it)
        if script.optimizer_steps == 0:  # the micro-batch a step is made of, where its forward takes only keywords
            script.batch_rows = batch_len(batch) or script.batch_rows
        return batch

    def fetch_batch(it: Any) -> Any:
        loader = getattr(it, "_saturate_loader", None)
        prof = script.profiler
        if not script.profile and loader is not None:
            batch = selftime.foreign(fetch, it)
            script.samples += batch_len(batch)
            if (info := script.loaders.get(id(loader))) is not None:
                info["batches"] += 1
            return batch
        if prof is None or script.done or loader is None:
            return selftime.foreign(fetch, it)
        info = script.loaders.get(id(loader))
        if info is not None and prof.instrument.mode == "time":
            info["batches"] += 1
        return prof.next_batch(it, loader, fetch)

    for owner, name, value in ((dl.DataLoader, "__init__", init), (dl.DataLoader, "__iter__", make_iter),
                               (dl._BaseDataLoaderIter, "__init__", made_iter),
                               (dl._BaseDataLoaderIter, "_next_index", index),
                               (dl._BaseDataLoaderIter, "__next__", selftime.own(next_batch))):
        script.patches.replace(owner, name, value)


see_index = selftime.own(LoaderPrint.see_index)  # the fingerprint's time is saturate's
see_batch = selftime.own(LoaderPrint.see_batch)


def _length(loader: Any) -> int | None:
    """Batches in one of the loader's epochs, where it knows (a stream without `__len__` does not)."""
    try:
        return len(loader)
    except TypeError:
        return None


def made_at_train_site(script: Any, bound: Any) -> bool:
    """Whether a DataLoader being made is the training loader the overrides resize: made at its line, or a
    library's copy (over the same dataset) of one made there."""
    site = script.overrides.train_loader.get("site")
    if site is None:
        return False
    if caller_site() == site:
        return True
    dataset = bound.arguments.get("dataset")
    return any(info["site"] == site and getattr(info["ref"](), "dataset", None) is dataset
               for info in script.loaders.values())


def loader_site(script: Any, loader: Any) -> str | None:
    """Where the script set this DataLoader's arguments: for a library's copy of a loader the script made
    (Accelerate's `prepare`, over the same dataset) the script's own `DataLoader(...)` call, else the caller."""
    for info in script.loaders.values():
        made = info["ref"]()
        if made is not None and made is not loader and getattr(made, "dataset", None) is loader.dataset:
            return info["site"]
    return caller_site()
