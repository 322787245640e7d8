"""estimate_memory: contract fields, analytic speed, and the directions predictions must move."""

from __future__ import annotations

import time

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.errors import InputError
from planner.memory.estimate import estimate_memory
from planner.models import resolve_model

CKPT_ORDER = ("full", "selective", "none")


def test_contract_fields_and_breakdown():
    est = estimate_memory("bigscience/bloom-560m", micro_batch=2, seq_len=512, precision="bf16-mixed",
                          optimizer="adamw", checkpointing="none", zero_stage=0, offload="none", world_size=1,
                          attention="sdpa", device="cuda", gpu="A100-80GB")
    for field in ("parameters", "gradients", "optimizer_states", "activations", "overhead", "peak_allocated", "peak"):
        assert isinstance(getattr(est, field), int) and getattr(est, field) >= 0
    assert est.parameters == 4 * 559_214_592 and est.optimizer_states == 8 * 559_214_592
    # one micro-batch per step: its activations peak before any gradient exists
    assert est.peak_allocated >= est.parameters + est.optimizer_states + est.activations
    assert est.peak_allocated >= est.model_states
    assert est.peak > est.peak_allocated
    assert est.method == "trace"


def test_analytic_is_fast_and_says_so():
    resolved = resolve_model("meta-llama/Llama-2-7b-hf")
    seconds = []
    for _ in range(3):  # the best of three: a busy CI host can stall any one call; a trace takes seconds every time
        start = time.perf_counter()
        est = estimate_memory(resolved, micro_batch=1, seq_len=2048, method="analytic")
        seconds.append(time.perf_counter() - start)
    assert min(seconds) < 0.1
    assert est.method == "analytic"


@pytest.mark.parametrize("kwargs,flag", [
    (dict(micro_batch=0), "--micro-batch"), (dict(seq_len=-1), "--seq-len"), (dict(checkpointing="some"), "--checkpointing"),
    (dict(attention="fast"), "--attention"),
])
def test_bad_arguments_are_input_errors(kwargs, flag):
    with pytest.raises(InputError) as info:
        estimate_memory("gpt2", **kwargs)
    assert info.value.flag == flag


def test_bad_combination_is_an_input_error():
    with pytest.raises(InputError, match="ZeRO"):
        estimate_memory("gpt2", offload="optimizer")


_SPEC = resolve_model("meta-llama/Llama-3.2-1B")
_PLAIN = resolve_model("gpt2")


@settings(max_examples=60, deadline=None)
@given(model=st.sampled_from([_SPEC, _PLAIN]), mb=st.integers(1, 64), seq=st.integers(16, 2048),
       precision=st.sampled_from(["fp32", "bf16-mixed", "bf16-true"]), ckpt=st.sampled_from(CKPT_ORDER),
       attention=st.sampled_from(["eager", "sdpa"]), zero=st.sampled_from([0, 2]))
def test_analytic_activations_move_the_right_way(model, mb, seq, precision, ckpt, attention, zero):
    if precision == "bf16-true" and zero:
        zero = 0
    kw = dict(precision=precision, attention=attention, zero_stage=zero, method="analytic",
              offload="optimizer" if zero else "none")

    def act(**over):
        args = dict(micro_batch=mb, seq_len=seq, checkpointing=ckpt)
        args.update(over)
        return estimate_memory(model, **kw, **args).activations

    here = act()
    assert act(micro_batch=mb + 1) >= here
    assert act(seq_len=seq + 16) >= here
    less = CKPT_ORDER[max(0, CKPT_ORDER.index(ckpt) - 1)]
    assert act(checkpointing=less) <= here


TINY = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                vocab_size=300, architectures=["LlamaForCausalLM"])


@settings(max_examples=15, deadline=None)
@given(mb=st.integers(1, 6), seq=st.sampled_from([32, 64, 128]), ckpt=st.sampled_from(CKPT_ORDER),
       precision=st.sampled_from(["fp32", "bf16-mixed"]))
def test_traced_activations_move_the_right_way(mb, seq, ckpt, precision):
    def act(**over):
        args = dict(micro_batch=mb, seq_len=seq, checkpointing=ckpt, precision=precision, device="cpu")
        args.update(over)
        return estimate_memory(TINY, **args).activations

    here = act()
    assert act(micro_batch=mb + 1) >= here
    assert act(seq_len=seq * 2) >= here
    less = CKPT_ORDER[max(0, CKPT_ORDER.index(ckpt) - 1)]
    assert act(checkpointing=less) <= here


def test_registered_buffers_count_whole_on_every_gpu():
    """GPT-Neo keeps a 2048 x 2048 bool causal-mask buffer per layer (transformers models/gpt_neo/modeling_gpt_neo.py
    `register_buffer("bias", ...)`): 4 MiB a layer, which ZeRO-3 does not shard; GPT-J's fp32 rotary table takes the
    working weights' width."""
    neo = transformers.GPTNeoConfig(num_layers=4, hidden_size=256, num_heads=4, vocab_size=1000,
                                    attention_types=[[["global", "local"], 2]], max_position_embeddings=2048,
                                    architectures=["GPTNeoForCausalLM"])
    single = estimate_memory(neo, micro_batch=1, seq_len=128, precision="bf16-mixed", gpu="H100-80GB")
    zero3 = estimate_memory(neo, micro_batch=1, seq_len=128, precision="bf16-mixed", gpu="H100-80GB", zero_stage=3,
                            world_size=8, engine="deepspeed")
    assert single.terms.model_buffers == zero3.terms.model_buffers == 4 * 2048 * 2048
    assert single.terms.allocated_overheads >= single.terms.model_buffers
    gptj = transformers.GPTJConfig(n_layer=2, n_embd=256, n_head=4, rotary_dim=32, n_positions=2048, vocab_size=1000,
                                   architectures=["GPTJForCausalLM"])
    fp32, half = (estimate_memory(gptj, micro_batch=1, seq_len=128, precision=p, gpu="H100-80GB").terms.model_buffers
                  for p in ("fp32", "bf16-true"))
    assert fp32 == 2048 * 32 * 4 and half == fp32 // 2
