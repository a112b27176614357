"""What a run trains on, cheaply: a DataLoader's fingerprint, and whether two runs' fingerprints say the same training.

A speed-up must leave the data the model sees as it was. That is checked, not assumed from the knob turned: each
run of a user's script (a trial, a doctor run, the full run) fingerprints its DataLoaders as it goes, and the tuner
compares every candidate's with the script's own run (`compare`). A `LoaderPrint` holds, for the loader's first
`POLICY.same.batches` batches:

- the indices its sampler handed out, in order (map-style datasets; a stream has none);
- a digest of each of their first `POLICY.same.rows` samples (every tensor's row of that sample, read at
  `POLICY.same.elements` values strided over it), in the order the loader delivered them;
- the batches' sizes, and the first epoch's batches and samples where an epoch ended.

Trials start from the same seeds (`script/child/hooks.py`), so a change that leaves the data alone gives the same
digests. Loader workers draw random augmentations from their own seeds: then the digests differ while the indices
agree — the same samples, other draws, which keeps the training the same in the sense that matters (which samples,
how often, in which order). A stream has no indices: its workers are safe when none of its first samples repeats
more than in the run as written and its dataset shards itself by worker (`torch.utils.data.get_worker_info()`, read
from its source). A stream each worker replays whole yields each worker's first batch first: the first batches
repeat once per worker.
"""

from __future__ import annotations

import enum
import hashlib
import inspect
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from saturate.policy import POLICY

LIBRARIES = ("site-packages", "dist-packages")
PLAIN = (str, bytes, int, float, bool)  # a list of these is one part of a batch (its samples' values)


class LoaderPrint:
    """The fingerprint of one DataLoader as a run uses it (`see_index` from its sampler, `see_batch` per batch)."""

    def __init__(self, batches: int | None = None, rows: int | None = None, elements: int | None = None) -> None:
        same = POLICY.same
        self.limit = same.batches if batches is None else batches
        self.rows = same.rows if rows is None else rows
        self.elements = same.elements if elements is None else elements
        self.indices: list[Any] = []  # the sampler's, flattened, for the first `limit` batches
        self._indexed = 0  # index batches seen
        self.stream = False  # the sampler handed out no indices (an IterableDataset)
        self.sizes: list[int] = []  # samples in each of the first `limit` batches
        self.digests: list[list[str]] = []  # per batch: its first `rows` samples' digests
        self.epoch: tuple[int, int] | None = None  # the first epoch that ended: (batches, samples)
        self._epoch = [0, 0]  # the epoch under way: batches, samples

    def see_index(self, index: Any) -> None:
        """What the sampler handed out for one batch (a list of indices, an index, or None for a stream)."""
        if self._indexed >= self.limit:
            return
        self._indexed += 1
        flat = list(index) if isinstance(index, (list, tuple)) else [index]
        if any(i is None for i in flat):
            self.stream = True
            return
        self.indices.extend(i if isinstance(i, (int, str)) else repr(i) for i in flat)

    def see_batch(self, batch: Any) -> None:
        n = batch_size(batch)
        self._epoch[0] += 1
        self._epoch[1] += n
        if len(self.sizes) < self.limit:  # past the first batches only the epoch's counts: nothing hashed
            self.sizes.append(n)
            self.digests.append(sample_rows(batch, self.rows, self.elements))

    def new_epoch(self) -> None:
        """The loader was iterated again (a new iterator, or a persistent one reset)."""
        self._epoch = [0, 0]

    def end_epoch(self) -> None:
        """The loader ran out: its first epoch's size is kept."""
        if self.epoch is None and self._epoch[0]:
            self.epoch = (self._epoch[0], self._epoch[1])
        self._epoch = [0, 0]

    def record(self) -> dict[str, Any]:
        return {"indices": None if self.stream or not self.indices else self.indices, "sizes": self.sizes,
                "digests": self.digests, "epoch": list(self.epoch) if self.epoch else None}


def batch_size(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor, or the length of its first list."""
    for leaf in _leaves(batch):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape):
            return int(shape[0])
        if isinstance(leaf, (list, tuple)):
            return len(leaf)
    return 1


def sample_rows(batch: Any, rows: int, elements: int) -> list[str]:
    """A digest of each of the batch's first `rows` samples: every tensor (or array, or list) of the batch with the
    batch's size as its first dimension contributes that sample's row, read at `elements` values strided over it."""
    n = batch_size(batch)
    parts = [p for p in (_row_bytes(leaf, n, rows, elements) for leaf in _leaves(batch)) if p is not None]
    if not parts:
        return []
    out = []
    for i in range(min(n, rows)):
        h = hashlib.blake2b(digest_size=8)
        for part in parts:
            h.update(part[i])
        out.append(h.hexdigest())
    return out


def _leaves(batch: Any) -> list[Any]:
    """The batch's parts: a mapping's values and a sequence's items, down to tensors, arrays and lists of plain
    values (a batch of strings)."""
    if isinstance(batch, Mapping):
        return [x for v in batch.values() for x in _leaves(v)]
    if isinstance(batch, (list, tuple)) and not all(v is None or isinstance(v, PLAIN) for v in batch):
        return [x for v in batch for x in _leaves(v)]
    return [batch]


def _row_bytes(leaf: Any, n: int, rows: int, elements: int) -> list[bytes] | None:
    """Each of the first `rows` samples' bytes in `leaf`, or None when it is not batched by sample."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(leaf, torch.Tensor):
        if leaf.dim() == 0 or leaf.shape[0] != n:
            return None
        flat = leaf.detach()[:rows].reshape(min(n, rows), -1)
        stride = max(1, flat.shape[1] // max(1, elements))
        picked = flat[:, ::stride][:, :elements].contiguous()
        if picked.dtype.is_complex:
            picked = torch.view_as_real(picked).contiguous()
        raw = picked.cpu().view(torch.uint8).reshape(picked.shape[0], -1).numpy()
        return [bytes(r) for r in raw]
    if hasattr(leaf, "shape") and hasattr(leaf, "tobytes"):  # a NumPy array
        if not leaf.shape or leaf.shape[0] != n:
            return None
        return [leaf[i].tobytes()[:8 * elements] for i in range(min(n, rows))]
    if isinstance(leaf, (list, tuple)) and len(leaf) == n:
        return [repr(x).encode()[:8 * elements] for x in leaf[:rows]]
    return None


def dataset_record(dataset: Any) -> dict[str, Any]:
    """What the fingerprint's reader needs of a loader's dataset: its class and where it is defined, whether it is
    a stream, and for a stream whether it shards itself by worker (`_calls_worker_info`; None: a library's stream,
    or one wrapping a library's, which is taken to shard as its library does)."""
    torch = sys.modules.get("torch")
    cls = type(dataset)
    stream = torch is not None and isinstance(dataset, torch.utils.data.IterableDataset)
    out: dict[str, Any] = {"class": cls.__name__, "stream": stream, "defined_at": _defined_at(cls), "shards": None}
    if not stream:
        return out
    module = inspect.getmodule(cls)
    file = getattr(module, "__file__", None) or ""
    wraps_library = any(_library(type(v)) for v in vars(dataset).values()) if hasattr(dataset, "__dict__") else False
    if any(s in file for s in LIBRARIES) or wraps_library:
        return out
    out["shards"] = _calls_worker_info(cls, module)
    return out


def _calls_worker_info(cls: type, module: Any) -> bool:
    """Whether the stream's class (or a base of its own) or a function of its module that the class names calls
    `get_worker_info`: how a stream shards itself by worker."""
    own = [c for c in cls.__mro__ if c.__module__ == cls.__module__]
    texts = []
    for c in own:
        try:
            texts.append(inspect.getsource(c))
        except (OSError, TypeError):
            continue
    text = "\n".join(texts)
    if "get_worker_info" in text:
        return True
    for name, value in vars(module).items() if module is not None else ():
        if inspect.isfunction(value) and value.__module__ == cls.__module__ and name in text:
            try:
                if "get_worker_info" in inspect.getsource(value):
                    return True
            except (OSError, TypeError):
                continue
    return False


def _library(cls: type) -> bool:
    module = sys.modules.get(cls.__module__)
    file = getattr(module, "__file__", None) or ""
    return cls.__module__.split(".")[0] not in ("builtins", "torch") and any(s in file for s in LIBRARIES)


def _defined_at(cls: type) -> str | None:
    try:
        file, line = inspect.getsourcefile(cls), inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):
        return None
    if not file:
        return None
    cwd = os.getcwd().rstrip(os.sep) + os.sep
    return f"{os.path.relpath(file) if os.path.abspath(file).startswith(cwd) else file}:{line}"


class Same(enum.Enum):
    """What comparing a run's fingerprint with the run as written's found."""

    SAME = "the same batches as the script as written"
    SAME_SAMPLES = "the same samples in the same order as the script as written, with other random draws"
    SHARDED_STREAM = "the stream's samples in another order (its workers each yield their share), none repeated"
    ALIKE = ("alike in samples per step, epoch size and repeats (a run with its own seeds: its samples are not "
             "compared one by one)")
    NOT_SEEN = "not checked: no DataLoader batches seen"
    OTHER_SAMPLES = "other samples than the script as written"
    REPEATED = "samples repeated"
    UNSHARDED_STREAM = "a stream its workers may each replay"
    OTHER_EPOCH = "another epoch size"
    OTHER_STEP = "other samples per optimizer step"

    @property
    def changed(self) -> bool:
        return self in CHANGED


CHANGED = frozenset({Same.OTHER_SAMPLES, Same.REPEATED, Same.UNSHARDED_STREAM, Same.OTHER_EPOCH, Same.OTHER_STEP})


@dataclass(frozen=True)
class SameCheck:
    """A fingerprint comparison: what it found (`same`), the detail in numbers, and the edit that would make the
    change safe, where there is one."""

    same: Same
    detail: str = ""
    times: int | None = None  # REPEATED: about how many times each sample is seen
    edit: str | None = None

    @property
    def changed(self) -> bool:
        return self.same.changed

    def text(self) -> str:
        return f"{self.same.value} ({self.detail})" if self.detail else self.same.value

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "same": self.same.name, "changed": self.changed, "text": self.text()}


def compare(written: dict[str, Any] | None, run: dict[str, Any] | None, *, seeded: bool = True,
            samples_per_step: tuple[float | None, float | None] = (None, None)) -> SameCheck:
    """`run`'s training loader (its `LoaderPrint.record()` with its `dataset_record` under "dataset") against the
    run as written's. `seeded` False (a full run, its own seeds): only what no seed changes is compared — samples
    per optimizer step, the epoch's size, samples repeating."""
    a, b = samples_per_step
    if a and b and abs(a - b) > 1e-9 * max(a, b):
        return SameCheck(Same.OTHER_STEP, f"{b:g} a step, not {a:g}")
    if not written or not run or not written.get("sizes") or not run.get("sizes"):
        return SameCheck(Same.NOT_SEEN)
    if written.get("epoch") and run.get("epoch") and list(written["epoch"]) != list(run["epoch"]):
        (wb, ws), (rb, rs) = written["epoch"], run["epoch"]
        return SameCheck(Same.OTHER_EPOCH, f"an epoch of {rs} samples in {rb} batches, not {ws} in {wb}",
                         times=round(rs / ws) if ws and rs > ws else None, edit=shard_edit(run))
    repeated = _repeated(run) - _repeated(written)
    if repeated > POLICY.same.repeat_margin:
        times = _times(run)
        return SameCheck(Same.REPEATED, f"{100 * repeated:.0f} % of its first samples repeat earlier ones; its first "
                         f"batches repeat {times} times", times=times, edit=shard_edit(run))
    if not seeded:
        return SameCheck(Same.ALIKE)
    if (at := _first_difference(written, run)) is None:
        return SameCheck(Same.SAME)
    wi, ri = written.get("indices"), run.get("indices")
    if wi and ri:
        n = min(len(wi), len(ri))
        if wi[:n] == ri[:n]:
            return SameCheck(Same.SAME_SAMPLES, f"first {n} indices alike")
        k = next(i for i in range(n) if wi[i] != ri[i])
        return SameCheck(Same.OTHER_SAMPLES, f"the sampler's indices differ from sample {k} on")
    if wi or ri:
        return SameCheck(Same.OTHER_SAMPLES, f"the first batches differ from sample {at} on")
    if (run.get("dataset") or {}).get("shards") is False:
        return SameCheck(Same.UNSHARDED_STREAM, "its first batches differ from the script's own, and its dataset "
                         "never calls get_worker_info()", edit=shard_edit(run))
    return SameCheck(Same.SHARDED_STREAM, f"its batches differ from sample {at} on")


def _flat(p: dict[str, Any]) -> list[str]:
    """The digests in order, up to the first batch recorded in part."""
    out: list[str] = []
    for size, rows in zip(p["sizes"], p["digests"], strict=False):
        out.extend(rows)
        if len(rows) < size:
            break
    return out


def _first_difference(written: dict[str, Any], run: dict[str, Any]) -> int | None:
    """The first sample whose digest differs (None: alike as far as both were recorded). Batches of one size are
    compared batch by batch, all that both recorded; of other sizes, the samples in order."""
    if written["sizes"][:len(run["sizes"])] == run["sizes"][:len(written["sizes"])]:
        seen = 0
        for x, y in zip(written["digests"], run["digests"], strict=False):
            if x != y:
                return seen + next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x),
                                                                                                        len(y)))
            seen += len(x)
        return None
    x, y = _flat(written), _flat(run)
    n = min(len(x), len(y))
    return next((i for i in range(n) if x[i] != y[i]), None)


def _repeated(p: dict[str, Any]) -> float:
    """The share of the recorded samples that repeat an earlier one."""
    rows = [d for batch in p["digests"] for d in batch]
    return 1 - len(set(rows)) / len(rows) if rows else 0.0


def _times(p: dict[str, Any]) -> int:
    """How many times the most repeated recorded batch appears among the first batches."""
    batches = [tuple(b) for b in p["digests"] if b]
    return max((batches.count(b) for b in batches), default=1)


def replayed(p: dict[str, Any] | None) -> int | None:
    """How many times a stream's first batches repeat in one run (each of its workers replaying it whole), or None
    when they do not (or it is no stream)."""
    if not p or not (p.get("dataset") or {}).get("stream") or _repeated(p) <= POLICY.same.repeat_margin:
        return None
    return _times(p)


def shard_edit(run: dict[str, Any]) -> str | None:
    """The edit that makes a stream safe for loader workers (None: not a stream)."""
    dataset = run.get("dataset") or {}
    if not dataset.get("stream"):
        return None
    where = dataset.get("defined_at") or dataset.get("class")
    return (f"{where}: in {dataset.get('class')}.__iter__, yield only every info.num_workers-th sample from info.id "
            "on, where info = torch.utils.data.get_worker_info()")
