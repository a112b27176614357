"""The README's Python code runs as written, at tiny sizes: each ```python block is executed in a scratch
folder, with saturate's presets shrunk (one layer, a few steps), `probe()` not measuring peaks and the
tuner's trials shortened. A block that is a fragment of the reader's own code gets the names it uses
(`model`, `loader`, …) from a prelude below; a block that needs a whole Transformers script is listed
as covered elsewhere."""

from __future__ import annotations

import functools
import re
import shutil
from pathlib import Path

import pytest

import saturate
from saturate.tune import api, measure

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)

# Names a fragment uses from the reader's own program.
LOOP_PRELUDE = """
import torch
import torch.nn.functional as F
dev = "cpu"
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader([(torch.randn(8), i % 4) for i in range(256)], batch_size=8)
"""
PRELUDES = {"prof.data(loader)": LOOP_PRELUDE}
ELSEWHERE = {"SaturateCallback()": "tests/integrations/test_transformers_callback.py (needs a Trainer)"}


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    """A scratch folder holding what the README's paths name, and saturate shrunk to seconds."""
    (tmp_path / "notes").mkdir()
    for name in ("textwrap.py", "difflib.py"):
        shutil.copy(Path(functools.__file__).with_name(name), tmp_path / "notes" / name)
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    real_build, real_probe, real_custom = saturate.build_workload, saturate.probe, saturate.custom_workload
    monkeypatch.setattr(saturate, "tune", functools.partial(saturate.tune, try_compile=False))
    shape = {"n_layer": 1, "n_head": 2, "n_embd": 32, "seq_len": 32, "effective_batch": 4, "steps": 2}
    monkeypatch.setattr(saturate, "build_workload", lambda *a, **kw: real_build(*a, **{**kw, **shape}))
    monkeypatch.setattr(saturate, "probe", lambda *a, **kw: real_probe(measure_peaks=False, device="cpu"))
    monkeypatch.setattr(saturate, "custom_workload", lambda *a, **kw: real_custom(*a, **{**kw, "steps": 2}))
    monkeypatch.setattr(api, "RealMeasurer", functools.partial(measure.RealMeasurer, min_seconds=0.05, min_steps=1,
                                                               max_steps=2))


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_python_block_runs_as_written(index, tiny, capsys):
    code = BLOCKS[index]
    if skip := next((why for marker, why in ELSEWHERE.items() if marker in code), None):
        pytest.skip(f"covered by {skip}")
    prelude = next((p for marker, p in PRELUDES.items() if marker in code), "")
    namespace: dict = {"__name__": "readme"}
    exec(compile(prelude + code, f"README.md python block {index + 1}", "exec"), namespace)
    if "def workload(" in code:  # a workload definition: it must build, and train a step
        from saturate import RunConfig, train

        w = namespace["workload"]()
        result = train(w, None, RunConfig(run_dir=Path("runs/readme"), steps=1, progress=False, tensorboard=False))
        assert result.steps == 1
