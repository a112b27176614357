"""The split of the effective batch in a loop of the script's own: found where the script keeps it, tried from
outside, kept only when verified (`tune -- CMD`, for a script with no Trainer).

The child names what the training DataLoader's `batch_size=` is (`cfg.batch_size`, `args.batch_size`,
`BATCH_SIZE`, or a literal) and the integer settings beside it whose names say accumulation
(`child/split_source.py`). The accumulation is the one among them whose value is the backward passes the run made
per optimizer step; without exactly one, the split is not tried, and the decision says what was found. A trial sets
both where the loop keeps them just before that DataLoader is made (`Overrides.train_loader["set"]`), so every
exact split of the effective batch can be climbed as a Trainer's is (`trainer_stages.split_stage`).

A loop without a DataLoader whose command line sets its globals through nanoGPT's configurator has its split
found there instead: the global that says batch holding the first forward's leading dimension, the one that says
accumulation holding the backward passes before the first optimizer step; a trial gives both as `--name=value`
flags appended to its command line (`Overrides.flags`), and the child says whether the globals took them. A
script that parses its command line with argparse has its split found among its flags the same way, and that
route comes first: the flag is what a user would change, and it reaches code that reads the accumulation before
the DataLoader is made (`accelerate`'s `Accelerator(gradient_accumulation_steps=...)`, whose prepared loader is
not the script's own) — where no one flag of each holds the run's split, the DataLoader's names are tried.

A split is kept only when the child's run shows it trained as written (script/same_training.py: the same samples
per optimizer step, the same samples in the same order, and its first losses within tolerance of the script's
own, where two runs of the script as written agree) — a loop that read its accumulation before the DataLoader was
made, or divides its loss by a number of its own, fails that and is not kept. What could not be verified is not
kept either, and says why.
"""

from __future__ import annotations

from typing import Any

from saturate.errors import SaturateError
from saturate.script.overrides import Overrides

NO_ACCUMULATION = ("not tried (no accumulation: one micro-batch per optimizer step, so the micro-batch is the "
                   "effective batch; a larger one changes the optimisation, a decision that is yours — the doctor's "
                   "larger-batch fix predicts its speed)")


class LoopSplit:
    """A plain loop's split as the as-written run's report saw it (`trainer_stages.Framework`'s split part)."""

    def __init__(self, report: dict[str, Any]) -> None:
        self.loader = (report.get("loaders") or [{}])[0]
        self.accum = int(round((report.get("measurements") or {}).get("grad_accum") or 1))
        self.source = self.loader.get("split") or {}
        self.accum_name: str | None = None
        self.globals = report.get("configurator") if not report.get("loaders") else None
        self.parsed = report.get("argparse")  # its argparse flags that say batch or accumulation
        self.world = int(report.get("world_size") or 1)
        self.micro_name: str | None = None

    def split(self) -> tuple[int, int] | str:
        if self.globals:
            return self._flags_split(self.globals, "its configurator's settings")
        if self.parsed and self.world == 1:
            found = self._flags_split(self.parsed, "its command-line flags", self.loader.get("batch_size"))
            if not isinstance(found, str):
                return found
        loader, source = self.loader, self.source
        micro = loader.get("batch_size")
        if not loader or not micro or not loader.get("sets_batch_size", True):
            return "not tried (no training DataLoader with a batch_size= of its own fed the timed steps)"
        if not loader.get("site") or not source:
            return "not tried (the training DataLoader's call could not be read: where its batch size comes from)"
        found = {name: value for name, value in source.get("accum", {}).items() if value == self.accum}
        if len(found) == 1:
            self.accum_name = next(iter(found))
            return int(micro), self.accum
        if self.accum == 1:
            return NO_ACCUMULATION
        local = {f"{k} (a local variable)": v for k, v in source.get("locals", {}).items()}
        seen = {**source.get("accum", {}), **local}
        said = ", ".join(f"{k} = {v}" for k, v in seen.items()) or "no setting named for accumulation"
        return (f"not tried (the loop accumulates {self.accum} micro-batches a step, and no one setting saturate can "
                f"change from outside holds that number: {said})")

    def _flags_split(self, g: dict[str, Any], what: str, batch: int | None = None) -> tuple[int, int] | str:
        """A split held on the command line: the configurator's globals or argparse flags (`g`) that hold the
        micro-batch (the first forward's leading dimension, or the loader's `batch` size) and the accumulation the
        run had."""
        micro, accum = g.get("rows"), int(g.get("backwards") or 1)
        if self.world > 1:
            return (f"not tried (a command of {self.world} processes: a configurator's accumulation is divided among "
                    "them; run it on one to have the split tried)")
        if accum == 1:
            return NO_ACCUMULATION
        micros = {k: v for k, v in g.get("micro", {}).items() if v in (micro, batch)}
        accums = [k for k, v in g.get("accum", {}).items() if v == accum]
        if len(micros) == 1 and len(accums) == 1:
            (self.micro_name, micro), = micros.items()
            self.accum_name, self.accum = accums[0], accum
            return int(micro), accum
        seen = ", ".join(f"{k} = {v}" for k, v in {**g.get("micro", {}), **g.get("accum", {})}.items()) or "none"
        return (f"not tried (the loop ran micro-batches of {micro} and {accum} backward passes a step, and "
                f"{what} do not name exactly one of each: {seen})")

    def split_overrides(self, micro: int, accum: int) -> Overrides:
        if self.micro_name and self.accum_name:
            return Overrides(flags={self.micro_name: micro, self.accum_name: accum})
        names = {self.accum_name: accum} if self.accum_name else {}
        if self.source.get("micro"):
            names[self.source["micro"]] = micro
        return Overrides(train_loader={"site": self.loader["site"], "batch_size": micro, "set": names})


def split_flags(report: dict[str, Any], micro: int, accum: int) -> str | None:
    """A split of `micro` × `accum` as the flags of the script's command line that hold its split (its argparse
    flags or configurator's), or None where no one flag of each holds it (the doctor's fix, in the script's terms)."""
    if not (report.get("argparse") or report.get("configurator")):
        return None
    loop = LoopSplit(report)
    if isinstance(loop.split(), str) or not loop.micro_name:
        return None
    return " ".join(loop.split_overrides(micro, accum).argv())


def loop_split_stage(search: Any, report: dict[str, Any], allow_change: bool) -> None:
    """Climb the loop's exact splits (`trainer_stages.split_stage`), each verified (`split_verified`). Where trials
    run alone, the script as written is first run again, so that its losses' repeatability is known."""
    from saturate.script.overrides import NONE
    from saturate.script.same_training import loss_noise
    from saturate.script.trainer_stages import split_stage

    loop, result = LoopSplit(report), search.result
    if not isinstance(loop.split(), str) and result.paired is not None and result.loss_noise is None:
        try:
            again, _ = search.trial("again: as written", NONE)
        except SaturateError as e:
            again = None
            result.decisions.append(f"micro-batch: the script as written failed when run again ({e})")
        if again is not None:
            again.outcome = "the script as written again: do its first losses repeat (a split is kept only verified)"
            result.trials.append(again)
            result.loss_noise = loss_noise(again, result.baseline)
    split_stage(search, loop, report.get("model"), allow_change, check=split_verified)


def split_verified(t: Any) -> str | None:
    """Why a split trial is not verified to train as written (the child's checks, `same_training`), or None."""
    failed = {k: v for k, v in (t.split_set or {}).items() if v != "set"}
    if failed:
        return "its split could not be set where the loop keeps it: " + "; ".join(f"{k}: {v}" for k, v in
                                                                                  failed.items())
    if t.same is None or t.same.get("loss_drift") is None:
        return ("its first losses could not be compared with the script's own (a split is kept only when "
                "verified: see its note)")
    seen = ("the same samples per step, in the same order" if t.same.get("same") != "NOT_SEEN" else
            "its settings took the values and the same effective batch ran (no DataLoader: the samples not "
            "fingerprinted)")
    t.note = f"verified: {seen}, its first losses within {100 * t.same['loss_drift']:.2f} % of the script's own"
    return None
