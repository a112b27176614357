"""Run a command with its writes to some folders kept in scratch layers: run by path, before the user's command.

    python -S overlay_exec.py SPEC.json -- python train.py --steps 300

SPEC.json is a list of [folder, upper, work]. In a mount namespace of its own (and a user namespace when not
root), each folder is covered by an overlay whose lower layer is the folder itself and whose upper layer is
`upper`: the command reads the folder as it is, and everything it creates, changes or deletes there lands in
`upper`, which saturate removes afterwards. Then this process becomes the command (exec: same pid, same process
group, same environment). Nothing outside the namespace sees the mounts.

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
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
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


def cover(libc: ctypes.CDLL, folder: str, upper: str, work: str) -> None:
    base = f"lowerdir={_escape(folder)},upperdir={_escape(upper)},workdir={_escape(work)}"
    errors = []
    for options in (base + ",userxattr", base):  # userxattr: what an unprivileged overlay needs; older kernels lack it
        if libc.mount(b"overlay", folder.encode(), b"overlay", 0, options.encode()) == 0:
            return
        errors.append(os.strerror(ctypes.get_errno()))
    _fail(f"an overlay on {folder}: {errors[-1]}")


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
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
