"""A run's folder and its checkpoints' contents: where a run lives, which plan it continues with, what a
checkpoint holds (`snapshot`), and putting that back (`restore`), refusing a checkpoint of another
model, other data or another effective batch.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from saturate.engine.checkpoint import CheckpointManager, restore_model_and_optimizer
from saturate.engine.distributed import DistInfo
from saturate.engine.precision import Precision
from saturate.engine.schedule import WarmupCosine
from saturate.engine.step import Stepper, own_threads, rng_state, set_rng_state
from saturate.errors import CheckpointError, ConfigError, file_not_folder
from saturate.hardware.contention import measure_contention
from saturate.plan import Plan, fit_to_world, informed_summary
from saturate.provenance import without
from saturate.workloads.base import Workload
from saturate.workloads.coupling import workload_default_plan

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the run folder is not locked
    fcntl = None  # type: ignore[assignment]

CHECKPOINT_FORMAT = 1  # the same for a file and a DCP folder's meta.pt


def prepare_run_dir(run_dir: Path | None, resume: bool, workload: Workload) -> Path:
    if run_dir is None:
        if resume:
            run_dir = latest_run_dir(workload.name)
            if run_dir is None:
                raise CheckpointError(f"--resume: no run of {workload.name} with checkpoints under runs/")
        else:
            run_dir = _new_default_dir(Path("runs") / f"{workload.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir = Path(run_dir)
    if (why := file_not_folder(run_dir, "run folder", "--run-dir")) is not None:
        raise ConfigError(why)
    if resume and not run_dir.is_dir():
        raise CheckpointError(f"--resume: run folder {run_dir} does not exist")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe_file = run_dir / f".write-test-{os.getpid()}"
        probe_file.write_bytes(b"")
        probe_file.unlink()
    except OSError as e:
        raise ConfigError(f"run folder {run_dir} is not writable: {e.strerror or e}") from None
    return run_dir


def _new_default_dir(base: Path) -> Path:
    """`base`, or `base-2`, `base-3`…: the first that did not exist (mkdir is the atomic claim), so two runs
    started in the same second never share a folder."""
    for i in range(1, 1000):
        candidate = base if i == 1 else base.with_name(f"{base.name}-{i}")
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            continue
        except OSError as e:
            raise ConfigError(f"run folder {candidate} is not writable: {e.strerror or e}") from None
    raise ConfigError(f"could not find a free run folder name next to {base}")


_held: dict[str, int] = {}  # run folder -> the descriptor holding its lock (this process)


def lock_run_dir(run_dir: Path) -> None:
    """Claim the run folder for this process: a second run writing the same folder (duplicated metrics,
    overwritten checkpoints) is refused in one line naming the holder's PID. An advisory lock (flock) on
    the folder itself, so no file is left behind; the kernel releases it when the holder exits, however
    it exits (SIGKILL included)."""
    key = os.path.abspath(run_dir)
    if key in _held or fcntl is None:
        return
    try:
        fd = os.open(run_dir, os.O_RDONLY)
    except OSError as e:
        raise ConfigError(f"run folder {run_dir} is not readable: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ConfigError(f"run folder {run_dir} is in use by another saturate run (pid {_lock_holder(run_dir)}); "
                          "wait for it to end or choose another --run-dir") from None
    _held[key] = fd


def _lock_holder(run_dir: Path) -> str:
    """The PID holding the folder's flock, from /proc/locks (Linux); else the PID its run.json records."""
    st = os.stat(run_dir)
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} "
    try:
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if "FLOCK" in fields and where in f"{line} " and len(fields) > 4:
                return fields[4]
    except OSError:
        pass
    try:
        return str(json.loads((Path(run_dir) / "run.json").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return "unknown"


def remove_stale_temporaries(run_dir: Path) -> None:
    """The `.NAME.tmp-*` files an atomic write leaves when its process is killed (model.safetensors,
    run.json, plan.toml…); only called by the process holding the folder's lock."""
    for p in Path(run_dir).glob(".*.tmp-*"):
        if p.is_file():
            p.unlink(missing_ok=True)


def release_run_dirs() -> None:
    """Release the run folders this process locked (train() does, however it ends)."""
    while _held:
        os.close(_held.popitem()[1])


def latest_run_dir(workload_name: str, root: Path = Path("runs")) -> Path | None:
    """The most recently checkpointed run folder of this workload under `root`."""
    candidates = []
    for d in root.glob(f"{workload_name}-*"):
        found = CheckpointManager(d / "checkpoints").checkpoints()
        if found:
            candidates.append((found[-1][1].stat().st_mtime, d))
    return max(candidates)[1] if candidates else None


def load_resume_state(ckpts: CheckpointManager, dist: DistInfo) -> dict[str, Any]:
    if dist.is_main:
        ckpts.remove_stale_temporaries()  # nothing is being written yet: every rank is here
    loaded = ckpts.load_latest(check=_check_format)
    if loaded is None:
        why = f" ({'; '.join(ckpts.skipped)})" if getattr(ckpts, "skipped", None) else ""
        raise CheckpointError(f"--resume: no loadable checkpoint in {ckpts.folder}{why}")
    state, path = loaded
    if ckpts.skipped and dist.is_main:  # the newest was damaged or foreign: say which and why, then what is used
        for why in ckpts.skipped:
            print(f"saturate: warning: {why}; skipped", file=sys.stderr)
        print(f"saturate: warning: resuming from the previous good checkpoint {path} (step {state['step']})",
              file=sys.stderr)
    state["path"] = str(path)
    return state


def _check_format(state: dict[str, Any], path: Path) -> None:
    if "format" not in state or "step" not in state:
        raise CheckpointError(f"{path} is not a saturate checkpoint (no format or step in it)")
    if state["format"] != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} has checkpoint format {state['format']}, expected {CHECKPOINT_FORMAT}")


def checkpoint_plan(state: dict[str, Any], world: int, notes: list[str]) -> Plan:
    """The checkpoint's plan, its accumulation re-derived when the process count changed."""
    plan = Plan.from_dict(state["plan"], source="the checkpoint's plan")
    saved_world = state.get("world_size", 1)
    if saved_world == world:
        return plan
    effective = plan.samples_per_step(saved_world)
    try:
        fitted = fit_to_world(plan, effective, world)
    except ConfigError as e:
        raise CheckpointError(f"cannot resume {state['path']}, written by {saved_world} process(es), with {world}: "
                              f"{e}; pass a --plan with micro_batch × grad_accum × {world} = {effective}") from None
    notes.append(f"resuming a checkpoint of {saved_world} process(es) with {world}: grad_accum "
                 f"{plan.grad_accum} -> {fitted.grad_accum} keeps the effective batch {effective}")
    return fitted


def check_fingerprint(state: dict[str, Any], fingerprint: dict[str, str], identity: dict[str, Any],
                       world: int = 1) -> None:
    """Refuse to resume another model, other data or another effective batch, naming what differs."""
    theirs = state["fingerprint"]
    differ = [k for k in sorted(set(theirs) | set(fingerprint)) if theirs.get(k) != fingerprint.get(k)]
    if not differ:
        return
    old_identity = state.get("identity", {})
    parts = []
    for k in differ:
        if k == "effective_batch":
            saved_world = state.get("world_size", 1)
            counts = f" ({saved_world} process(es) then, {world} now)" if saved_world != world else ""
            parts.append(f"effective batch {theirs.get(k)} -> {fingerprint.get(k)}{counts}")
            continue
        old, new = old_identity.get(k), identity.get(k)
        if isinstance(old, dict) and isinstance(new, dict):
            fields = [f"{f} {old.get(f)!r:.20} -> {new.get(f)!r:.20}" for f in sorted(set(old) | set(new))
                      if old.get(f) != new.get(f)]
            parts.append(f"{k} ({', '.join(fields[:3])})")
        else:
            parts.append(k)
    raise CheckpointError(f"cannot resume from {state['path']}: it was trained with different "
                          f"{'; '.join(parts)}")


# The fields of an Optimization that change the maths of the rest of a run (not its length or validation).
OPTIMIZATION_FIELDS = ("effective_batch", "lr", "warmup_steps", "min_lr_ratio", "weight_decay", "betas", "grad_clip")


def optimization_record(optim: Any) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k in OPTIMIZATION_FIELDS for v in [getattr(optim, k)]}


def check_optimization(state: dict[str, Any], optim: Any) -> None:
    """Refuse to continue a run with another optimisation (an --effective-batch or --param lr=… that differs
    from the run's would rescale or replace the learning rate mid-run), naming what differs."""
    theirs = state.get("optimization")
    if theirs is None:  # written before the optimisation was recorded
        return
    mine = optimization_record(optim)
    differ = [f"{k} {theirs.get(k)!r} -> {mine[k]!r}" for k in OPTIMIZATION_FIELDS if theirs.get(k) != mine[k]]
    if differ:
        raise CheckpointError(f"cannot resume from {state['path']}: it was trained with a different optimisation "
                              f"({', '.join(differ)}); resume with the run's own settings (--resume --run-dir "
                              "alone reuses them)")


def choose_plan(plan: Plan | None, state: dict[str, Any] | None, workload: Workload, hw: Any, use_tuned: bool,
                notes: list[str], world: int = 1) -> Plan:
    """The given plan; else the checkpoint's when resuming; else the tuned plan cached for this workload
    on this hardware; else the seed plan. A plan tuned on other hardware is flagged, never silent.
    Under torchrun the checkpoint's and the cached plan keep their effective batch over `world` processes."""
    from saturate import plan_cache

    if plan is not None:
        if (warning := plan_cache.hardware_mismatch(plan, hw.fingerprint())) is not None:
            notes.append(warning)
        return plan
    if state is not None:
        return checkpoint_plan(state, world, notes)
    if use_tuned:
        cached, cache_notes = plan_cache.lookup(workload, hw.fingerprint(), world)
        notes.extend(cache_notes)
        tuned_world = int(cached.provenance.get("world_size", 1)) if cached is not None else world
        if cached is not None and tuned_world != world:
            try:
                cached = fit_to_world(cached, cached.samples_per_step(tuned_world), world).replace(
                    strategy=cached.strategy if cached.strategy != "single" else "ddp")
            except ConfigError as e:
                notes.append(f"the cached tuned plan does not split over {world} processes ({e}); not used")
                cached = None
        if cached is not None:
            notes.append(f"using the plan tuned for {workload.name} on this machine "
                         f"({cached.provenance.get('tuned_at', 'date unknown')}); --no-tuned ignores it")
            if cached.threads is not None:  # a count chosen for a busy machine (tune/search.py `threads`)
                cached = threads_for_now(cached, hw, notes, world)
            return cached
    plan, coupled = workload_default_plan(workload, hw, world)
    if coupled:
        notes.append(coupled)
    notes.append(f"the seed plan: {informed_summary(plan)}; `saturate tune` measures one")
    return plan


def threads_for_now(plan: Plan, hw: Any, notes: list[str], world: int = 1, seconds: float = 0.5) -> Plan:
    """A tuned plan's intra-op thread count, checked against the load now. The tuner sets a count only when other
    processes kept the CPU busy (tune/start.py, tune/search.py); on a quiet machine that count is the wrong one
    (slower than torch's own; measured: bench/results/cpu-2026-11-26c/README.md). So the load is read for
    `seconds` before training: quiet, torch's own count replaces the plan's, said in a note; busy, or unread, or
    on several processes (each rank would read its own), the plan's count stays, said too."""
    n, why = plan.threads, plan.provenance.get("threads", "set in the plan")
    kept = (f"the tuned plan uses {n} intra-op thread(s) ({why})")
    if hw.device_type != "cpu" or world > 1:
        notes.append(f"{kept}; on a quieter machine, tune again or use --no-tuned")
        return plan
    now = measure_contention(seconds)
    if now.other_cores is None:
        notes.append(f"{kept}; the load now was not read ({'; '.join(now.notes) or 'no reading'}), so it stays")
        return plan
    load = f"other processes keep {now.other_cores:.1f} of {now.usable_cores} cores busy"
    if now.significant():
        notes.append(f"{kept}; {load} now too, so it stays")
        return plan
    own = own_threads()
    notes.append(f"{kept}, but the machine is quiet now ({load}): torch's own {own} are used instead; tune again "
                 "on a quiet machine for a plan made for one")
    dropped = f"torch's {own}: the tuned {n} ({why}) dropped, the machine quiet at the start ({load})"
    return plan.replace(threads=None, provenance={**without(plan.provenance, "threads"), "threads": dropped})


def snapshot(step: int, stepper: Stepper, precision: Precision, schedule: WarmupCosine, plan: Plan,
              fingerprint: dict[str, str], identity: dict[str, Any], train_seconds: float, seed: int,
              world: int, optimization: dict[str, Any] | None = None,
              early_stop: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything a resume needs; for DDP/FSDP without model and optimizer, which go through DCP."""
    state: dict[str, Any] = {}
    if stepper.strategy == "single":
        state = {"model": stepper.model.state_dict(), "optimizer": stepper.optimizer.state_dict()}
    return {
        **state,
        "format": CHECKPOINT_FORMAT,
        "step": step,  # the data position: step s next reads global samples [s·E, (s+1)·E)
        "world_size": world,
        "scaler": precision.scaler.state_dict() if precision.scaler is not None else None,
        "schedule": schedule.state_dict(),
        "rng": rng_state(),
        "plan": plan.to_dict(),
        "fingerprint": fingerprint,
        "identity": identity,  # the values behind the fingerprint, to say what differs on a refusal
        "train_seconds": train_seconds,
        "seed": seed,
        "optimization": optimization,  # the workload's Optimization fields a resume must keep (check_optimization)
        "early_stop": early_stop,  # the early-stopping counter and best value, so a resume stops where it would have
    }


def restore(state: dict[str, Any], stepper: Stepper, schedule: WarmupCosine, steps: int | None,
            dist: DistInfo, notes: list[str]) -> None:
    """Put a checkpoint's model, optimizer, schedule, GradScaler and RNG states back. The schedule keeps
    its length unless `steps` (the user's --steps) sets a new one; the learning rate is the current plan's."""
    peak_lr, min_lr = schedule.peak_lr, schedule.min_lr
    restore_model_and_optimizer(state, Path(state["path"]), stepper.model, stepper.optimizer,
                                stepper.strategy == "fsdp")
    schedule.load_state_dict(state["schedule"])
    schedule.peak_lr, schedule.min_lr = peak_lr, min_lr
    if stepper.precision.scaler is not None and state.get("scaler"):
        stepper.precision.scaler.load_state_dict(state["scaler"])
    if state.get("rng") is not None:
        set_rng_state(state["rng"])
    elif dist.is_main:
        notes.append(f"the checkpoint has no RNG state for some of the {dist.world_size} ranks (it was written by "
                     f"{state.get('world_size', 1)}); those ranks continue from fresh seeds")
    if steps is not None:
        schedule.total_steps = steps
