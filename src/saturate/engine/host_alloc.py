"""The host allocator on a CPU: glibc's malloc keeps a step's freed buffers for the next step.

glibc serves a request over its mmap threshold (128 KiB at start, raised as larger blocks are freed, up to 32 MiB)
with a fresh `mmap` and gives it back with `munmap` on free, and it trims the heap's free top back to the kernel
past twice that threshold. A CPU training step allocates and frees its activations and gradients (hundreds of KiB to
MiBs each) every micro-batch, so each step maps many of them again and the kernel zeroes every page at its first
touch: with the thresholds raised the process faults far less and its steps run faster (measured with
`bench/host_alloc.py`: bench/results/cpu-2026-11-27b/README.md). What Intel's and PyTorch's CPU guides get from
jemalloc or tcmalloc under LD_PRELOAD, without a library to install: a larger mmap threshold (blocks up to it come
from the heap, reused) and a larger trim threshold (a bounded amount of freed memory stays with the process: at most
`TRIM_MAX`, or 1/32 of the RAM where that is less).

Both thresholds are set together: setting either alone turns glibc's dynamic threshold off and leaves the mmap
threshold at 128 KiB (17.5 M faults over the same 40 steps, 2× slower). Allocator settings of the user's own —
`MALLOC_*_` variables, a `glibc.malloc` tunable, an allocator preloaded — are left as they are, and so is
everything with `SATURATE_HOST_ALLOC=system`.
"""

from __future__ import annotations

import ctypes
import os
import platform

import psutil

MiB = 2**20
MMAP_MAX = 128 * MiB
TRIM_MAX = 1024 * MiB
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
ENV = "SATURATE_HOST_ALLOC"  # "system": glibc's defaults, untouched
ENV_MMAP, ENV_TRIM = "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"
_PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")
# A script's minor page faults per second at which raising the thresholds could gain the 3 % a tuning keeps: on the
# peers' job 430 k fewer faults saved 1.5 s of system time and 3.3 s of steps (medians, bench/host_alloc.py): ~8 µs
# of step a fault, so 4,000 a second cost ~3 % of a second.
FAULTS_WORTH_TRYING = 4000

_applied: str | None = None  # the note of the setting this process made, once made


def thresholds(total_ram: int | None = None) -> tuple[int, int]:
    """(mmap threshold, trim threshold) in bytes for a host of `total_ram` bytes (default: this one's)."""
    ram = psutil.virtual_memory().total if total_ram is None else total_ram
    trim = max(MiB, min(TRIM_MAX, ram // 32))
    return min(MMAP_MAX, trim // 2), trim


def left_alone(environ: dict[str, str] | None = None) -> str | None:
    """Why the allocator is not ours to set in a process with `environ` (default: this one's), or None."""
    env = os.environ if environ is None else environ
    if env.get(ENV, "").strip().lower() == "system":
        return f"{ENV}=system"
    if mine := sorted(k for k in env if k.startswith("MALLOC_") and k.endswith("_")):
        return f"the allocator settings given ({', '.join(mine)})"
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return "the glibc.malloc tunables given (GLIBC_TUNABLES)"
    if any(name in env.get("LD_PRELOAD", "") for name in _PRELOADED):
        return "the allocator preloaded (LD_PRELOAD)"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc's malloc"
    return None


def _describe(mmap: int, trim: int) -> str:
    return (f"host allocator: freed blocks under {mmap // MiB} MiB reused, up to {trim // MiB} MiB of freed memory "
            f"kept (glibc M_MMAP_THRESHOLD, M_TRIM_THRESHOLD; {ENV}=system leaves glibc's defaults)")


def keep_freed_memory() -> str:
    """Raise this process's malloc thresholds (module docstring), once; what was done or why not, in a line."""
    global _applied
    if _applied is not None:
        return _applied
    if (why := left_alone()) is not None:
        return f"host allocator: left as it is ({why})"
    mmap, trim = thresholds()
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(M_MMAP_THRESHOLD, mmap) == 1 and libc.mallopt(M_TRIM_THRESHOLD, trim) == 1
    except (OSError, AttributeError) as e:
        return f"host allocator: left as it is (mallopt unavailable: {e})"
    if not ok:
        return "host allocator: left as it is (glibc's mallopt refused the thresholds)"
    _applied = _describe(mmap, trim)
    return _applied


def child_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables that give a child process (a user's script) the same thresholds from its start; {} where the
    allocator is not ours to set (`left_alone`)."""
    if left_alone(environ) is not None:
        return {}
    mmap, trim = thresholds()
    return {ENV_MMAP: str(mmap), ENV_TRIM: str(trim)}
