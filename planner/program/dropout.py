"""Dropout as a CUDA step runs it, in a trace that runs on the CPU.

`aten::dropout` picks its kernel by device (aten/src/ATen/native/Dropout.cpp, `dropout`): with `train` and
`is_fused_kernel_acceptable(input, p)`, which asks for a CUDA, XPU, lazy or privateuse1 tensor and 0 < p < 1, it
calls the fused `native_dropout`, whose backward keeps a bool mask (one byte an element); otherwise the unfused
`_dropout`, which multiplies by a noise tensor of the input's dtype and keeps it for the backward (four bytes an
element in fp32, two in 16 bits). `dropout_`, the in-place one, is never fused. A CPU trace takes the unfused path,
so a step traced for a GPU swaps it for `native_dropout` where CUDA would.

Measured on an H100 (benchmarks/results/receipts/gpu_measured-H100-80GB.json, before this rule): the steps of models with
dropout were over-predicted by the unfused masks (BERT-large fp32 micro-batch 32 by 6.3%, GPT-2 fp32 micro-batch 16
by 3.0%), those of models without (BLOOM-560m, Llama-3.2-1B) were not.
"""

from __future__ import annotations

import contextlib
import functools

import torch


@contextlib.contextmanager
def fused_dropout():
    """`torch.nn.functional.dropout` (what nn.Dropout and transformers' models call) runs out-of-place training
    dropout as `native_dropout` for the length of the block, as `aten::dropout` does on a CUDA tensor. A module
    attribute and not a TorchFunctionMode: a mode is off while it handles `Tensor.backward`, so a checkpointed
    block's recomputation would take the unfused path again and no longer match what its forward saved."""
    functional = torch.nn.functional
    original = functional.dropout

    @functools.wraps(original)
    def dropout(input, p=0.5, training=True, inplace=False):
        if training and not inplace and 0 < p < 1 and input.numel() > 0:
            return torch.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)

    functional.dropout = dropout
    try:
        yield
    finally:
        functional.dropout = original
