"""The MFU denominator: the stored, repeated, bounded matmul peak (peak_store), the CPU's instruction-set
bound (cpu), and the one MFU function (mfu) that never shows a figure above 100 %."""

from __future__ import annotations

import json

import pytest

from saturate.hardware import cpu, peak_store
from saturate.hardware.contention import Contention
from saturate.hardware.mfu import mfu


@pytest.fixture(autouse=True)
def _own_store(monkeypatch, tmp_path):
    monkeypatch.setattr(peak_store, "peaks_dir", lambda: tmp_path / "peaks")


class _Hw:
    torch_device = "cpu"

    def __init__(self, bounds=None) -> None:
        self.peak_bounds = bounds or {}

    def fingerprint(self) -> str:
        return "testhw"


def _quiet(monkeypatch, other_cores=0.0):
    class Meter:
        def __init__(self, *a, **k) -> None:
            pass

        def start(self):
            return self

        def stop(self):
            return Contention(seconds=1.0, usable_cores=2, other_cores=other_cores, own_cores=1.0)

    monkeypatch.setattr(peak_store, "ContentionMeter", Meter)


def test_the_peak_is_the_best_run_measured_once_and_stored(monkeypatch):
    _quiet(monkeypatch)
    calls = []

    def runs(device, dtype, tf32=False):
        calls.append(device)
        return [3e9, 5e9, 4e9]

    value, label, notes = peak_store.matmul_peak(_Hw(), "fp32", measure=runs)
    assert value == 5e9 and "best of 3 runs" in label and "median 4" in label and notes == []
    again, label2, _ = peak_store.matmul_peak(_Hw(), "fp32", measure=runs)
    assert again == 5e9 and len(calls) == 1 and "stored for this hardware" in label2
    stored = json.loads((peak_store.peaks_dir() / "testhw.json").read_text())
    assert stored["cpu/fp32"]["runs"] == [3e9, 5e9, 4e9]
    peak_store.matmul_peak(_Hw(), "fp32", measure=runs, refresh=True)
    assert len(calls) == 2


def test_a_busy_reading_is_kept_as_the_best_so_far_and_measured_again_until_a_quiet_one(monkeypatch):
    _quiet(monkeypatch, other_cores=1.5)
    calls = []

    def runs(value):
        def measure(*a, **k):
            calls.append(value)
            return [value]
        return measure

    def next_run():  # a new process: what this one measured is forgotten, the store is not
        monkeypatch.setattr(peak_store, "_MEASURED_HERE", {})

    next_run()
    value, _, notes = peak_store.matmul_peak(_Hw(), "fp32", measure=runs(2e9))
    assert value == 2e9 and "busy machine" in notes[0] and "measured again next run" in notes[0]
    value, label, _ = peak_store.matmul_peak(_Hw(), "fp32", measure=runs(3e9))  # the same run asks again
    assert value == 2e9 and "stored for this hardware" in label and calls == [2e9]  # not measured twice here
    next_run()
    value, label, _ = peak_store.matmul_peak(_Hw(), "fp32", measure=runs(1e9))  # busier still: the best is kept
    assert value == 2e9 and "higher than now" in label and calls == [2e9, 1e9]
    _quiet(monkeypatch)
    next_run()
    value, _, notes = peak_store.matmul_peak(_Hw(), "fp32", measure=runs(5e9))  # quiet at last
    assert value == 5e9 and notes == []
    value, label, _ = peak_store.matmul_peak(_Hw(), "fp32", measure=runs(9e9))
    assert value == 5e9 and "stored for this hardware" in label and calls == [2e9, 1e9, 5e9]  # not measured


def test_a_measured_peak_above_the_instruction_set_bound_is_capped(monkeypatch):
    _quiet(monkeypatch)
    hw = _Hw({"fp32": (1e9, "2 cores x 1 GHz x ...")})
    value, label, notes = peak_store.matmul_peak(hw, "fp32", measure=lambda *a, **k: [4e9])
    assert value == 1e9 and "instruction-set bound" in label and "above what the instructions allow" in notes[0]


def test_a_damaged_store_is_measured_again(monkeypatch):
    _quiet(monkeypatch)
    peak_store.peaks_dir().mkdir(parents=True, exist_ok=True)
    (peak_store.peaks_dir() / "testhw.json").write_text("{not json")
    value, _, _ = peak_store.matmul_peak(_Hw(), "fp32", measure=lambda *a, **k: [7e9])
    assert value == 7e9


@pytest.mark.parametrize(("flags", "dtype", "per_cycle"), [
    ({"sse2", "avx", "avx2", "fma", "avx512f"}, "fp32", 64),
    ({"sse2", "avx", "avx2", "fma"}, "fp32", 32),
    ({"sse2", "avx"}, "fp32", 16),
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, "bf16", 128),
    ({"avx512f", "avx512_bf16", "amx_bf16"}, "bf16", 1024),
    ({"avx2", "fma"}, "bf16", 32),  # no bf16 instructions: converted to fp32, fp32's ceiling
    ({"asimd"}, "fp32", 32),
])
def test_flops_per_cycle_from_the_instruction_set(flags, dtype, per_cycle):
    assert cpu.flops_per_cycle(flags, dtype)[0] == per_cycle


def test_instruction_set_bound_is_cores_times_clock_times_flops_per_cycle(monkeypatch):
    monkeypatch.setattr(cpu, "physical_cores", lambda: 8)
    value, how = cpu.instruction_set_bound({"avx2", "fma"}, 4, 3e9, "3.00 GHz (cpufreq maximum)", "fp32")
    assert value == 4 * 3e9 * 32 and how.startswith("4 cores x 3.00 GHz (cpufreq maximum) x 32 FLOPs/cycle")
    # hyperthreads share a core's FMA units: usable logical CPUs are capped at the physical cores
    monkeypatch.setattr(cpu, "physical_cores", lambda: 2)
    assert cpu.instruction_set_bound({"avx2", "fma"}, 4, 3e9, "x", "fp32")[0] == 2 * 3e9 * 32
    assert cpu.instruction_set_bound({"avx2", "fma"}, 4, None, "no clock", "fp32") is None
    assert cpu.instruction_set_bound(set(), 4, 3e9, "x", "fp32") is None


def test_max_clock_falls_back_to_cpuinfo_and_says_so(monkeypatch):
    import psutil

    monkeypatch.setattr(psutil, "cpu_freq", lambda: None)
    hz, source = cpu.max_clock_hz("processor: 0\ncpu MHz\t\t: 2400.5\nprocessor: 1\ncpu MHz\t\t: 2600.0\n")
    assert hz == 2600.0e6 * cpu.BOOST_HEADROOM and "current clock" in source
    assert cpu.max_clock_hz(None) == (None, "no clock readable")
    # Issue 31: the ceiling read "6.50 GHz [/proc/cpuinfo cpu MHz 2600 x 2.5 …]", a clock no such CPU runs at. It says
    # the clock read and the headroom assumed, and the product appears nowhere.
    monkeypatch.setattr(cpu, "physical_cores", lambda: 2)
    _, how = cpu.instruction_set_bound({"avx2", "fma"}, 2, hz, source, "fp32")
    assert how.startswith("2 cores x 2.60 GHz x 2.5 (the current clock") and "boost headroom assumed" in how
    assert "6.50" not in how and "x 32 FLOPs/cycle [AVX2" in how, how


def test_mfu_above_the_peak_is_never_a_figure():
    ok = mfu(5e9, 1e10, "measured")
    assert ok.value == pytest.approx(0.5) and ok.cell() == "50.0 %" and "of 10 GFLOP/s" in ok.text()
    over = mfu(2.5e10, 1e10, "measured")
    assert over.value is None and over.exceeds_peak and over.cell() == "n/a"
    assert over.text().startswith("MFU n/a: measured throughput exceeds the peak estimate (peak 10 GFLOP/s, "
                                  "achieved 25 GFLOP/s")
    assert over.to_dict()["exceeds_peak"] is True and over.to_dict()["achieved"] == 2.5e10
    assert mfu(5e9, None, "unknown").value is None and mfu(5e9, None, "unknown").cell() == "-"
    assert mfu(0.0, 1e10, "measured").text().startswith("MFU unknown")
    assert mfu(4e10, 1e10, "measured", processes=8).value == pytest.approx(0.5)  # per process
