"""Run a command with its writes to some folders kept in scratch layers: run by path, before the user's command.

    python -S overlay_exec.py SPEC.json -- python train.py --steps 300

SPEC.json is a list of [folder, upper, work]. In a mount namespace of its own (and a user namespace when not
root), each folder is covered by an overlay whose lower layer is the folder itself and whose upper layer is
`upper`: the command reads the folder as it is, and everything it creates, changes or deletes there lands in
`upper`, which saturate removes afterwards. A file system mounted inside a folder (a bind mount of the data in a
container) would be hidden by the folder's overlay: it gets an overlay of its own, its lower layer reached
through a descriptor opened before (`nested.json` beside `upper` lists them for saturate); where that cannot be
mounted (a file system overlayfs refuses as a lower layer), the mount is bound back as it is, uncovered, and
`nested.json` says so. Then this process becomes the command (exec: same pid, same process group, same
environment). Nothing outside the namespace sees the mounts.

It imports nothing of saturate (and runs with -S) so that it starts in a few milliseconds. When a folder cannot be
covered it says why in one line on stderr and exits with status 3, running nothing: a trial that might write into
the user's folders is not run at all.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 1 << 18
FAILED = 3


def _fail(message: str) -> None:
    sys.stderr.write(f"saturate: the run was not started: {message}\n")
    sys.stderr.flush()
    os._exit(FAILED)


def _escape(path: str) -> str:
    return path.replace("\\", "\\\\").replace(",", "\\,").replace(":", "\\:")


def enter_namespace(libc: ctypes.CDLL) -> None:
    uid, gid = os.geteuid(), os.getegid()
    flags = CLONE_NEWNS if uid == 0 else CLONE_NEWNS | CLONE_NEWUSER
    if libc.unshare(flags) != 0:
        _fail(f"unshare: {os.strerror(ctypes.get_errno())} (namespaces unavailable here; "
              "SATURATE_ISOLATION=off runs trials in your folders)")
    if uid != 0:  # the same uid and gid inside: files the command creates are its user's, as without saturate
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        _fail(f"making / private: {os.strerror(ctypes.get_errno())}")


def _overlay(libc: ctypes.CDLL, lower: str, target: str, upper: str, work: str) -> str | None:
    """Mount it; None, or why not."""
    base = f"lowerdir={_escape(lower)},upperdir={_escape(upper)},workdir={_escape(work)}"
    error = ""
    for options in (base + ",userxattr", base):  # userxattr: what an unprivileged overlay needs; older kernels lack it
        if libc.mount(b"overlay", target.encode(), b"overlay", 0, options.encode()) == 0:
            return None
        error = os.strerror(ctypes.get_errno())
    return error


def _unescape(field: str) -> str:  # mountinfo writes space, tab, newline and backslash as octal escapes
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mounts_inside(folder: str) -> list[str]:
    """Mount points strictly inside `folder`, outermost first."""
    inside = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = _unescape(line.split()[4])
            if point.startswith(folder.rstrip("/") + "/"):
                inside.append(point)
    return sorted(set(inside), key=lambda p: p.count("/"))


def cover(libc: ctypes.CDLL, folder: str, upper: str, work: str) -> None:
    nested = [(point, os.open(point, os.O_PATH | os.O_DIRECTORY)) for point in mounts_inside(folder)]
    if (error := _overlay(libc, folder, folder, upper, work)) is not None:
        _fail(f"an overlay on {folder}: {error}")
    record = []
    base = os.path.join(os.path.dirname(upper), "nested")
    for i, (point, fd) in enumerate(nested):
        lower = f"/proc/self/fd/{fd}"
        up, wk = os.path.join(base, str(i), "upper"), os.path.join(base, str(i), "work")
        os.makedirs(up)
        os.makedirs(wk)
        os.makedirs(point, exist_ok=True)  # in the folder's overlay (its scratch layer), where the mount was
        why = _overlay(libc, lower, point, up, wk)
        if why is not None and libc.mount(lower.encode(), point.encode(), None, MS_BIND | MS_REC, None) != 0:
            _fail(f"{point}, mounted inside {folder}: {why}; binding it back: {os.strerror(ctypes.get_errno())}")
        record.append({"folder": point, "upper": None if why else up, "uncovered": why})
        os.close(fd)
    if record:
        with open(os.path.join(os.path.dirname(upper), "nested.json"), "w") as f:
            json.dump(record, f)


def main(argv: list[str]) -> None:
    if len(argv) < len(("SPEC.json", "--", "COMMAND")) or argv[1] != "--":
        _fail("usage: overlay_exec.py SPEC.json -- COMMAND …")
    with open(argv[0]) as f:
        layers = json.load(f)
    cwd = os.getcwd()
    libc = ctypes.CDLL(None, use_errno=True)
    enter_namespace(libc)
    for folder, upper, work in layers:
        cover(libc, folder, upper, work)
    os.chdir(cwd)  # the working folder again by its path: through the overlay now, not the folder beneath it
    try:
        os.execvp(argv[2], argv[2:])
    except OSError as e:
        _fail(f"{argv[2]}: {e.strerror}")


if __name__ == "__main__":
    main(sys.argv[1:])
