"""What to train: the `Workload` type and every kind that builds one.

    base        Workload, Optimization: the types the engine, tuner and doctor take
    registry    preset names -> builders; build_workload(name)
    gpt         the GPT presets (model, FLOPs per token, corpus windows)
    timeseries  the ts-lstm preset (synthetic or CSV series)
    hf          a causal LM from a local Hugging Face folder (--hf)
    sft         chat/instruction fine-tuning: the masked loss and the workload (data side: data/chat.py)
    custom      the user's own model: custom_workload(), load_workload("module:function"), its checks
    source      one Workload from a description (preset, --workload, --hf, --task, --param), for every verb
"""

from saturate.workloads.base import Optimization, Workload
from saturate.workloads.custom import custom_workload, load_workload
from saturate.workloads.gpt import PRESETS
from saturate.workloads.registry import build_workload, preset_names

__all__ = ["PRESETS", "Optimization", "Workload", "build_workload", "custom_workload", "load_workload",
           "preset_names"]
