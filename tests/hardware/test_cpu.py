"""Tests for saturate.hardware.cpu: /proc/cpuinfo parsing and the native reduced-precision flags."""

from __future__ import annotations

from saturate.hardware import cpu

# --- CPU flags ---------------------------------------------------------------------------------------

_X86_CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16 avx512_vnni

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16 avx512_vnni
"""

_ARM_CPUINFO = """\
processor\t: 0
BogoMIPS\t: 2000.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp bf16 i8mm
CPU implementer\t: 0x41
"""


def test_cpuinfo_parsing_x86() -> None:
    name, flags = cpu.parse_cpuinfo(_X86_CPUINFO)
    assert name == "Intel(R) Xeon(R) Platinum 8480+"
    assert cpu.cpu_supports(flags) == {"bf16": True, "fp16": False, "tf32": False}
    _, fp16_flags = cpu.parse_cpuinfo(_X86_CPUINFO.replace("amx_bf16", "amx_bf16 amx_fp16"))
    assert cpu.cpu_supports(fp16_flags)["fp16"] is True


def test_cpuinfo_parsing_without_native_low_precision() -> None:
    name, flags = cpu.parse_cpuinfo("model name\t: Old CPU\nflags\t\t: fpu sse sse2 avx avx2 fma\n")
    assert name == "Old CPU"
    assert cpu.cpu_supports(flags) == {"bf16": False, "fp16": False, "tf32": False}
    assert cpu.parse_cpuinfo("") == (None, set())


def test_cpuinfo_parsing_arm() -> None:
    name, flags = cpu.parse_cpuinfo(_ARM_CPUINFO)
    assert name is None  # arm64 has no "model name"; probe falls back to platform
    assert cpu.cpu_supports(flags)["bf16"] is True
