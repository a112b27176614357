"""Once the doctor's window ends in a script saturate does not stop, nothing of saturate stays on the script's
path: no hook registered with torch, torch's DataLoader and Optimizer methods their own again, no hook body
run in the steps after. And the window's report carries the hooks' own time per step."""

from __future__ import annotations

import json
import sys

import pytest

from saturate.script.boundary import ChildSettings
from saturate.script.command import run_instrumented

# A user's loop that looks, at its first and last step, at what is registered with torch, and counts saturate's
# hook bodies (`selftime`) over its last five steps.
SCRIPT = """
import json, os
import torch
import torch.utils.data.dataloader as dl
from torch.nn.modules import module as mod
from torch.optim import optimizer as optim
from torch.utils.data import DataLoader, TensorDataset

def hooks_seen(model, opt):
    return {
        "global optimizer pre": len(optim._global_optimizer_pre_hooks),
        "global optimizer post": len(optim._global_optimizer_post_hooks),
        "optimizer's own": len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks),
        "global module": len(mod._global_forward_pre_hooks) + len(mod._global_forward_hooks),
        "model's own": len(model._forward_pre_hooks) + len(model._forward_hooks),
        "replaced methods": [f"{o.__name__}.{n}" for o, n in ((dl.DataLoader, "__init__"), (dl.DataLoader, "__iter__"),
                             (dl._BaseDataLoaderIter, "__next__"), (optim.Optimizer, "__init__"))
                             if getattr(o, n).__module__.startswith("saturate")],
    }

torch.manual_seed(0)
data = TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
seen = {}
batches = iter(DataLoader(data, batch_size=16, shuffle=True))
for step in range(16):
    x, y = next(batches)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    if step == 1:
        seen["measuring"] = hooks_seen(model, opt)
    if step == 10:
        from saturate.doctor import selftime
        before = selftime.mark()[1]
later = DataLoader(data, batch_size=16)  # a loader made after detaching is torch's own
next(iter(later))
seen["detached"] = hooks_seen(model, opt)
seen["hook bodies in the last five steps"] = selftime.mark()[1] - before
json.dump(seen, open(os.environ["SEEN_JSON"], "w"))
"""


@pytest.mark.slow
def test_after_the_window_no_hook_of_saturate_remains(tmp_path, tmp_path_factory, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path_factory.mktemp("seen") / "seen.json"
    settings = ChildSettings(mode="doctor", warmup=1, count_steps=1, steps=3, stop=False)  # window ends at step 6
    # outside the script's folder and named in the environment, not on the command line: a folder named there is
    # covered by the run's scratch layer (isolation.py)
    monkeypatch.setenv("SEEN_JSON", str(out))
    run = run_instrumented([sys.executable, str(script)], settings, quiet_stdout=True)
    assert run.returncode == 0, run.tail
    seen = json.loads(out.read_text())
    measuring = seen["measuring"]
    assert measuring["global optimizer post"] == 1 and measuring["optimizer's own"] == 2  # attached
    assert measuring["model's own"] == 2 and len(measuring["replaced methods"]) == 4
    assert seen["detached"] == {"global optimizer pre": 0, "global optimizer post": 0, "optimizer's own": 0,
                                "global module": 0, "model's own": 0, "replaced methods": []}
    assert seen["hook bodies in the last five steps"] == 0
    own = run.report["instrumentation"]
    assert own["steps"] == 3 and own["calls_per_step"] > 0 and own["per_step_s"] > 0
