"""What the host CPU is: its name, its native reduced-precision matmuls, and the cores we may use.

Read from /proc/cpuinfo (x86 and arm64 Linux), sysctl on macOS, the affinity mask and a
container's cgroup CPU quota; ``probe()`` puts these in ``Hardware``.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys


def parse_cpuinfo(text: str) -> tuple[str | None, set[str]]:
    """(model name, feature flags) from /proc/cpuinfo text; x86 says "flags", arm64 "Features"."""
    name: str | None = None
    flags: set[str] = set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip().lower()
        if key == "model name" and name is None and value.strip():
            name = value.strip()
        elif key in ("flags", "features"):
            flags.update(value.split())
    return name, flags


def cpu_supports(flags: set[str]) -> dict[str, bool]:
    """Native (not emulated) reduced-precision matmul on the CPU.

    Without these instructions torch still runs bf16/fp16 on the CPU, but by converting in
    software, which is far slower than fp32; that is why only the flags count. arm64 "bf16" is
    the Armv8.6 BFloat16 extension (BFMMLA), used by oneDNN/ACL the same way.
    """
    return {
        "bf16": bool(flags & {"avx512_bf16", "amx_bf16", "bf16"}),
        "fp16": bool(flags & {"avx512_fp16", "amx_fp16"}),
        "tf32": False,
    }


def read_cpuinfo() -> str | None:
    """The text of /proc/cpuinfo, or None where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None  # macOS, Windows, or a sandbox without /proc


def cpu_name(model_name: str | None) -> str:
    """The CPU's name: cpuinfo's model name, else macOS's brand string, else what platform says."""
    if model_name:
        return model_name
    if sys.platform == "darwin":
        try:
            brand = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=2
            ).stdout.strip()
            if brand:
                return brand
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "unknown"


def usable_cores() -> tuple[int, str | None]:
    """Cores this process may use, and a note when a container CPU quota lowered the figure."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on macOS/Windows
        cores = os.cpu_count() or 1
    # A cgroup v2 quota ("200000 100000" = 2 CPUs) caps throughput below the affinity mask in
    # containers; sizing loader workers by the mask alone oversubscribes them.
    try:
        with open("/sys/fs/cgroup/cpu.max", encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            limit = max(1, math.ceil(int(quota) / int(period)))
            if limit < cores:
                return limit, f"CPU quota (cgroup cpu.max) limits this process to {limit} of {cores} cores"
    except (OSError, ValueError):
        pass
    return max(1, cores), None
