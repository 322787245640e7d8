"""trainplan: plan micro-batch, accumulation, precision, checkpointing, ZeRO and offload that fit and run fastest.

    from planner import plan, estimate_memory

The package imports torch and transformers lazily, so `plan --help` stays fast.
"""

from __future__ import annotations

from planner.errors import InputError, ModelNotFoundError, NoFitError, TrainplanError, UnknownGPUError

__all__ = ["plan", "estimate_memory", "load_plan", "Plan", "MemoryEstimate", "ModelSpec", "Candidate", "Config",
           "TrainplanError", "InputError", "NoFitError", "ModelNotFoundError", "UnknownGPUError", "resolve_model",
           "Adapter"]
__version__ = "0.1.0"

_LAZY = {
    "plan": ("planner.planning", "plan"),
    "estimate_memory": ("planner.memory.estimate", "estimate_memory"),
    "MemoryEstimate": ("planner.memory.estimate", "MemoryEstimate"),
    "Plan": ("planner.types", "Plan"),
    "Candidate": ("planner.types", "Candidate"),
    "Config": ("planner.config", "Config"),
    "load_plan": ("planner.prepare", "load_plan"),
    "ModelSpec": ("planner.models.spec", "ModelSpec"),
    "resolve_model": ("planner.models", "resolve_model"),
    "Adapter": ("planner.models.adapters", "Adapter"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
