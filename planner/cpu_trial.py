"""What a CPU trial of a GPU plan changes in the Trainer's arguments so that it runs on this machine's CPU in seconds,
and the line saying each change (`LoadedPlan.training_arguments` logs them). The plan's files keep the GPU plan."""

from __future__ import annotations

import json
from pathlib import Path

from planner.export import DEEPSPEED_ARG
from planner.hardware.cpu import NATIVE_FEATURES, native_cpu_dtype


def cpu_trial(args: dict, float8: bool = False) -> tuple[dict, list[str]]:
    """TrainingArguments' fields made to run on this machine's CPU, and what was changed, a line each: the CPU device
    asked for, TF32, Liger-Kernel and float8 off (a CPU has no TF32 or FP8 cores, and Liger's Triton kernels need a
    GPU), bf16 / fp16 off where this CPU has no native instructions for them (`_half_off`), bitsandbytes' 8-bit
    optimizers replaced by torch's AdamW."""
    out, changes = dict(args), []
    if not out.get("use_cpu"):
        out["use_cpu"] = True
        changes.append("the CPU trains (use_cpu): this machine has no CUDA GPU")
    if float8:
        out["bf16"] = True
        changes.append("fp8 off: float8 GEMMs need FP8 tensor cores (bf16 autocast instead)")
    if out.get("tf32"):
        out["tf32"] = None
        changes.append("tf32 off: a CPU has no TF32 cores")
    if out.get("use_liger_kernel"):
        out["use_liger_kernel"] = False
        changes.append("Liger-Kernel off: its Triton kernels need a GPU")
    changes += _half_off(out)
    if "bnb" in str(out.get("optim", "")):
        out["optim"] = "adamw_torch"
        changes.append(f"{args['optim']} off (bitsandbytes needs a GPU): adamw_torch instead")
    return out, changes


def _half_off(args: dict) -> list[str]:
    """Turn off in `args` (in place) a 16-bit autocast this CPU has no native instructions for, in the DeepSpeed
    config too (the Trainer refuses a config whose precision differs from its arguments'); the line saying so."""
    for flag, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
        if not args.get(flag) or native_cpu_dtype(dtype):
            continue
        args[flag] = False
        if args.get(DEEPSPEED_ARG):
            ds = args[DEEPSPEED_ARG]
            ds = dict(ds) if isinstance(ds, dict) else json.loads(Path(ds).read_text())
            args[DEEPSPEED_ARG] = ds | {flag: {**ds.get(flag, {}), "enabled": False}}
        return [fp32_line(flag, dtype)]
    return []


#: the 16-bit dtypes as the Trainer's flags name them
SHORT = {"bfloat16": "bf16", "float16": "fp16"}


def fp32_line(name: str, dtype: str) -> str:
    """The one line saying a CPU trial runs fp32 instead of the plan's `name` (bf16, fp16, bf16 weights) in `dtype`."""
    features = " or ".join(NATIVE_FEATURES[dtype][:2])
    return (f"fp32 instead of {name}: this CPU has no native {SHORT[dtype]} ({features}; emulated it is tens of times "
            f"slower); the plan's files keep {name}")
