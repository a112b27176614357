"""GPU sensors (NVML, AMD SMI): every reading is measured or missing with a reason, never made up."""

from __future__ import annotations

import sys
import types

from saturate.hardware import gpu_sensors
from saturate.hardware.gpu_sensors import AmdSmiSource, NvmlSource, open_gpu_source
from saturate.hardware.host_sensors import read_host
from saturate.telemetry import Snapshot, gpu_stat


class NVMLError(Exception):
    pass


def fake_pynvml(*, init_error: str | None = None, failing: dict[str, str] | None = None) -> types.SimpleNamespace:
    """Just enough of pynvml: one 80 GiB GPU; `failing` maps a call name to the error it raises."""
    failing = failing or {}

    def call(name, value):
        def fn(*args):
            if name in failing:
                raise NVMLError(failing[name])
            return value(*args) if callable(value) else value
        return fn

    def init():
        if init_error:
            raise NVMLError(init_error)

    return types.SimpleNamespace(
        NVMLError=NVMLError, NVML_CLOCK_SM=1, NVML_CLOCK_MEM=2, NVML_TEMPERATURE_GPU=0,
        nvmlInit=init, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 1, nvmlDeviceGetHandleByIndex=lambda i: f"h{i}",
        nvmlDeviceGetName=lambda h: b"Fake GPU",
        nvmlDeviceGetUUID=lambda h: "GPU-0000",
        nvmlDeviceGetUtilizationRates=call("util", types.SimpleNamespace(gpu=87, memory=40)),
        nvmlDeviceGetMemoryInfo=call("memory", types.SimpleNamespace(used=20 * 2**30, total=80 * 2**30)),
        nvmlDeviceGetPowerUsage=call("power", 301_500),
        nvmlDeviceGetEnforcedPowerLimit=call("limit", 700_000),
        nvmlDeviceGetClockInfo=call("clock", lambda h, kind: 1980 if kind == 1 else 2619),
        nvmlDeviceGetTemperature=call("temp", 61),
    )


def test_nvml_readings_are_converted_to_plain_units():
    [r] = NvmlSource(fake_pynvml(), [(0, "h0")]).read()
    assert r.name == "Fake GPU"
    assert (r.util_pct, r.mem_used, r.mem_total) == (87.0, 20 * 2**30, 80 * 2**30)
    assert (r.power_w, r.power_limit_w) == (301.5, 700.0)  # NVML answers in milliwatts
    assert (r.sm_clock_mhz, r.mem_clock_mhz, r.temp_c) == (1980.0, 2619.0, 61.0)
    assert r.missing == {}


def test_closing_shuts_the_library_down_once_even_when_shutdown_fails():
    calls = []

    def shutdown():
        calls.append(1)
        raise NVMLError("Uninitialized")

    nv = fake_pynvml()
    nv.nvmlShutdown = shutdown
    source = NvmlSource(nv, [(0, "h0")])
    source.close()
    source.close()
    assert calls == [1]


def test_a_sensor_that_fails_is_missing_with_its_reason_and_the_rest_is_read():
    nv = fake_pynvml(failing={"power": "Not Supported", "temp": "Insufficient Permissions", "util": "Not Supported"})
    [r] = NvmlSource(nv, [(0, "h0")]).read()
    assert r.power_w is None and r.temp_c is None and r.util_pct is None
    assert r.missing["power_w"] == "NVML: Not Supported"
    assert r.missing["temp_c"] == "NVML: Insufficient Permissions"
    assert r.mem_used == 20 * 2**30 and r.power_limit_w == 700.0
    # A window of such readings reports the figure as unmeasured, with the reason, not as 0.
    snap = Snapshot(0.0, 0.0, read_host(), [r], None)
    stat = gpu_stat([snap, snap], "util_pct")
    assert stat.mean is None and stat.missing == "NVML: Not Supported"


def test_nvml_that_cannot_start_means_no_gpu_with_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error="Driver Not Loaded"))
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # import amdsmi -> ImportError
    source = open_gpu_source(None)
    assert source.name == "none" and source.read() == []
    assert "Driver Not Loaded" in source.note and "amdsmi" in source.note


def test_every_nvml_gpu_is_listed_for_the_monitor(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    source = open_gpu_source(None)
    assert source.name == "nvml"
    assert [g.name for g in source.read()] == ["Fake GPU"]


def test_training_telemetry_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(gpu_sensors, "_torch_gpus", lambda: (0, False, []))
    source = open_gpu_source([0])
    assert source.name == "none" and "no GPU" in source.note


class FakeAmdSmi:
    class AmdSmiClkType:
        GFX, MEM = "gfx", "mem"

    class AmdSmiTemperatureType:
        EDGE = "edge"

    class AmdSmiTemperatureMetric:
        CURRENT = "current"

    def amdsmi_get_gpu_asic_info(self, h):
        return {"market_name": "AMD Instinct MI300X"}

    def amdsmi_get_gpu_activity(self, h):
        return {"gfx_activity": 93, "umc_activity": 40, "mm_activity": "N/A"}

    def amdsmi_get_gpu_vram_usage(self, h):
        return {"vram_used": 2048, "vram_total": 196608}  # MiB

    def amdsmi_get_power_info(self, h):
        return {"current_socket_power": "N/A", "average_socket_power": 612, "power_limit": 750}

    def amdsmi_get_clock_info(self, h, kind):
        if kind == "mem":
            raise RuntimeError("AMDSMI_STATUS_NOT_SUPPORTED")
        return {"clk": 2100}

    def amdsmi_get_temp_metric(self, h, sensor, metric):
        return "N/A"

    def amdsmi_shut_down(self):
        pass


def test_amd_smi_readings_in_bytes_and_watts_with_n_a_as_missing():
    [r] = AmdSmiSource(FakeAmdSmi(), [(0, "card0")]).read()
    assert r.name == "AMD Instinct MI300X"
    assert r.util_pct == 93.0
    assert (r.mem_used, r.mem_total) == (2048 * 2**20, 196608 * 2**20)
    assert (r.power_w, r.power_limit_w) == (612.0, 750.0)  # "N/A" current power: the average is read
    assert r.sm_clock_mhz == 2100.0 and r.mem_clock_mhz is None
    assert "NOT_SUPPORTED" in r.missing["mem_clock_mhz"]
    assert r.temp_c is None and "N/A" in r.missing["temp_c"]
