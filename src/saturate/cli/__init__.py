"""The one command-line entry point: the parser, and errors turned into one line and an exit code.

Each verb is a thin module over the public API (`probe`/`train` here; `tune`, `run`, `doctor`, `monitor`
and `sweep` beside this file); the arguments they share are in `args`. Nothing below imports this module.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from saturate.cli import doctor as doctor_cli
from saturate.cli import env as env_cli
from saturate.cli import sweep as sweep_cli
from saturate.cli import tune as tune_cli
from saturate.cli.args import add_workload_args, positive, recorded_source, source_from_args, source_record
from saturate.cli.output import (
    add_common_flags,
    json_document,
    run_result_dict,
    show_machine,
    show_plan,
    tidy_console,
    verbosity,
)
from saturate.engine.console import say_stopped
from saturate.engine.signals import (
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    Preempted,
    preemption_raises,
    stop_exit_code,
)
from saturate.workloads.source import Source, from_source

EXIT_ERROR = 2
EXIT_OOM = 3


class _Parser(argparse.ArgumentParser):
    """argparse, its errors in saturate's one line (no usage above it; `--help` shows that), with "did you
    mean" for a mistyped verb, choice or option."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        import re

        from saturate.errors import did_you_mean

        if m := re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message):
            message += did_you_mean(m.group(1), re.findall(r"'([^']*)'", m.group(2)))
        elif m := re.search(r"unrecognized arguments: (\S+)", message):
            message += did_you_mean(m.group(1), _option_strings(self))
        # "argument --seed: --seed must be …" (our types name their flag): the flag once
        if (m := re.match(r"argument (\S+): (.*)", message)) and m.group(2).startswith(m.group(1)):
            message = m.group(2)
        self.exit(EXIT_ERROR, f"saturate: error: {message}\n")


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every long option of `parser` and of its verbs."""
    out = []
    for action in parser._actions:
        out += [o for o in action.option_strings if o.startswith("--")]
        if isinstance(action, argparse._SubParsersAction):
            for sp in action.choices.values():
                out += _option_strings(sp)
    return sorted(set(out))


def build_parser() -> argparse.ArgumentParser:
    from saturate import __version__

    parser = _Parser(
        prog="saturate",
        description="Make PyTorch training use its hardware fully. With no command: `run` gpt-tiny on the "
                    "embedded default corpus (the Python standard library's source): tune, train, compare.")
    parser.add_argument("--version", action="version", version=f"saturate {__version__}")
    add_common_flags(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("probe", help="what this machine has, with measured matmul peaks")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.add_argument("--device", help="cuda, mps or cpu (default: the best one found)")
    p.add_argument("--no-peaks", action="store_true", help="skip the matmul peak measurement")
    p.set_defaults(func=cmd_probe)

    p = sub.add_parser("train", help="train a preset with a plan; checkpoints, metrics, exact resume")
    add_workload_args(p)
    p.add_argument("--plan", metavar="FILE|NAME",
                   help="a plan.toml, or a reference plan (naive, a6000-after, …); default: the checkpoint's "
                        "plan when resuming, else a seed plan keeping the preset's effective batch")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=positive(int, "--steps"), help="optimizer steps (default: the preset's)")
    length.add_argument("--minutes", type=positive(float, "--minutes"),
                        help="train for this long; sizes the schedule to fit")
    p.add_argument("--resume", action="store_true", help="continue the newest checkpoint in --run-dir")
    p.add_argument("--run-dir", type=Path, help="default: runs/<preset>-<time>; with --resume, the newest run")
    p.add_argument("--log-every", type=positive(int, "--log-every"), metavar="N",
                   help="steps between metric reads, each one host sync (default: 10; with --resume, the run's)")
    p.add_argument("--eval-every", type=positive(int, "--eval-every"), metavar="N",
                   help="steps between validations (default: the preset's; with --resume, the run's)")
    p.add_argument("--ckpt-every", type=positive(int, "--ckpt-every"), metavar="N",
                   help="steps between checkpoints (default: --eval-every; with --resume, the run's)")
    p.add_argument("--keep", type=positive(int, "--keep"), metavar="K",
                   help="checkpoints kept (default: 3; with --resume, the run's)")
    p.add_argument("--no-progress", action="store_true",
                   help="no live progress while training (the start line and the summary are still printed; "
                        "-q leaves only the summary)")
    p.add_argument("--json", action="store_true",
                   help="the result (plan, figures, paths) as one JSON document on stdout; the rest on stderr")
    p.add_argument("--no-tuned", action="store_true",
                   help="ignore the tuned plan cached for this preset on this machine (with no --plan)")
    p.add_argument("--stuck-after", type=positive(float, "--stuck-after"), metavar="SECONDS",
                   help="stop the run when a rank (under torchrun) or a data-loader worker gives no answer for "
                        "this long, naming it (default: $SATURATE_STUCK_AFTER, else 600)")
    p.add_argument("--config", type=Path, metavar="RUN.TOML",
                   help="replay a run: the run.toml of its folder (workload, data, plan, steps, seed, cadence); "
                        "flags given with it win")
    p.add_argument("--log-to", metavar="SINKS",
                   help="metric sinks besides metrics.jsonl, comma-separated: tensorboard, csv, wandb, mlflow "
                        "(default: tensorboard)")
    p.add_argument("--early-stop", metavar="METRIC:PATIENCE[:MIN_DELTA]",
                   help="stop after PATIENCE validations without METRIC improving by more than MIN_DELTA "
                        "(e.g. val/loss:5), with a checkpoint")
    p.set_defaults(func=cmd_train)

    for verbs in (tune_cli, doctor_cli, sweep_cli, env_cli):  # tune and run; doctor and monitor; sweep; env
        verbs.add_parsers(sub)
    for verb in sub.choices.values():  # `saturate train -q --debug …` as well as `saturate -q --debug train …`
        add_common_flags(verb, top=False)
    return parser


def cmd_probe(args: argparse.Namespace) -> int:
    from saturate.hardware import probe, render_hardware

    hw = probe(measure_peaks=not args.no_peaks, device=args.device)
    if args.json:
        print(json.dumps(hw.to_dict(), indent=2))
    else:
        render_hardware(hw, tidy_console())
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from saturate.engine.trainer import RunConfig, train
    from saturate.hardware import probe
    from saturate.plan import resolve_plan

    src = source_from_args(args)
    if args.resume and args.run_dir is not None and src == Source():
        # `--resume --run-dir R` alone: the workload the run was started with (its flags, in run.json)
        src = recorded_source(args.run_dir) or src
    config = RunConfig(
        steps=args.steps, minutes=args.minutes, run_dir=args.run_dir, resume=args.resume, seed=src.seed,
        device=args.device, log_every=args.log_every, eval_every=args.eval_every,
        ckpt_every=args.ckpt_every, keep_checkpoints=args.keep,
        progress=not args.no_progress and verbosity(args) >= 0, quiet=verbosity(args) < 0,
        use_tuned=not args.no_tuned, source=source_record(src), stuck_after=args.stuck_after,
        early_stop=args.early_stop, **_sinks(args.log_to),
    )
    # None: the checkpoint's, or the seed plan; --config: the replayed run's
    plan = resolve_plan(args.plan) if args.plan else getattr(args, "config_plan", None)
    with json_document(args) as emit:
        hw = probe(measure_peaks=False, device=args.device)
        show_machine(args, hw)
        workload = from_source(src)
        result = train(workload, plan, config, hardware=hw, on_stopped=say_stopped)
        show_plan(args, result.plan, "the plan trained")
        emit(run_result_dict(result))
    return stop_exit_code(result.stop_signal) if result.interrupted else 0


def entry() -> None:
    """The `saturate` command and `python -m saturate`: `main`, then the process ends without Python's teardown of
    every imported module (`quick_exit`)."""
    from saturate.cli.quick_exit import exit_now

    exit_now(main())


def main(argv: Sequence[str] | None = None) -> int:
    from saturate.errors import SaturateError

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    script = None
    if "--" in argv:  # `saturate doctor [OPTIONS] -- CMD …`: the user's own command, taken as it is
        cut = argv.index("--")
        argv, script = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is not None:  # train --config run.toml: the file's settings, the flags on top
        args = _replay(parser, argv, args)
        if args is None:
            return EXIT_ERROR
    if args.command is None:  # `saturate` alone runs the main job on the embedded default
        args = parser.parse_args([*argv, "run"])
    if script is not None:
        if not hasattr(args, "script"):
            parser.error(f"`saturate {args.command}` takes no command after `--` (doctor, tune and run do)")
        args.script = script
    try:
        from saturate import policy

        policy.check()  # a SATURATE_POLICY file that was refused: one line, before anything runs
        with preemption_raises():
            return args.func(args)
    except SaturateError as e:
        if args.debug:
            raise
        print(f"saturate: error: {_rank_prefix()}{e}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as e:  # a disk or permission problem that no layer turned into a SaturateError
        if args.debug:
            raise
        where = f": {e.filename}" if e.filename else ""
        print(f"saturate: error: {_rank_prefix()}{e.strerror or e}{where}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as e:
        import torch

        if isinstance(e, torch.OutOfMemoryError) and not args.debug:
            first = str(e).strip().splitlines()[0] if str(e).strip() else "out of memory"
            print(f"saturate: error: {_rank_prefix()}out of memory ({first}); lower plan.micro_batch and raise "
                  "plan.grad_accum, or enable activation_checkpointing", file=sys.stderr)
            return EXIT_OOM
        if (stuck := _stuck(e)) is not None and not args.debug:
            print(f"saturate: error: {_rank_prefix()}{stuck}", file=sys.stderr)
            return EXIT_ERROR
        if _lost_a_peer(e) and not args.debug:
            print(f"saturate: error: {_rank_prefix()}lost contact with another rank ({_first_line(e)}); that "
                  "rank's own error, above, is the cause", file=sys.stderr)
            return EXIT_ERROR
        raise
    except KeyboardInterrupt:
        print("saturate: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Preempted as e:  # outside the training loop: nothing of this session to save
        print(f"saturate: {_rank_prefix()}stopped by {e.signal_name} (any earlier checkpoint is kept)", file=sys.stderr)
        return EXIT_PREEMPTED
    finally:
        _leave_process_group()


def _sinks(log_to: str | None) -> dict[str, object]:
    """RunConfig's sink settings for --log-to (absent: its defaults, TensorBoard and metrics.jsonl)."""
    from saturate.engine.trackers import parse_log_to

    if log_to is None:
        return {}
    names = parse_log_to(log_to)
    return {"log_to": names, "tensorboard": "tensorboard" in names}


def _replay(parser: argparse.ArgumentParser, argv: Sequence[str],
            args: argparse.Namespace) -> argparse.Namespace | None:
    """`train --config run.toml` parsed with the file as defaults; None when the file is refused (said in one line)."""
    from saturate.cli.replay import parse_with_config
    from saturate.errors import SaturateError

    try:
        return parse_with_config(parser, argv, args.config)
    except SaturateError as e:  # before the verb runs: the same one line as its errors
        if args.debug:
            raise
        print(f"saturate: error: {e}", file=sys.stderr)
        return None


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _rank_prefix() -> str:
    """Under torchrun every rank reports its own error: say which one."""
    return f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""


def _lost_a_peer(e: BaseException) -> bool:
    """A collective failed because another rank went away (it crashed, or torchrun stopped it)."""
    text = str(e)
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and any(
        k in text for k in ("closed by peer", "reset by peer", "Broken pipe", "Connection refused"))


def _stuck(e: BaseException) -> str | None:
    """For a collective or a data-loader batch that timed out, one line naming what did not answer."""
    from saturate.engine.distributed import stuck_after_s, unresponsive_ranks

    text = str(e)
    limit = f"{stuck_after_s():g} s"
    if "DataLoader timed out" in text:
        import multiprocessing

        import psutil

        workers = multiprocessing.active_children()  # this process's own loader workers
        stopped = []
        for w in workers:
            try:
                if psutil.Process(w.pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_DISK_SLEEP):
                    stopped.append(w.pid)
            except psutil.Error:
                pass
            w.kill()  # a stopped worker ignores SIGTERM, and the exit would wait for it forever
        # torch's SIGCHLD handler would call a killed worker an error again when the loader is freed at exit
        # (an "Exception ignored in __del__" traceback after this line): the workers are ours to reap now.
        import signal

        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for w in workers:
            w.join(timeout=5)
        who = (f"worker pid {', '.join(map(str, stopped))} is stopped" if stopped
               else f"a worker (pids {', '.join(str(w.pid) for w in workers)}) is stuck")
        return (f"the data loader gave no batch for {limit}: {who}; raise --stuck-after if a batch can "
                "legitimately take longer")
    # gloo says "Timed out waiting …" or, when its pair's deadline fires first, "Application timeout caused pair
    # closure"; NCCL's watchdog says "… ran for N milliseconds before timing out"
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or not re.search(r"timed out|timeout|timing out", text, re.I):
        return None
    silent = unresponsive_ranks(int(os.environ["WORLD_SIZE"]))
    if silent:
        who = ", ".join(f"rank {r}" + (f" (no sign of life for {age:.0f} s)" if age is not None else " (never seen)")
                        for r, age in silent)
        return (f"{who} did not answer within {limit}: stopped, frozen or dead; the other ranks stop "
                "(raise --stuck-after if a step can legitimately take longer)")
    return (f"a collective timed out after {limit} waiting for another rank, whose process is alive but stuck "
            "(raise --stuck-after if a step can legitimately take longer)")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:160] if text else type(e).__name__


def _leave_process_group() -> None:
    """Destroy a process group a command made, after any error was handled (its traceback freed)."""
    if "saturate.engine.distributed" in sys.modules:
        sys.modules["saturate.engine.distributed"].teardown_distributed()
