"""The first ten minutes, measured (issue 31): a fresh clone, the README's two commands, and the bad inputs.

    python3 bench/newcomer.py --out bench/results/<dir>          # clone of this repository's HEAD into a temp dir
    python3 bench/newcomer.py --skip-main --skip-setup           # the bad inputs alone (seconds)

1. `git clone` of this repository (HEAD) into a scratch folder, then the README's set-up command
   (`bash scripts/setup.sh`, which keeps an installed torch) — its wall time.
2. The main job, `python3 -m saturate run`, run twice over: on a pseudo-terminal (what a person sees: the live
   lines) and with pipes (what a log sees). For each: wall time, the longest stretch with no output at all, every
   line over 80 columns (ANSI escapes and carriage-return redraws taken out), lines ending in a space.
3. Each bad input of the issue's list: its exit code, how many lines it printed, and its first line.

The main job needs a quiet machine for its timings (~4 minutes on 2 cores); the silences and the line widths do
not depend on the load. Writes `newcomer.json` and `newcomer.md` under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def timed_output(cmd: list[str], cwd: Path, env: dict[str, str], tty: bool,
                 timeout: float) -> tuple[int, float, list[tuple[float, str]]]:
    """Run `cmd`; (exit code, wall seconds, [(time of arrival, chunk)]) of everything it wrote to stdout/stderr."""
    chunks: list[tuple[float, str]] = []
    t0 = time.monotonic()
    if tty:
        master, slave = pty.openpty()
        proc = subprocess.Popen(cmd, cwd=cwd, env={**env, "COLUMNS": "80", "TERM": "xterm"}, stdin=slave,
                                stdout=slave, stderr=slave, close_fds=True)
        os.close(slave)
        fds = [master]
    else:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        fds = [proc.stdout.fileno(), proc.stderr.fileno()]  # type: ignore[union-attr]
    open_fds = list(fds)
    while open_fds and time.monotonic() - t0 < timeout:
        ready, _, _ = select.select(open_fds, [], [], 0.5)
        for fd in ready:
            try:
                data = os.read(fd, 65536)
            except OSError:  # the pty's other side closed
                data = b""
            if not data:
                open_fds.remove(fd)
                continue
            chunks.append((time.monotonic() - t0, data.decode(errors="replace")))
    if proc.poll() is None and time.monotonic() - t0 >= timeout:
        proc.kill()
    rc = proc.wait()
    if tty:
        os.close(master)
    return rc, time.monotonic() - t0, chunks


def silences(chunks: list[tuple[float, str]], wall: float) -> list[tuple[float, float, str]]:
    """The gaps between outputs, longest first: (seconds, when it began, the text just before it)."""
    marks = [(0.0, "(start)")] + [(t, c) for t, c in chunks] + [(wall, "(end)")]
    gaps = [(b[0] - a[0], a[0], ANSI.sub("", a[1]).strip()[-70:]) for a, b in zip(marks, marks[1:], strict=False)]
    return sorted(gaps, reverse=True)


TOKEN = re.compile(r"\x1b\[(\d*)([A-Za-z])|\x1b\][^\x07]*\x07|\x1b\[[0-9;?]*[A-Za-z]|\r|\n|[^\x1b\r\n]+")


def screen_lines(chunks: list[tuple[float, str]]) -> list[str]:
    """The lines as they end up on the screen: a small terminal — text overwrites from the cursor, a carriage return
    goes to column 0, cursor-up (ESC[nA) and erase-line (ESC[2K) as a live line's redraw uses them; other escapes
    ignored. A live line that was redrawn and erased is not on the screen."""
    rows, r, col = [""], 0, 0
    for m in TOKEN.finditer("".join(c for _, c in chunks)):
        tok = m.group(0)
        if tok == "\n":
            r, col = r + 1, 0
            if r == len(rows):
                rows.append("")
        elif tok == "\r":
            col = 0
        elif m.group(2) == "A":
            r = max(0, r - int(m.group(1) or 1))
        elif m.group(2) == "K":
            rows[r] = rows[r][:col] if m.group(1) in ("", "0") else ""
        elif not tok.startswith("\x1b"):
            row = rows[r].ljust(col)
            rows[r] = row[:col] + tok + row[col + len(tok):]
            col += len(tok)
    return rows


def bad_inputs(cwd: Path, env: dict[str, str], python: str) -> list[dict]:
    """The issue's list, each run as a newcomer would type it."""
    (cwd / "bin.dat").write_bytes(bytes(range(256)) * 64)
    (cwd / "top.toml").write_text("steps = 5\n")
    (cwd / "dup.toml").write_text("micro_batch = 4\nmicro_batch = 8\n")
    (cwd / "afile").write_text("x")
    (cwd / "lstm-plan.toml").write_text('micro_batch = 8\n[provenance]\nworkload = "ts-lstm"\n')
    py = [python, "-m", "saturate"]
    cases = [
        ("train --effective-batch 0", [*py, "train", "--effective-batch", "0"]),
        ("train --seed -1", [*py, "train", "--seed", "-1"]),
        ("train --data bin.dat", [*py, "train", "--data", "bin.dat", "--steps", "1"]),
        ("train --plan (a ts-lstm plan)", [*py, "train", "--plan", "lstm-plan.toml", "--steps", "1"]),
        ("run --steps -1", [*py, "run", "--steps", "-1"]),
        ("tune --steps -1", [*py, "tune", "--steps", "-1"]),
        ("train --config (top-level steps)", [*py, "train", "--config", "top.toml"]),
        ("train --run-dir afile", [*py, "train", "--run-dir", "afile", "--steps", "1"]),
        ("train --plan (duplicate key)", [*py, "train", "--plan", "dup.toml", "--steps", "1"]),
        ("tune --budget 0", [*py, "tune", "--budget", "0"]),
        ("doctor --preset nope", [*py, "doctor", "--preset", "nope"]),
        ("run -- (no such file)", [*py, "run", "--", python, "no_such_script.py"]),
    ]
    out = []
    for name, cmd in cases:
        t = time.monotonic()
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        lines = [ln for ln in (p.stderr + p.stdout).splitlines() if ln.strip()]
        out.append({"input": name, "rc": p.returncode, "lines": len(lines), "first": lines[0] if lines else "",
                    "seconds": round(time.monotonic() - t, 1)})
        print(f"  {name}: exit {p.returncode}, {len(lines)} line(s): {lines[0] if lines else ''}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for newcomer.json and newcomer.md")
    ap.add_argument("--skip-setup", action="store_true", help="use this checkout, not a fresh clone")
    ap.add_argument("--skip-main", action="store_true", help="leave out the main job (minutes)")
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args()
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()}
    scratch = Path(tempfile.mkdtemp(prefix="saturate-newcomer-"))
    env = {**os.environ, "SATURATE_CACHE": str(scratch / "cache")}
    env.pop("PYTHONPATH", None)
    try:
        repo, python = ROOT, sys.executable
        if not args.skip_setup:
            repo = scratch / "saturate"
            subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
            # A venv that sees the installed torch (as a user's would), so the editable install of the clone
            # does not replace this checkout's.
            subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(scratch / "venv")], check=True)
            env.update(PATH=f"{scratch / 'venv' / 'bin'}:{env['PATH']}", VIRTUAL_ENV=str(scratch / "venv"))
            python = str(scratch / "venv" / "bin" / "python3")
            t = time.monotonic()
            p = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, env=env, capture_output=True, text=True)
            result["setup"] = {"rc": p.returncode, "seconds": round(time.monotonic() - t, 1),
                               "last_line": (p.stdout + p.stderr).strip().splitlines()[-1:]}
            print(f"set-up: exit {p.returncode} in {result['setup']['seconds']} s", flush=True)
        work = scratch / "work"
        work.mkdir()
        if not args.skip_main:
            for tty in (True, False):
                rc, wall, chunks = timed_output([python, "-m", "saturate", "run"], work, env, tty,
                                                args.timeout)
                gaps = silences(chunks, wall)
                lines = screen_lines(chunks)
                wide = [ln for ln in lines if len(ln) > 80]
                trailing = [ln for ln in lines if ln.endswith(" ") and ln.strip()]
                key = "main_tty" if tty else "main_pipes"
                result[key] = {"rc": rc, "wall_s": round(wall, 1), "longest_silences": [
                    {"seconds": round(g, 1), "at_s": round(at, 1), "after": text} for g, at, text in gaps[:5]],
                    "lines": len(lines), "over_80": wide, "trailing_space": len(trailing)}
                print(f"main job ({'terminal' if tty else 'pipes'}): exit {rc}, {wall:.0f} s, longest silence "
                      f"{gaps[0][0]:.1f} s at {gaps[0][1]:.0f} s after {gaps[0][2]!r}; {len(wide)} line(s) over 80 "
                      f"columns, {len(trailing)} ending in a space", flush=True)
                (scratch / f"{key}.txt").write_text("".join(c for _, c in chunks))
                if args.out:
                    Path(args.out).mkdir(parents=True, exist_ok=True)
                    shutil.copy(scratch / f"{key}.txt", Path(args.out) / f"newcomer-{key}.txt")
        print("bad inputs:", flush=True)
        result["bad_inputs"] = bad_inputs(work, env, python)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "newcomer.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
