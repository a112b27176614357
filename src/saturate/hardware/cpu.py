"""What the host CPU is: its name, its native reduced-precision matmuls, the cores we may use, and
the most FLOP/s its instructions allow (the ceiling for a measured matmul peak).

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


# ---------------------------------------------------------------------------------------------
# The instruction-set bound: a ceiling for the measured matmul peak

# FLOPs per cycle per core (an FMA counts 2), for the widest matmul instructions a flag says the
# core has, widest first; (flag set, FLOPs/cycle, where the figure comes from). Each is a ceiling:
# the most execution units any core with that flag has. Sources: Intel 64 and IA-32 Architectures
# Optimization Reference Manual (two 512-bit FMA units on AVX-512 server cores, two 256-bit on
# Haswell and later; AVX-512 BF16's VDPBF16PS and AVX512-FP16 on the same two units); Intel's
# Sapphire Rapids product brief (AMX: 1024 BF16/FP16 operations per cycle per core); Arm Neoverse
# and Apple core guides (at most four 128-bit FMA pipes, or two 256-bit SVE pipes).
_FLOPS_PER_CYCLE: dict[str, tuple[tuple[frozenset[str], int, str], ...]] = {
    "fp32": (
        (frozenset({"avx512f"}), 64, "AVX-512: 2 FMA units x 16 fp32 x 2"),
        (frozenset({"avx2", "fma"}), 32, "AVX2+FMA: 2 FMA units x 8 fp32 x 2"),
        (frozenset({"avx"}), 16, "AVX: one 8-wide add + one 8-wide multiply"),
        (frozenset({"sse2"}), 8, "SSE2: one 4-wide add + one 4-wide multiply"),
        (frozenset({"asimd"}), 32, "Arm NEON/SVE: at most 4 x 128-bit FMA pipes x 4 fp32 x 2"),
    ),
    "bf16": (
        (frozenset({"amx_bf16"}), 1024, "AMX-BF16: 1024 BF16 operations per cycle"),
        (frozenset({"avx512_bf16"}), 128, "AVX-512 BF16: 2 units x 32 bf16 pairs x 2"),
    ),
    "fp16": (
        (frozenset({"amx_fp16"}), 1024, "AMX-FP16: 1024 FP16 operations per cycle"),
        (frozenset({"avx512_fp16"}), 128, "AVX512-FP16: 2 FMA units x 32 fp16 x 2"),
    ),
}


def flops_per_cycle(flags: set[str], dtype: str) -> tuple[int, str] | None:
    """(FLOPs per cycle per core, the instructions it assumes) for a dtype; None when unknown.

    A reduced precision without its own instructions is converted to fp32 by torch, so fp32's
    figure is its ceiling.
    """
    for needed, flops, what in _FLOPS_PER_CYCLE.get(dtype, ()):
        if needed <= flags:
            return flops, what
    if dtype in ("bf16", "fp16", "tf32"):
        return flops_per_cycle(flags, "fp32")
    return None


def isa_text(flags: set[str]) -> str:
    """The widest matmul instructions the flags give, per dtype ("fp32 AVX-512: ...; bf16 AVX-512 BF16: ...");
    "" when the flags name none (no /proc/cpuinfo). Part of the hardware's fingerprint."""
    found = [(d, flops_per_cycle(flags, d)) for d in _FLOPS_PER_CYCLE]
    return "; ".join(f"{d} {hit[1].split(':')[0]}" for d, hit in found if hit is not None)


# Without a cpufreq maximum (virtual machines), "cpu MHz" is the clock the core reports now, often the base clock,
# and a core under a matmul boosts past it (measured: bench/results/cpu-2026-11-23e/README.md). The ceiling then
# allows this much over the current clock: server parts boost at most ~2.05x their base (Xeon Platinum 8592+: 1.9 ->
# 3.9 GHz; EPYC 7763: 2.45 -> 3.5 GHz), so 2.5x still catches a broken measurement (a 4.55x MFU) without failing a
# boosting core.
BOOST_HEADROOM = 2.5


def max_clock_hz(cpuinfo: str | None) -> tuple[float | None, str]:
    """The highest clock a core may run at, and what it is, said with its figures ("3.50 GHz (cpufreq maximum)").

    cpufreq's maximum (psutil.cpu_freq().max) when the system has one; else the largest "cpu MHz" in
    /proc/cpuinfo x `BOOST_HEADROOM`: that is the current clock (virtual machines report no maximum), which
    a boosting core passes, said as the clock read times the headroom assumed ("2.60 GHz x 2.5 ..."), never as
    the product alone (a "6.50 GHz" no such CPU runs at).
    """
    try:
        import psutil

        freq = psutil.cpu_freq()
        if freq is not None and freq.max and freq.max > 0:
            return freq.max * 1e6, f"{freq.max / 1e3:.2f} GHz (cpufreq maximum)"
    except (OSError, NotImplementedError, AttributeError):
        pass
    mhz = [float(v) for k, _, v in (line.partition(":") for line in (cpuinfo or "").splitlines())
           if k.strip().lower() == "cpu mhz" and v.strip().replace(".", "", 1).isdigit()]
    if mhz:
        return (max(mhz) * 1e6 * BOOST_HEADROOM,
                f"{max(mhz) / 1e3:.2f} GHz x {BOOST_HEADROOM:g} (the current clock, /proc/cpuinfo's cpu MHz, times "
                "the boost headroom assumed: no cpufreq maximum here)")
    return None, "no clock readable"


def physical_cores() -> int | None:
    """Physical cores (hyperthreads of one core share its FMA units); None when unknown."""
    try:
        import psutil

        return psutil.cpu_count(logical=False)
    except (OSError, NotImplementedError):
        return None


def instruction_set_bound(flags: set[str], cores: int, clock_hz: float | None, clock: str,
                          dtype: str) -> tuple[float, str] | None:
    """(FLOP/s, how it was computed): usable cores x max clock x FLOPs per cycle for the dtype; `clock` is the
    clock as `max_clock_hz` says it, with its figures.

    A ceiling no measured matmul peak can exceed; None when the clock or the instructions are unknown.
    """
    per_cycle = flops_per_cycle(flags, dtype)
    if per_cycle is None or not clock_hz:
        return None
    physical = physical_cores()
    used = min(cores, physical) if physical else cores
    flops, what = per_cycle
    return (used * clock_hz * flops,
            f"{used} cores x {clock} x {flops} FLOPs/cycle [{what}]")
