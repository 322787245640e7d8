"""The attention kernel a training step really runs, as torch and transformers choose it (`vocab.KERNEL`).

SDPA on CUDA tries flash, then memory-efficient, then math (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
`select_sdp_backend`'s priority order):
* flash needs compute capability 8.0 or newer (`check_flash_attention_hardware_support`), fp16 or bf16 inputs
  (`check_tensor_dtype` with flash_dtypes) and a head size of at most 256 that is a multiple of 8
  (`check_head_dim_size_flash`);
* memory-efficient runs from compute capability 5.0 (`check_mem_efficient_hardware_support`) in fp32, fp16 and, from
  8.0, bf16, with a head size that is a multiple of 8 (4 in fp32; `check_head_dim_size_mem_efficient`);
* math otherwise.
Grouped-query models (fewer key/value heads than query heads) get `enable_gqa=True` from transformers where no mask
is passed (transformers/integrations/sdpa_attention.py `use_gqa_in_sdpa`, lines 43-52: the causal training step),
and the memory-efficient kernel rejects unequal head counts in the torch we measured: Llama-3.2-1B in fp32 on an
H100 (torch 2.11) peaked at 35.96 GiB allocated, the math kernel's saved s x s scores, where the memory-efficient
kernel's prediction was 27.56 GiB (benchmarks/results/gpu_validation-H100-80GB-2026-11-23-matrix-14_32.json).
pytorch main has since let the kernel take GQA (`can_use_mem_efficient_attention`, `supports_gqa`); until a
release that does is measured, fp32 GQA plans for math, the larger of the two.
On the CPU (aten/src/ATen/native/transformers/sdp_utils_cpp.cpp, `select_sdp_backend_cpp`) the flash kernel runs
unless dropout is on, which falls back to math. Models without SDPA run their eager attention; the flash-attn
package's FlashAttention-2 saves what SDPA's flash kernel saves.
"""

from __future__ import annotations

from planner import facts
from planner.vocab import EAGER, FLASH


def attention_kernel(implementation: str, *, device: str, compute_capability: tuple[int, int] | None, half: bool,
                     head_dim: int, dropout: float, grouped_query: bool = False) -> str:
    """The kernel (a `vocab.KERNEL` key) for the model's attention `implementation` (eager | sdpa | flash, as
    `build.effective_attention` resolved it). `compute_capability` None plans for a current GPU (8.0);
    `grouped_query`: fewer key/value heads than query heads."""
    if implementation == EAGER:
        return "eager"
    if implementation == FLASH:
        return "flash"
    if device == "cpu":
        return "math" if dropout > 0 else "flash"
    flash_min = facts.get("sdpa.flash_min_cc")
    cc = compute_capability or flash_min
    if cc >= flash_min and half and head_dim <= facts.get("sdpa.flash_max_head_dim") and head_dim % 8 == 0:
        return "flash"
    if cc >= facts.get("sdpa.efficient_min_cc") and head_dim % (8 if half else 4) == 0 and not grouped_query:
        return "efficient"
    return "math"
