"""Whether a trial of `tune -- CMD` trains as the script as written does: the data, the batch and the losses.

Every trial is checked before it may be kept, whatever knob it turned (tune_script.py `_Search._decide`):

- its training DataLoader's fingerprint against the as-written run's (`data.fingerprint.compare`): other samples,
  samples repeated (a stream each loader worker replays whole), another epoch size or other samples per optimizer
  step make it no candidate, however fast it measured;
- its first losses against the script's own, within `POLICY.job.loss_tolerance` of the loss's scale, where they
  can be compared: the same batches went in (its fingerprint the same, or no DataLoader to differ), and two runs
  of the script as written agreed within that tolerance themselves (`ScriptTuning.loss_noise`, read where the
  tuning has a second as-written run: the first paired comparison's). Where they cannot, the trial says so.

Precision changes keep their own check against the script's losses (trainer_stages.py), which needs no second run.
"""

from __future__ import annotations

from typing import Any

from saturate.data.fingerprint import Same, SameCheck, compare
from saturate.engine.precision_guard import loss_drift
from saturate.policy import POLICY

# what a kept trial says of data that is not the same batch for batch but trains alike
# the script's own `DataLoader(in_order=False)` given workers: the order it allows, not one the change made
OUT_OF_ORDER = "the same samples, in the order its workers finish them (the script's in_order=False allows it)"
NOTED = {Same.SAME_SAMPLES: "the same samples, other random draws",
         Same.SHARDED_STREAM: "the stream in another order: its workers each yield their share"}


def same_as_written(t: Any, written: Any) -> SameCheck:
    """`t`'s training data against the script as written's run `written` (both `ScriptTrial`s), recorded on `t`."""
    check = compare(written.fingerprint, t.fingerprint, samples_per_step=(written.samples_per_step,
                                                                          t.samples_per_step))
    t.same = check.to_dict()
    return check


def changed_training(t: Any, result: Any) -> str | None:
    """Why `t` does not train as the script as written does (one line), or None; what was checked is noted on `t`
    (`t.same`, `t.note`)."""
    written = result.baseline
    if t is written or t.overrides == written.overrides:
        return None
    check = same_as_written(t, written)
    if check.changed:
        return f"it changes the training: {check.text()}" + (f" — to make it safe: {check.edit}" if check.edit else "")
    why = _losses_differ(t, written, check, result.loss_noise)
    if why is None and check.same is Same.SAME_SAMPLES and _out_of_order(t, result):
        _note(t, OUT_OF_ORDER)
    elif why is None and check.same in NOTED:
        _note(t, NOTED[check.same])
    return why


def _out_of_order(t: Any, result: Any) -> bool:
    """Whether `t`'s training loader hands batches over as its workers finish them (`in_order=False` in the script,
    with workers in the trial): the sampler's indices alike, the batches in another order."""
    loader = result.loaders[0] if result.loaders else {}
    return loader.get("in_order") is False and bool(t.overrides.loader.get("num_workers", loader.get("num_workers")))


def _losses_differ(t: Any, written: Any, check: SameCheck, noise: float | None) -> str | None:
    if check.same not in (Same.SAME, Same.NOT_SEEN) or not t.losses or not written.losses:
        return None
    if noise is None or noise > POLICY.job.loss_tolerance:
        seen = "not repeated" if noise is None else f"{100 * noise:.1f} % apart"
        _note(t, f"losses not compared (the script's own runs {seen})")
        return None
    n = min(len(t.losses), len(written.losses))
    drift = loss_drift(t.losses, written.losses)
    t.same["loss_drift"] = drift
    if drift > POLICY.job.loss_tolerance:
        return (f"its first {n} losses differ from the script's own by up to {100 * drift:.1f} % (the script's own "
                f"runs agree within {100 * noise:.2f} %, the tolerance is {100 * POLICY.job.loss_tolerance:.0f} %)")
    return None


def loss_noise(a: Any, b: Any) -> float | None:
    """How far two runs of the script as written (`ScriptTrial`s) are apart in their first losses, or None."""
    if not a.losses or not b.losses:
        return None
    return loss_drift(a.losses, b.losses)


def _note(t: Any, text: str) -> None:
    if text not in t.note:
        t.note = f"{t.note}; {text}" if t.note else text
