"""What this machine's CPU computes natively, for a CPU trial of a GPU plan.

A CPU without bf16 instructions still runs bf16 through oneDNN's emulation, and `is_torch_bf16_available_on_device`
says True there (it only tries a matmul, transformers/utils/import_utils.py `is_torch_bf16_available_on_device`);
on an AVX2-only CPU a bf16 matmul measured 73x slower than fp32, so a trial there runs fp32 instead.
"""

from __future__ import annotations

from functools import lru_cache

#: The instruction-set features that compute a 16-bit dtype natively, as torch.cpu.get_capabilities() names them
#: (cpuinfo's names; the x86 ones are also /proc/cpuinfo's flags): AVX512-BF16 or AMX-BF16 on x86, the BF16 / SVE-BF16
#: extensions on ARM; AVX512-FP16 or AMX-FP16 on x86 and FP16 arithmetic on ARM (cpuinfo's fp16_arith, Linux's asimdhp).
NATIVE_FEATURES = {"bfloat16": ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16"),
                   "float16": ("avx512_fp16", "amx_fp16", "fp16_arith", "asimdhp")}


@lru_cache(maxsize=1)
def cpu_features() -> frozenset[str]:
    """This CPU's features: torch.cpu.get_capabilities() (cpuinfo's detection, torch/cpu/__init__.py:36 in torch
    2.13), else Linux's /proc/cpuinfo flags (torch releases without it)."""
    import torch

    get = getattr(torch.cpu, "get_capabilities", None)
    if get is not None:
        return frozenset(name for name, value in get().items() if value is True)
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_cpu_dtype(dtype: str) -> bool:
    """Whether this CPU computes `dtype` (a torch attribute name: bfloat16, float16) with its own instructions."""
    return bool(cpu_features() & set(NATIVE_FEATURES.get(dtype, ())))
