"""The whole run's allocations at full depth (planner/memory/whole_run.py): a micro-step written from a few traced
blocks against the same micro-step traced at full depth, the run's order around it, and the cuBLAS workspaces."""

from __future__ import annotations

import pytest
import transformers

from planner.allocator import replay
from planner.memory.gpu import AllocatorView
from planner.program.trace import TraceRequest, run_trace
from planner.memory.whole_run import (
    RUN_STEPS, NotRepeatable, RunAllocations, full_depth_micro_step, run_events, whole_run_view,
)
from planner.program.regions import Template, decode, region_code

MiB = 2**20


def tiny_llama(layers: int):
    return transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=160,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=2000,
                                    architectures=["LlamaForCausalLM"])


def tiny_phi(layers: int):  # parallel attention and MLP: some frees are found two blocks on in the backward
    return transformers.PhiConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=128,
                                  num_attention_heads=4, vocab_size=1000, architectures=["PhiForCausalLM"])


def tiny_gpt2(layers: int):
    return transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=2000, n_positions=512,
                                   architectures=["GPT2LMHeadModel"])


def request(**kw) -> TraceRequest:
    base = dict(micro_batch=4, seq_len=256, activations="mixed", checkpointing="none", attention="flash",
                attention_dropout=False, autocast_device="cuda", grads_allocated=False)
    base.update(kw)
    return TraceRequest(**base)


def as_events(written: list) -> list:
    return [("alloc" if alloc else "free", key, size) for alloc, key, size, _ in written if alloc is not None]


@pytest.mark.parametrize("make, kw", [
    (tiny_llama, {}),
    (tiny_llama, {"checkpointing": "full", "activations": "fp32"}),
    (tiny_gpt2, {"checkpointing": "selective"}),
    (tiny_gpt2, {"grads_allocated": True, "attention": "eager", "attention_dropout": True}),
    (tiny_phi, {"seq_len": 128}),
])
def test_a_micro_step_written_from_four_blocks_is_the_one_traced_at_full_depth(make, kw):
    r = request(**kw)
    four = Template.from_json(run_trace(make(4), 4, r, profile=False).template)
    seven = Template.from_json(run_trace(make(7), 7, r, profile=False).template)
    written, traced = full_depth_micro_step(four, 7), full_depth_micro_step(seven, 7)
    # the same allocations, in the same order, at the same sizes
    assert [size for alloc, _, size, _ in written if alloc] == [size for alloc, _, size, _ in traced if alloc]
    a, b = replay(as_events(written)), replay(as_events(traced))
    assert (a.peak_allocated, a.peak_reserved, a.final_allocated) == (b.peak_allocated, b.peak_reserved,
                                                                      b.final_allocated)


def test_events_carry_the_region_they_happened_in():
    template = Template.from_json(run_trace(tiny_llama(4), 4, request(), profile=False).template)
    forward = [decode(c)[0] for c in template.codes if not decode(c)[1]]
    backward = [decode(c)[0] for c in template.codes if decode(c)[1]]
    assert forward == sorted(forward) and forward[0] == -1 and forward[-1] == 4  # embeddings, blocks 0-3, head
    blocks = [r for r in backward if 0 <= r < 4]
    assert blocks == sorted(blocks, reverse=True) and set(blocks) == {0, 1, 2, 3}  # the backward in reverse
    assert template.marks[0] > 0 and template.marks[1] > len(forward)  # the first matmul of each phase


def test_a_template_that_cannot_place_a_free_is_refused_not_written_with_leaks():
    """Four traced blocks, each forward keeping one storage; the first block's backward frees the last block's
    (three blocks away), the embeddings' backward the others'. Written at 8 blocks, no copy of a block's backward
    could free a storage three blocks away, and the last block's would be kept for ever."""
    f, b = (lambda r: region_code(r, False)), (lambda r: region_code(r, True))
    template = Template(events=(MiB, MiB, MiB, MiB, -4, -1, -2, -3),
                        codes=(f(0), f(1), f(2), f(3), b(0), b(-1), b(-1), b(-1)), layers=4)
    with pytest.raises(NotRepeatable, match="keeps 1 storages where the traced one keeps 0"):
        full_depth_micro_step(template, 8)


def test_a_model_whose_blocks_cannot_repeat_is_refused():
    template = Template(events=(8, -1), codes=(region_code(0, False), region_code(0, False)), layers=4)
    with pytest.raises(NotRepeatable):
        full_depth_micro_step(template, 6, period=3)  # 4 traced blocks cannot hold a first, 3 repeated and a last


def test_the_run_builds_the_weights_steps_then_adds_states_once_and_frees_gradients_every_step():
    """A hand-made micro-step: an activation of 12 MiB freed, a gradient of 4 MiB kept (the template of one block,
    written as is)."""
    step = Template(events=(12 * MiB, -1, 4 * MiB), codes=(region_code(0, False),) * 2 + (region_code(0, True),),
                    layers=1)
    written = full_depth_micro_step(step, 1)
    run = RunAllocations(weights=(4 * MiB,), states=((4, 4 * MiB, 4 * MiB),), grad_accum=1)
    events = run_events(written, None, run)
    ops = [(op, size) for op, _, size in events]
    assert ops[:4] == [("alloc", 4 * MiB), ("alloc", 12 * MiB), ("free", 0), ("alloc", 4 * MiB)]
    states = [size for op, key, size in events if op == "alloc" and key[0] == "state"]
    assert states == [4, 4 * MiB, 4 * MiB]  # the first optimizer step only: Adam's step, exp_avg, exp_avg_sq
    norms = [key for op, key, _ in events if op == "free" and key[0] == "norm"]
    assert len(norms) == RUN_STEPS  # gradient clipping's norm per parameter, every step
    # each step frees its activation and its gradient
    assert sum(1 for op, key, _ in events if op == "free" and key[0] != "norm") == RUN_STEPS * 2
    stats = replay(events)
    assert stats.final_allocated == 4 * MiB + 512 + 8 * MiB  # weights, states (the counter rounded to 512 B) remain


def test_where_the_workspaces_land_can_decide_the_reserved_peak_and_the_larger_is_taken():
    """64 MiB allocated and freed, then the first matmul (its 32 MiB workspace), then 64 MiB again. At the matmul
    the workspace splits the cached 64 MiB block, so the second 64 MiB needs a segment of its own: 128 MiB reserved
    for 96 MiB allocated. Allocated first, the workspace has a segment of its own and the second 64 MiB reuses the
    first's: 96 MiB for 96. The estimate keeps the 32 MiB the first placement costs. Every request is a whole 2 MiB
    multiple that fills its block, so allocated counts no more than was requested."""
    step = Template(events=(64 * MiB, -1, 64 * MiB, -2), codes=(region_code(0, False),) * 4, layers=1,
                    marks=(2, -1))
    run = RunAllocations(weights=(), workspaces=(32 * MiB,))
    at_matmul = replay(run_events(full_depth_micro_step(step, 1), None, run))
    assert (at_matmul.peak_reserved, at_matmul.peak_allocated) == (128 * MiB, 96 * MiB)
    assert whole_run_view(step, None, 1, 1, run) == AllocatorView(rounding=0, slack=32 * MiB)


def test_a_one_gpu_estimate_replays_the_whole_run_and_a_sharded_one_does_not():
    from planner.memory.estimate import Evaluation
    from planner.config import Config
    from planner.hardware import lookup_gpu
    from planner.models import resolve_model

    resolved = resolve_model(tiny_llama(6))
    evaluation = Evaluation(resolved, seq_len=256, optimizer="adamw", device="cuda", gpu=lookup_gpu("H100-80GB"))
    single = Config.of(micro_batch=2, grad_accum=2, world_size=1, precision="bf16-mixed", checkpointing="none",
                       zero_stage=0, offload="none")
    sharded = Config.of(micro_batch=2, grad_accum=2, world_size=2, precision="bf16-mixed", checkpointing="none",
                        zero_stage=3, offload="none")
    assert evaluation.whole_run_view(single) is not None
    assert evaluation.whole_run_view(sharded) is None
    est = evaluation.estimate(single, "trace")
    view = evaluation.whole_run_view(single)
    assert (est.terms.allocator_rounding, est.terms.allocator_slack) == (view.rounding, view.slack)
