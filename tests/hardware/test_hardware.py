"""Tests for saturate.hardware.machine and the NVML readings probe() takes.

The CPU probe for real, the CUDA/ROCm/NVML paths through mocks.
"""

from __future__ import annotations

import io
import json
import re
import sys
from types import SimpleNamespace

import pynvml
import pytest
import torch
from rich.console import Console

from saturate.errors import SaturateError
from saturate.hardware import DeviceInfo, Hardware, datasheet_peaks, gpu_sensors, machine, probe, render_hardware
from saturate.hardware import cpu as host_cpu  # `cpu` is a fixture in conftest

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")


@pytest.fixture(scope="module")
def cpu_hw(tmp_path_factory: pytest.TempPathFactory) -> Hardware:
    # One measured probe for the module: the benchmark is the slow part (~0.6 s on 2 cores). The
    # peak is stored in the session's cache (as conftest's per-test fixture sets it), never ~/.cache.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SATURATE_CACHE", str(tmp_path_factory.getbasetemp() / "saturate-cache"))
        return probe(device="cpu")


def _hardware(**overrides) -> Hardware:
    fields = dict(
        device_type="cuda",
        torch_device="cuda",
        devices=[DeviceInfo(0, "NVIDIA H200", 150_000_000_000, 140_000_000_000, "9.0", 132)],
        supports={"bf16": True, "fp16": True, "tf32": True},
        cpu_name="Test CPU",
        cpu_cores=16,
        host_ram_total=128 * 2**30,
        host_ram_available=100 * 2**30,
        swap_total=0,
        swap_used=0,
        torch_version="2.13.0",
        cuda_version="12.8",
        hip_version=None,
        driver_version="570.1",
        telemetry="nvml",
    )
    fields.update(overrides)
    return Hardware(**fields)


# --- the real CPU probe -------------------------------------------------------------------------


def test_cpu_probe_reports_sane_host(cpu_hw: Hardware) -> None:
    assert cpu_hw.device_type == "cpu"
    assert cpu_hw.torch_device == "cpu"
    assert cpu_hw.devices == []
    assert cpu_hw.telemetry == "none"
    assert cpu_hw.cpu_cores >= 1
    assert cpu_hw.cpu_name
    assert cpu_hw.host_ram_total > 0
    assert 0 < cpu_hw.host_ram_available <= cpu_hw.host_ram_total
    assert 0 <= cpu_hw.swap_used <= max(cpu_hw.swap_total, cpu_hw.swap_used)
    assert cpu_hw.torch_version == torch.__version__
    assert set(cpu_hw.supports) == {"bf16", "fp16", "tf32"}
    assert cpu_hw.supports["tf32"] is False
    assert cpu_hw.datasheet_peak_flops == {}  # CPUs never take a datasheet row


def test_cpu_probe_measures_plausible_fp32_peak(cpu_hw: Hardware) -> None:
    fp32 = cpu_hw.measured_peak_flops["fp32"]
    assert 1e8 < fp32 < 1e14
    # Reduced precisions are measured only where the CPU has them natively.
    for dtype in ("bf16", "fp16"):
        assert (dtype in cpu_hw.measured_peak_flops) == cpu_hw.supports[dtype]
    assert "tf32" not in cpu_hw.measured_peak_flops
    value, source = cpu_hw.peak_flops("fp32")
    assert value == fp32 and ("matmul peak" in source or "instruction-set bound" in source)
    assert cpu_hw.peak_flops("tf32") == (fp32, source)  # no TF32 on a CPU: fp32 is what runs
    if "fp32" in cpu_hw.peak_bounds:  # the instruction set is a ceiling the measured peak never passes
        assert fp32 <= cpu_hw.peak_bounds["fp32"][0]


def test_a_second_probe_reuses_the_stored_peak(cpu_hw: Hardware) -> None:
    again = probe(measure_peaks=True, device="cpu")
    busy = any("busy machine" in n for n in cpu_hw.notes)  # then measured again, the higher reading kept
    assert again.measured_peak_flops["fp32"] >= cpu_hw.measured_peak_flops["fp32"]
    assert busy or again.measured_peak_flops["fp32"] == cpu_hw.measured_peak_flops["fp32"]


def test_probe_without_peaks_measures_nothing() -> None:
    hw = probe(measure_peaks=False, device="cpu")
    assert hw.measured_peak_flops == {}
    assert hw.peak_flops("fp32") == (None, "unknown")
    assert any("measure_peaks=False" in note for note in hw.notes)


# --- device choice ----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["bogus", "cpu:1", "tpu", "mps:0"])
def test_unknown_device_raises_one_line_error(device: str) -> None:
    with pytest.raises(SaturateError) as info:
        probe(measure_peaks=False, device=device)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu_raises() -> None:
    with pytest.raises(SaturateError, match="no GPU is usable"):
        probe(measure_peaks=False, device="cuda")


# --- peak_flops, fingerprint, to_dict -----------------------------------------------------------------


def test_peak_flops_prefers_datasheet_then_measured_then_unknown() -> None:
    sheet = datasheet_peaks("NVIDIA H200", 132)
    hw = _hardware(datasheet_peak_flops=sheet, measured_peak_flops={"fp32": 50e12, "bf16": 700e12})
    value, label = hw.peak_flops("bf16")
    assert value == sheet["bf16"][0] and label == f"datasheet: {sheet['bf16'][1]}"
    assert hw.peak_flops("tf32")[0] == sheet["tf32"][0]

    measured_only = _hardware(measured_peak_flops={"fp32": 50e12, "bf16": 700e12})
    assert measured_only.peak_flops("bf16") == (700e12, "measured")
    assert measured_only.peak_flops("fp16") == (None, "unknown")
    assert _hardware().peak_flops("fp32") == (None, "unknown")
    with pytest.raises(ValueError, match="fp8"):
        hw.peak_flops("fp8")


def test_fingerprint_is_stable_and_ignores_what_varies_between_runs() -> None:
    base = _hardware()
    assert re.fullmatch(r"[0-9a-f]{16}", base.fingerprint())
    drifted = _hardware(
        host_ram_available=1, measured_peak_flops={"fp32": 1.0}, notes=["x"], driver_version="999"
    )
    assert drifted.fingerprint() == base.fingerprint()
    other_gpu = _hardware(devices=[DeviceInfo(0, "NVIDIA H100 80GB HBM3", 85_000_000_000, None, "9.0", 132)])
    assert other_gpu.fingerprint() != base.fingerprint()
    assert _hardware(cpu_cores=8).fingerprint() != base.fingerprint()
    # one CPU name, two instruction sets (a cloud's "AMD EPYC": Zen 3 without native bf16, Zen 4 with it)
    from saturate.hardware.cpu import isa_text

    zen3 = isa_text({"avx", "avx2", "fma", "sse2"})
    zen4 = isa_text({"avx", "avx2", "fma", "sse2", "avx512f", "avx512_bf16"})
    assert "bf16 AVX-512 BF16" in zen4 and "AVX-512" not in zen3
    assert _hardware(cpu_isa=zen3).fingerprint() != _hardware(cpu_isa=zen4).fingerprint()


def test_to_dict_is_json_serialisable(cpu_hw: Hardware) -> None:
    data = json.loads(json.dumps(cpu_hw.to_dict()))
    assert data["measured_peak_flops"] == cpu_hw.measured_peak_flops
    assert data["cpu_cores"] == cpu_hw.cpu_cores

    gpu_hw = _hardware(datasheet_peak_flops=datasheet_peaks("NVIDIA H200", 132))
    data = json.loads(json.dumps(gpu_hw.to_dict()))
    assert data["datasheet_peak_flops"]["bf16"] == list(gpu_hw.datasheet_peak_flops["bf16"])
    assert data["devices"][0]["name"] == "NVIDIA H200"


# --- CPU ---------------------------------------------------------------------------------------------


def test_missing_cpuinfo_is_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_cpu, "read_cpuinfo", lambda: None)
    hw = probe(measure_peaks=False, device="cpu")
    assert hw.supports == {"bf16": False, "fp16": False, "tf32": False}
    assert hw.cpu_name
    assert any("/proc/cpuinfo" in note for note in hw.notes)


# --- NVML ---------------------------------------------------------------------------------------------


def test_nvml_init_failure_is_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    readings, notes = gpu_sensors.nvml_readings({0: "abc"})
    assert readings.memory_free == {} and readings.driver_version is None
    assert len(notes) == 1 and notes[0].startswith("NVML unavailable:")


def test_nvml_missing_module_is_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    readings, notes = gpu_sensors.nvml_readings({0: "abc"})
    assert readings.memory_free == {}
    assert notes[0].startswith("NVML unavailable:")


class _FakeNvml:
    """Two NVML devices in PCI order; torch (fastest-first) sees them the other way round."""

    def __init__(self, fail_on_memory: bool = False) -> None:
        self.uuids = ["GPU-aaaa-0000", "GPU-bbbb-1111"]
        self.free = [10 * 2**30, 20 * 2**30]
        self.fail_on_memory = fail_on_memory
        self.shutdowns = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
        monkeypatch.setattr(pynvml, "nvmlShutdown", self.shutdown)
        monkeypatch.setattr(pynvml, "nvmlSystemGetDriverVersion", lambda: b"570.86.15")
        monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: len(self.uuids))
        monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: i)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", lambda h: self.uuids[h])
        monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", self.memory)

    def shutdown(self) -> None:
        self.shutdowns += 1

    def memory(self, handle: int) -> SimpleNamespace:
        if self.fail_on_memory:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return SimpleNamespace(free=self.free[handle], total=40 * 2**30, used=0)


def test_nvml_matches_devices_by_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeNvml()
    fake.install(monkeypatch)
    # torch's uuid is bare and may differ in case; cuda:2 is a MIG slice NVML does not list.
    readings, notes = gpu_sensors.nvml_readings({0: "BBBB-1111", 1: "aaaa-0000", 2: "MIG-cccc", 3: None})
    assert readings.driver_version == "570.86.15"
    assert readings.memory_free == {0: fake.free[1], 1: fake.free[0]}
    assert [n for n in notes if "cuda:2" in n] and [n for n in notes if "cuda:3" in n]
    assert fake.shutdowns == 1


def test_nvml_query_failure_still_shuts_down(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeNvml(fail_on_memory=True)
    fake.install(monkeypatch)
    readings, notes = gpu_sensors.nvml_readings({0: "aaaa-0000"})
    assert readings.memory_free == {}
    assert any(note.startswith("NVML query failed") for note in notes)
    assert fake.shutdowns == 1


# --- the CUDA and ROCm paths, mocked -------------------------------------------------------------------


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, props: SimpleNamespace, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: capability[0] >= 8)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=None: (7 * 2**30, props.total_memory))


def _h200_props(sms: int = 132) -> SimpleNamespace:
    return SimpleNamespace(
        name="NVIDIA H200", major=9, minor=0, total_memory=150_000_000_000, multi_processor_count=sms,
        uuid="aaaa-0000", gcnArchName="",
    )  # fmt: skip


def test_probe_cuda_path_with_nvml_failing(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpu(monkeypatch, _h200_props(), (9, 0))
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: (_ for _ in ()).throw(pynvml.NVMLError(9)))
    hw = probe(measure_peaks=False)
    assert (hw.device_type, hw.torch_device) == ("cuda", "cuda")
    assert hw.supports == {"bf16": True, "fp16": True, "tf32": True}
    assert hw.telemetry == "torch"  # NVML failed, torch.cuda.mem_get_info answered
    device = hw.devices[0]
    assert (device.compute_capability, device.memory_free, device.multiprocessors) == ("9.0", 7 * 2**30, 132)
    assert hw.driver_version is None
    assert any(note.startswith("NVML unavailable:") for note in hw.notes)
    value, label = hw.peak_flops("bf16")
    assert value == pytest.approx(989.5e12) and label.startswith("datasheet: ") and "H200 SXM" in label
    assert hw.fingerprint() != probe(measure_peaks=False, device="cpu").fingerprint()


def test_probe_cuda_path_with_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpu(monkeypatch, _h200_props(), (9, 0))
    _FakeNvml().install(monkeypatch)
    hw = probe(measure_peaks=False, device="cuda:0")
    assert hw.torch_device == "cuda:0"
    assert hw.telemetry == "nvml"
    assert hw.driver_version == "570.86.15"
    assert hw.devices[0].memory_free == 10 * 2**30


def test_probe_cuda_mig_slice_gets_no_datasheet(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpu(monkeypatch, _h200_props(sms=16), (9, 0))
    _FakeNvml().install(monkeypatch)
    hw = probe(measure_peaks=False)
    assert hw.datasheet_peak_flops == {}
    assert any("MIG" in note for note in hw.notes)
    assert hw.peak_flops("bf16") == (None, "unknown")


def test_probe_cuda_volta_has_no_bf16_or_tf32(monkeypatch: pytest.MonkeyPatch) -> None:
    props = SimpleNamespace(
        name="Tesla V100-SXM2-16GB", major=7, minor=0, total_memory=16 * 2**30, multi_processor_count=80,
        uuid=None,
    )  # fmt: skip
    _fake_gpu(monkeypatch, props, (7, 0))
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: (_ for _ in ()).throw(pynvml.NVMLError(9)))
    hw = probe(measure_peaks=False)
    assert hw.supports == {"bf16": False, "fp16": True, "tf32": False}
    assert hw.peak_flops("fp16")[0] == pytest.approx(125e12)
    assert hw.peak_flops("tf32")[0] == pytest.approx(15.7e12)  # TF32 flag is a no-op on Volta


def test_probe_rocm_path(monkeypatch: pytest.MonkeyPatch) -> None:
    props = SimpleNamespace(
        name="AMD Instinct MI300X", major=9, minor=4, total_memory=192 * 2**30, multi_processor_count=304,
        uuid="x", gcnArchName="gfx942:sramecc+:xnack-",
    )  # fmt: skip
    _fake_gpu(monkeypatch, props, (9, 4))
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")

    def no_nvml(uuids):
        raise AssertionError("NVML must not be used on ROCm")

    monkeypatch.setattr(machine, "nvml_readings", no_nvml)
    hw = probe(measure_peaks=False, device="rocm")
    assert (hw.device_type, hw.torch_device, hw.telemetry) == ("rocm", "cuda", "torch")
    assert hw.devices[0].compute_capability == "gfx942"
    assert hw.supports == {"bf16": True, "fp16": True, "tf32": False}
    assert hw.peak_flops("bf16")[0] == pytest.approx(1307.4e12)


# --- rendering ------------------------------------------------------------------------------------


def _rendered(hw: Hardware) -> str:
    out = io.StringIO()
    render_hardware(hw, Console(file=out, width=220, color_system=None))
    return out.getvalue()


def test_render_hardware_cpu(cpu_hw: Hardware) -> None:
    text = _rendered(cpu_hw)
    assert "matmul peak (measured" in text and cpu_hw.cpu_name in text
    if cpu_hw.peak_bounds:
        assert "bound fp32" in text and "FLOPs/cycle" in text
    assert cpu_hw.notes[-1][:60] in text


def test_render_hardware_gpu_peaks_and_notes() -> None:
    hw = _hardware(
        datasheet_peak_flops=datasheet_peaks("NVIDIA H200", 132),
        measured_peak_flops={"fp32": 51.2e12},
        notes=["a note with [brackets] kept"],
    )
    text = _rendered(hw)
    assert "51.2 TFLOP/s (measured)" in text
    assert "989.5 TFLOP/s (datasheet" in text
    assert "[brackets]" in text
    assert "NVIDIA H200" in text and "driver 570.1" in text


# --- on a GPU --------------------------------------------------------------------------------------


@gpu
@needs_cuda
def test_probe_on_a_real_gpu() -> None:
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    hw = probe()
    assert hw.device_type in ("cuda", "rocm")
    assert hw.devices and hw.telemetry in ("nvml", "torch")
    for device in hw.devices:
        assert device.memory_total > 0
        assert device.memory_free is None or 0 < device.memory_free <= device.memory_total
        assert device.compute_capability
        assert device.multiprocessors and device.multiprocessors > 0
    assert hw.measured_peak_flops["fp32"] > 1e12
    for dtype, native in hw.supports.items():
        if native:
            assert hw.measured_peak_flops[dtype] > hw.measured_peak_flops["fp32"] * 0.5, dtype
    # A measured peak well above the datasheet would mean the table row is wrong.
    for dtype, (value, _) in hw.datasheet_peak_flops.items():
        if dtype in hw.measured_peak_flops:
            assert hw.measured_peak_flops[dtype] < 1.15 * value, dtype
    assert hw.peak_flops("bf16")[0] is not None or not hw.supports["bf16"]
    assert torch.backends.cuda.matmul.allow_tf32 is tf32_before
    json.dumps(hw.to_dict())
