"""The fake-tensor trace against real CPU steps, its extrapolation, anchoring and cache."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import torch
import transformers

import planner.program.trace as trace_mod
from planner.memory.estimate import estimate_memory
from planner.program.step import make_batch, micro_step
from planner.program.trace import TraceFit, TraceRequest, run_trace, trace_activations
from planner.program.tracker import LiveStorageTracker


def tiny_llama(layers=6):
    return transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=160,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                    architectures=["LlamaForCausalLM"])


def req(**kw):
    base = dict(micro_batch=2, seq_len=64, activations="fp32", checkpointing="none", attention="flash",
                attention_dropout=True)
    base.update(kw)
    return TraceRequest(**base)


def real_activation_peak(config, r: TraceRequest) -> int:
    """A real CPU micro-step with gradients allocated, measured like the trace."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.float32)
    model.train()
    batch = make_batch(model, r.micro_batch, r.seq_len)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    tracker = LiveStorageTracker()
    with tracker:
        tracker.track_all(list(model.parameters()) + [p.grad for p in model.parameters()] + list(batch.values()))
        base = tracker.reset_peak()
        micro_step(model, batch, r.autocast)
    return tracker.peak - base


def test_fake_trace_equals_real_cpu_step():
    config = tiny_llama(3)
    r = req(activations="fp32")
    assert run_trace(config, 3, r).activations == real_activation_peak(config, r)


def test_fake_trace_close_to_real_cpu_step_under_autocast():
    """Same ops and dtypes, but the autograd engine orders a few backward ops differently with fake tensors
    (RMSNorm's backward against the embedding's), so one fp32 (b, s, h) tensor per block is live at the real
    step's peak and not at the trace's: a few percent in this tiny model, less in real ones."""
    config = tiny_llama(3)
    r = req(activations="mixed")
    assert run_trace(config, 3, r).activations == pytest.approx(real_activation_peak(config, r), rel=0.05)


@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
def test_extrapolation_from_3_and_4_blocks_matches_direct_trace(checkpointing):
    config = tiny_llama(9)
    r = req(checkpointing=checkpointing, micro_batch=3)
    fit = trace_activations(config, f"tiny-{checkpointing}", 9, r, batch_slope=False)
    assert fit.layers_traced == (3, 4)
    assert fit.activations(9, 3) == pytest.approx(run_trace(config, 9, r).activations, rel=0.002)


def test_the_peak_may_change_phase_with_depth():
    """Under full checkpointing with CUDA's autocast, the forward keeps every block's cached 16-bit weights while
    the backward's peak (the logits' and embeddings' gradients) barely grows with depth: at 3 and 4 blocks the
    backward holds the peak, at 24 the forward. Each phase is fitted apart, so the extrapolation still lands."""
    config = transformers.LlamaConfig(num_hidden_layers=24, hidden_size=128, intermediate_size=1024,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=32000,
                                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    r = req(micro_batch=1, seq_len=16, activations="mixed", checkpointing="full", attention_dropout=False,
            autocast_device="cuda", grads_allocated=True)
    small, whole = run_trace(config, 4, r), run_trace(config, 24, r)
    assert small.backward > small.forward and whole.forward > whole.backward
    fit = trace_activations(config, "tiny-phases", 24, r, batch_slope=False)
    assert fit.activations(24, 1) == pytest.approx(whole.activations, rel=0.002)
    single = TraceFit.from_points(3, 4, 1, 2, *(run_trace(config, layers, replace(r, micro_batch=b)).activations
                                                for layers in (3, 4) for b in (1, 2)))
    assert single.activations(24, 1) < 0.8 * whole.activations  # one fit of the peak extrapolates the backward


def test_fit_is_exact_at_its_anchor_micro_batch():
    config = tiny_llama(6)
    fit = trace_activations(config, "tiny-anchor", 6, req(micro_batch=4))
    assert fit.activations(6, 4) == pytest.approx(run_trace(config, 6, req(micro_batch=4)).activations, rel=0.002)
    assert fit.activations(6, 5) == pytest.approx(run_trace(config, 6, req(micro_batch=5)).activations, rel=0.002)


def test_traces_are_cached(monkeypatch):
    config = tiny_llama(6)
    trace_activations(config, "tiny-cache", 6, req(micro_batch=7))
    calls = []
    monkeypatch.setattr(trace_mod, "run_trace", lambda *a, **k: calls.append(a) or trace_mod.TracePoint(0, 0, {"matmuls": {}, "attention": {}, "memory": {}, "dispatch": {}}))
    trace_activations(config, "tiny-cache", 6, req(micro_batch=7))
    assert calls == []
    trace_mod._memory_cache.clear()  # the disk cache still answers
    trace_activations(config, "tiny-cache", 6, req(micro_batch=7))
    assert calls == []


def test_memory_traces_skip_the_op_profile_until_one_is_asked_for():
    config, r = tiny_llama(2), req(micro_batch=3)
    memory_only = trace_mod.cached_trace(config, "tiny-profile", 2, r, False)
    assert memory_only.profile is None
    with_ops = trace_mod.cached_trace(config, "tiny-profile", 2, r, False, profile=True)
    assert with_ops.profile and with_ops.activations == memory_only.activations
    trace_mod._memory_cache.clear()  # the stored trace now has its profile: no third run
    assert trace_mod.cached_trace(config, "tiny-profile", 2, r, False).profile == with_ops.profile


@pytest.mark.parametrize("case", ["llama", "llama-lora-liger", "gpt2-autocast"])
def test_shallower_profile_is_the_trace_one_block_less(case):
    """A profiled trace also keeps its ops without the last block's: exactly (values and order) the profile of the
    same step traced one block shallower, also where the first block differs (LoRA: no input gradient there)."""
    from planner.models.adapters import Adapter

    if case == "gpt2-autocast":
        config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=500, n_positions=256,
                                         architectures=["GPT2LMHeadModel"])
        r = req(activations="mixed", attention="math", autocast_device="cuda")
    else:
        config = tiny_llama(3)
        r = req(activations="half", autocast_device="cuda")
        if case == "llama-lora-liger":
            r = replace(r, adapter=Adapter("lora", rank=8), liger=True)
    for layers in (2, 3):
        deep = run_trace(config, layers, r, profile=True)
        assert deep.shallower is not None
        assert json.dumps(deep.shallower) == json.dumps(run_trace(config, layers - 1, r, profile=True).profile)
    assert run_trace(config, 1, r, profile=True).shallower is None  # no block would be left
    assert run_trace(config, 2, r, profile=False).shallower is None


def test_gpu_view_drops_attention_dropout_masks_and_adds_overheads():
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=256,
                                     architectures=["GPT2LMHeadModel"])
    cpu = estimate_memory(config, micro_batch=2, seq_len=256, precision="fp32", device="cpu")
    gpu = estimate_memory(config, micro_batch=2, seq_len=256, precision="fp32", device="cuda", gpu="A100-80GB")
    assert gpu.activations < cpu.activations  # CPU SDPA with dropout saves s x s tensors; GPU kernels do not
    assert cpu.overhead == 0 and cpu.peak == cpu.peak_allocated
    assert gpu.overhead > 0 and gpu.peak > gpu.peak_allocated
    assert gpu.terms.cuda_context > 0


@pytest.mark.parametrize("objective", ["labels", "sum"])
def test_the_allocator_replay_requests_the_bytes_the_trace_counts(monkeypatch, objective):
    """The step's replay asks for exactly the live bytes the tracker peaks at (the sum objective's carried outputs
    included), so what it adds on top (rounding, slack) is the allocator's alone."""
    seen = []
    real = trace_mod.replay
    monkeypatch.setattr(trace_mod, "replay", lambda events: seen.append(real(events)) or seen[-1])
    point = run_trace(tiny_llama(2), 2, req(activations="mixed", objective=objective, autocast_device="cuda"),
                      profile=False)
    (stats,) = seen
    assert stats.peak_requested == point.activations
    assert (point.rounding, point.slack) == (stats.peak_allocated - stats.peak_requested,
                                             stats.peak_reserved - stats.peak_allocated)
    assert point.rounding > 0  # the step's small tensors round up to 512 B blocks


def test_7b_traced_estimate_is_fast():
    start = time.perf_counter()
    est = estimate_memory("meta-llama/Llama-2-7b-hf", micro_batch=1, seq_len=2048, precision="bf16-mixed")
    elapsed = time.perf_counter() - start
    assert est.method == "trace"
    assert elapsed < 10.0, f"7B traced estimate took {elapsed:.1f} s"


def test_sequence_fit_predicts_an_untraced_length():
    from planner.program.trace import trace_sequence_fit

    config = tiny_llama(6)
    r = req(attention="eager", micro_batch=2)  # eager attention keeps s x s scores: a real quadratic term
    fit = trace_sequence_fit(config, "tiny-seq", 6, r, (64, 128, 256))
    assert fit.c2 > 0
    direct = trace_activations(config, "tiny-seq", 6, replace(r, seq_len=192), batch_slope=False).activations(6, 2)
    assert fit.activations(192) == pytest.approx(direct, rel=0.03)


def test_a_model_op_without_a_meta_kernel_falls_back_quietly(caplog):
    """transformers 5's fused MoE experts call aten._grouped_mm, whose meta kernel takes bf16 only: an fp32 trace
    fails, the estimate falls back to the formulas, and torch's ERROR log of that failure is not shown to users."""
    import logging

    from planner.memory.estimate import estimate_memory

    config = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                        num_local_experts=4, num_experts_per_tok=2,
                                        architectures=["MixtralForCausalLM"])
    with caplog.at_level(logging.ERROR):
        est = estimate_memory(config, micro_batch=2, seq_len=32, precision="fp32", gpu="A100-80GB")
    assert est.peak > 0
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses")]


def test_the_trace_runs_the_half_dtype_the_step_runs():
    """bf16 and fp16 have the same bytes, not the same program: T5 clamps fp16 hidden states only (transformers
    models/t5/modeling_t5.py, `if hidden_states.dtype == torch.float16`), and clamp keeps its input for the
    backward, so the fp16 step keeps more than the bf16 one."""
    config = transformers.T5Config(d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2, vocab_size=300,
                                   decoder_start_token_id=0, pad_token_id=0,
                                   architectures=["T5ForConditionalGeneration"])
    bf16, fp16 = (run_trace(config, 2, req(activations="half", attention="eager", half_dtype=dtype),
                            profile=False).activations for dtype in ("bfloat16", "float16"))
    assert fp16 > bf16


@pytest.mark.parametrize("precision, half_dtype, autocast", [("fp16-mixed", "float16", "float16"),
                                                             ("bf16-mixed", "bfloat16", "bfloat16"),
                                                             ("bf16-true", "bfloat16", None)])
def test_trace_request_carries_the_precisions_half_dtype(precision, half_dtype, autocast):
    from planner.config import Config
    from planner.memory.estimate import Evaluation
    from planner.models import resolve_model

    evaluation = Evaluation(resolve_model(tiny_llama(2)), seq_len=64, optimizer="adamw", attention="sdpa",
                            gpus_per_node=1, device="cuda")
    cfg = Config.of(micro_batch=1, grad_accum=1, world_size=1, precision=precision, checkpointing="none",
                    zero_stage=0, offload="none", engine=None)
    r = evaluation.workload.request(cfg)
    assert (r.half_dtype, r.autocast) == (half_dtype, autocast)


def test_a_layerdrop_draw_is_real_under_the_fake_trace():
    """transformers 4.x LayerDrop branches on `torch.rand([]) < layerdrop`: the scalar is drawn for real and the
    fake mode propagates it as a constant; other draws stay fake, and torch.rand is restored afterwards."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from planner.program.trace import _real_scalar_draws

    original = torch.rand
    with FakeTensorMode() as mode, _real_scalar_draws(mode):
        draw = torch.rand([])
        assert isinstance(bool(draw < 2.0), bool) and bool(draw < 2.0)
        assert isinstance(torch.rand(3), FakeTensor)
    assert torch.rand is original


def test_legacy_mask_checks_are_answered_as_for_a_real_all_ones_mask(monkeypatch):
    """Before transformers 5 the decisions live in modeling_attn_mask_utils, and model modules import
    `_prepare_4d_attention_mask_for_sdpa` by name; under fake tensors both answer as an all-ones mask does, real
    masks still reach the originals, the padding warning is skipped, and everything is restored afterwards."""
    import sys
    import types

    from torch._subclasses.fake_tensor import FakeTensorMode

    from planner.program.trace import _real_mask_decisions

    class AttentionMaskConverter:
        @staticmethod
        def _ignore_causal_mask_sdpa(attention_mask, inputs_embeds, past_key_values_length, sliding_window=None,
                                     is_training=False):
            return attention_mask is None

    def expand(mask, dtype, tgt_len=None):
        return "expanded"

    legacy = types.ModuleType("transformers.modeling_attn_mask_utils")
    legacy.AttentionMaskConverter, legacy._prepare_4d_attention_mask_for_sdpa = AttentionMaskConverter, expand
    model_module = types.ModuleType("transformers.models.fake.modeling_fake")
    model_module._prepare_4d_attention_mask_for_sdpa = expand
    monkeypatch.setattr(transformers, "modeling_attn_mask_utils", legacy, raising=False)
    monkeypatch.setitem(sys.modules, legacy.__name__, legacy)
    monkeypatch.setitem(sys.modules, model_module.__name__, model_module)
    ignore = AttentionMaskConverter.__dict__["_ignore_causal_mask_sdpa"]
    warn = transformers.PreTrainedModel.__dict__["warn_if_padding_and_no_attention_mask"]

    class Lazy(types.ModuleType):  # transformers' lazy modules import on attribute access (torchvision, say)
        def __getattr__(self, name):
            raise ModuleNotFoundError("No module named 'torchvision'")

    monkeypatch.setitem(sys.modules, "transformers.models.lazy", Lazy("transformers.models.lazy"))
    real = torch.ones(2, 8)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(real)
        with _real_mask_decisions():
            # reads token values to decide on a warning (transformers 4.x): skipped for fake ids
            assert transformers.PreTrainedModel.warn_if_padding_and_no_attention_mask(None, fake, None) is None
            assert AttentionMaskConverter._ignore_causal_mask_sdpa(fake, fake, 0) is True
            assert AttentionMaskConverter._ignore_causal_mask_sdpa(real, fake, 0) is False
            # transformers 4.46 calls it by keyword (modeling_attn_mask_utils.py `_prepare_4d_causal_..._for_sdpa`)
            assert AttentionMaskConverter._ignore_causal_mask_sdpa(attention_mask=fake, inputs_embeds=fake,
                                                                   past_key_values_length=0) is True
            assert AttentionMaskConverter._ignore_causal_mask_sdpa(attention_mask=real, inputs_embeds=fake,
                                                                   past_key_values_length=0) is False
            assert model_module._prepare_4d_attention_mask_for_sdpa(fake, torch.float16) is None
            assert model_module._prepare_4d_attention_mask_for_sdpa(mask=fake, dtype=torch.float16) is None
            assert model_module._prepare_4d_attention_mask_for_sdpa(real, torch.float16) == "expanded"
    assert model_module._prepare_4d_attention_mask_for_sdpa is expand and legacy._prepare_4d_attention_mask_for_sdpa \
        is expand
    assert AttentionMaskConverter.__dict__["_ignore_causal_mask_sdpa"] is ignore
    assert transformers.PreTrainedModel.__dict__["warn_if_padding_and_no_attention_mask"] is warn
