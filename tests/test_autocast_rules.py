"""CUDA's autocast op lists applied to CPU traces (planner/program/autocast.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from planner.program import autocast
from planner.program.trace import TraceRequest, run_trace

HEADER = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"


def header_lists() -> dict[str, list[str]]:
    text = HEADER.read_text()
    lists = {}
    for macro in ("AT_FORALL_LOWER_PRECISION_FP", "AT_FORALL_FP32", "AT_FORALL_FP32_SET_OPT_DTYPE",
                  "AT_FORALL_PROMOTE"):
        body = re.search(rf"#define {macro}\(_\)(.*?)(?=\n#|\n\n)", text, re.S).group(1)
        lists[macro] = [".".join(p.strip() for p in m.split(",")) for m in re.findall(r"_\(([^)]*)\)", body)]
    body = re.search(r"#define AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE\(_\)(.*?)(?=\n#|\n\n)", text, re.S).group(1)
    lists["append"] = re.findall(r'"(norm\.[A-Za-z_]+)"', body)
    return lists


@pytest.mark.skipif(not HEADER.exists(), reason="the installed torch ships no ATen headers")
def test_lists_are_those_of_the_installed_torch():
    lists = header_lists()
    assert list(autocast.CUDA_LOWER_PRECISION) == lists["AT_FORALL_LOWER_PRECISION_FP"]
    assert list(autocast.CUDA_FP32) == lists["AT_FORALL_FP32"]
    assert list(autocast.CUDA_FP32_SET_OPT_DTYPE) == lists["AT_FORALL_FP32_SET_OPT_DTYPE"]
    assert list(autocast.CUDA_PROMOTE) == lists["AT_FORALL_PROMOTE"]
    assert list(autocast.CUDA_FP32_APPEND_DTYPE) == lists["append"]


def dtypes(dtype=torch.bfloat16) -> dict:
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        y = F.linear(x, w)
        return {"linear": y.dtype, "pow": torch.pow(y, 3).dtype, "layer_norm": F.layer_norm(y, (8,)).dtype,
                "softmax": F.softmax(y, -1).dtype, "softmax_dtype": F.softmax(y, -1, dtype=dtype).dtype,
                "sum": y.sum().dtype, "mean": y.mean().dtype, "norm": y.norm().dtype, "gelu": F.gelu(y).dtype,
                "addcmul": torch.addcmul(y, y, x).dtype, "einsum": torch.einsum("ij,jk->ik", x, w).dtype}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_rules_cast_as_cuda_does_and_leave_cpu_autocast_alone(dtype):
    cpu = dtypes(dtype)
    with autocast.cuda_autocast_rules(str(dtype).removeprefix("torch.")):
        cuda = dtypes(dtype)
    assert cuda == {"linear": dtype, "pow": torch.float32, "layer_norm": torch.float32, "softmax": torch.float32,
                    "softmax_dtype": dtype, "sum": torch.float32, "mean": dtype, "norm": torch.float32,
                    "gelu": dtype, "addcmul": torch.float32, "einsum": dtype}
    assert cpu["pow"] == cpu["softmax"] == cpu["layer_norm"] == dtype  # CPU autocast's own lists differ
    assert dtypes(dtype) == cpu  # the kernels are restored after the block


def tiny_gpt2(layers=2):
    return transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=500, n_positions=128,
                                   attn_pdrop=0.0, architectures=["GPT2LMHeadModel"])


def req(device, checkpointing="none"):
    return TraceRequest(micro_batch=2, seq_len=64, activations="mixed", checkpointing=checkpointing,
                        attention="flash", attention_dropout=False, autocast_device=device)


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_a_cuda_trace_keeps_the_fp32_tensors_cuda_saves(checkpointing):
    """GPT-2's NewGELU is `pow`-based: under CUDA's lists it saves fp32 inputs, so a traced CUDA step keeps more."""
    config = tiny_gpt2()
    cpu = run_trace(config, 2, req("cpu", checkpointing)).activations
    cuda = run_trace(config, 2, req("cuda", checkpointing)).activations
    assert cuda > cpu


def test_a_real_step_under_the_rules_matches_its_trace():
    """The rules act on real CPU tensors as on fake ones: the traced peak equals a real step's under them (CUDA's
    autocast lists and its fused dropout, planner/program/dropout.py)."""
    from planner.program.dropout import fused_dropout
    from planner.program.step import make_batch, micro_step
    from planner.program.tracker import LiveStorageTracker

    config, r = tiny_gpt2(), req("cuda")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel._from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    model.train()
    batch = make_batch(model, r.micro_batch, r.seq_len)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    tracker = LiveStorageTracker()
    with tracker, autocast.cuda_autocast_rules("bfloat16"), fused_dropout():
        tracker.track_all(list(model.parameters()) + [p.grad for p in model.parameters()] + list(batch.values()))
        base = tracker.reset_peak()
        micro_step(model, batch, r.autocast)
    assert run_trace(config, 2, r).activations == tracker.peak - base
