"""A user's script's model and its batch-coupled layers, for `saturate tune -- CMD`'s trainer stages.

In the script's process (`hooks.Script`, once the model is found) `record` names the model's layers whose
results depend on the micro-batch (BatchNorm and friends: `workloads.coupling`); the report carries them to
the parent, where `trainer_stages.kept_split` says why the micro-batch × accumulation stage keeps the split
as written (or, with `--allow-micro-batch-change`, that searching it changes the maths).
"""

from __future__ import annotations

from typing import Any

from saturate.workloads.coupling import coupled_layers


def record(model: Any) -> dict[str, Any]:
    """What the report says of the model's batch-coupled layers: `{"batch_coupled": [type names]}`."""
    try:
        return {"batch_coupled": coupled_layers(model)}
    except Exception as e:  # a model whose modules cannot be walked: say so rather than stop the script
        return {"batch_coupled": None, "batch_coupled_error": f"{type(e).__name__}: {e}"}
