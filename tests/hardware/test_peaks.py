"""Tests for saturate.hardware.peaks: the datasheet table and the measured matmul peak."""

from __future__ import annotations

import pytest
import torch

from saturate.hardware import peaks
from saturate.hardware.peaks import DATASHEET_PEAK_FLOPS, datasheet_peaks, measure_matmul_peak

# --- the measured peak -------------------------------------------------------------------------------


def test_measure_matmul_peak_cpu_is_positive() -> None:
    assert 1e8 < measure_matmul_peak("cpu", torch.float32, seconds=0.02, repeats=2) < 1e14
    runs = peaks.matmul_peak_runs("cpu", torch.float32, seconds=0.02, repeats=3)
    assert len(runs) == 3 and all(r > 0 for r in runs)


def test_tf32_setting_is_restored_even_on_error() -> None:
    before = torch.backends.cuda.matmul.allow_tf32
    with pytest.raises(RuntimeError), peaks._tf32_matmuls(not before):
        assert torch.backends.cuda.matmul.allow_tf32 is (not before)
        raise RuntimeError("boom")
    assert torch.backends.cuda.matmul.allow_tf32 is before


# --- datasheet table --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "part"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA RTX A6000", "RTX A6000"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("NVIDIA GeForce RTX 3090", "RTX 3090"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4 Tensor"),
        ("Tesla V100-SXM2-16GB", "V100 SXM2"),
        ("Tesla T4", "T4"),
        ("AMD Instinct MI300X", "MI300X"),
        ("AMD Instinct MI250X/MI250", "MI250X"),
    ],
)
def test_datasheet_matches_the_right_row(name: str, part: str) -> None:
    peaks = datasheet_peaks(name)
    assert peaks, name
    sources = {source for _, source in peaks.values()}
    assert len(sources) == 1 and part in sources.pop()


def test_datasheet_dense_figures() -> None:
    h100 = datasheet_peaks("NVIDIA H100 80GB HBM3")
    assert h100["bf16"][0] == pytest.approx(989.5e12)  # 1979 TF sparse on the datasheet
    assert h100["tf32"][0] == pytest.approx(494.5e12)
    assert datasheet_peaks("NVIDIA H200")["bf16"][0] == pytest.approx(989.5e12)
    a100 = datasheet_peaks("NVIDIA A100-SXM4-40GB")
    assert (a100["fp32"][0], a100["tf32"][0], a100["bf16"][0]) == (19.5e12, 156e12, 312e12)


@pytest.mark.parametrize(
    "name",
    [
        "Imaginary GPU 9000",
        "NVIDIA L40",  # "L4" must not match "L40"
        "NVIDIA GeForce RTX 3090 Ti",
        "NVIDIA GeForce RTX 4090 D",
        "NVIDIA GeForce RTX 4090 Laptop GPU",
        "NVIDIA GH200 480GB",
        "AMD EPYC 9654 96-Core Processor",
        "",
    ],
)
def test_datasheet_has_nothing_for_unknown_or_variant_parts(name: str) -> None:
    assert datasheet_peaks(name) == {}


def test_datasheet_refuses_a_partial_device() -> None:
    assert datasheet_peaks("NVIDIA H200", 132)
    assert datasheet_peaks("NVIDIA H200", 16) == {}  # a MIG 1g slice keeps the full name


def test_datasheet_rows_are_consistent() -> None:
    for key, row in DATASHEET_PEAK_FLOPS.items():
        assert row.source and row.multiprocessors > 0, key
        assert set(row.flops) <= {"fp32", "tf32", "bf16", "fp16"}, key
        assert "fp32" in row.flops, key
        # Tensor-core paths are never slower than plain fp32 on any listed part.
        for dtype in ("tf32", "bf16", "fp16"):
            if dtype in row.flops:
                assert row.flops[dtype] >= row.flops["fp32"], key
