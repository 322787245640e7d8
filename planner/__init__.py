"""trainplan: plan micro-batch, accumulation, precision, checkpointing, ZeRO and offload that fit and run fastest.

    from planner import plan, estimate_memory, load_plan
    p = plan("bigscience/bloom-560m", 256, gpu="A100-80GB", peft="lora")
    model = p.prepare(model); args = p.training_arguments(); p.emit("run/")

The public names load lazily (torch and transformers take seconds to import), so `plan --help` stays fast.
docs/library.md shows a Trainer and a TRL script.
"""

from __future__ import annotations

import importlib

from planner.errors import InputError, ModelNotFoundError, NoFitError, TrainplanError, UnknownGPUError
from planner.quiet import quiet_import_notices

# before transformers is imported: it imports torchao, whose import logs lines about kernels no plan uses
quiet_import_notices()

__version__ = "0.1.0"

_LAZY = {
    "plan": "planner.planning", "plan_request": "planner.planning", "PlanRequest": "planner.request",
    "estimate_memory": "planner.memory.estimate", "MemoryEstimate": "planner.memory.estimate",
    "load_plan": "planner.prepare", "LoadedPlan": "planner.prepare", "Plan": "planner.types",
    "Candidate": "planner.types", "Config": "planner.config", "ModelSpec": "planner.models.spec",
    "resolve_model": "planner.models", "Adapter": "planner.models.adapters", "compare_gpus": "planner.compare",
}
__all__ = ["Adapter", "Candidate", "Config", "InputError", "LoadedPlan", "MemoryEstimate", "ModelNotFoundError",
           "ModelSpec", "NoFitError", "Plan", "PlanRequest", "TrainplanError", "UnknownGPUError", "compare_gpus",
           "estimate_memory", "load_plan", "plan", "plan_request", "resolve_model"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'planner' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
