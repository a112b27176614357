from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path,
                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Token caches go to a per-session temp folder, never ~/.cache; in this process each test sees only
    the tuned plans it cached itself (a command run in a subprocess shares the session's)."""
    from saturate.tune import cache

    monkeypatch.setenv("SATURATE_CACHE", str(tmp_path_factory.getbasetemp() / "saturate-cache"))
    monkeypatch.setattr(cache, "plans_dir", lambda: tmp_path / "plans")


@pytest.fixture(scope="session")
def cpu():
    """This machine's CPU as saturate sees it (matmul peaks not measured: tests do not need them)."""
    from saturate.hardware import probe

    return probe(measure_peaks=False, device="cpu")


def make_small_corpus(parent: Path) -> Path:
    """~100 KB of real text (two standard-library modules), enough for many 129-token windows."""
    folder = parent / "corpus"
    folder.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "difflib.py"):
        (folder / name).write_text((stdlib / name).read_text())
    return folder


@pytest.fixture
def small_corpus(tmp_path: Path) -> Path:
    return make_small_corpus(tmp_path)


def cli_env() -> dict[str, str]:
    """Environment for running `python -m saturate` in a subprocess against this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def saturate_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "saturate", *args]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests run where torch sees a CUDA/ROCm device and are skipped (not dropped) elsewhere."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA or ROCm device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
