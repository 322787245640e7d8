"""The GPU view without a GPU: the attention kernel CUDA picks, the allocator replay of a traced step, the margin
for the model's measured error, and the order of the reported peaks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from planner import estimate_memory, facts
from planner.allocator import replay
from planner.program.kernels import attention_kernel
from planner.program.step import make_batch, micro_step
from planner.program.tracker import LiveStorageTracker

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "published_memory-margin.json"


@pytest.mark.parametrize("implementation,device,cc,half,head_dim,dropout,kernel", [
    ("sdpa", "cuda", (8, 0), True, 128, 0.0, "flash"),       # A100 bf16
    ("sdpa", "cuda", (8, 0), False, 128, 0.0, "efficient"),  # A100 fp32: flash needs 16-bit inputs
    ("sdpa", "cuda", (7, 0), True, 64, 0.1, "efficient"),    # V100 fp16: flash needs sm80
    ("sdpa", "cuda", (9, 0), True, 512, 0.0, "efficient"),   # head size above flash's 256
    ("sdpa", "cuda", (7, 5), True, 100, 0.0, "math"),        # head size no kernel takes
    ("sdpa", "cpu", None, False, 64, 0.1, "math"),           # CPU SDPA with dropout
    ("sdpa", "cpu", None, False, 64, 0.0, "flash"),
    ("eager", "cuda", (9, 0), True, 128, 0.0, "eager"),
    ("flash", "cuda", (8, 0), True, 128, 0.0, "flash"),
])
def test_attention_kernel_follows_torchs_rules(implementation, device, cc, half, head_dim, dropout, kernel):
    assert attention_kernel(implementation, device=device, compute_capability=cc, half=half, head_dim=head_dim,
                            dropout=dropout) == kernel


def test_the_kernel_decides_what_attention_keeps():
    """GPT-2 has attention dropout: eager keeps the scores and the dropout mask, CUDA's fused kernels neither."""
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=512,
                                     architectures=["GPT2LMHeadModel"])
    kw = dict(micro_batch=2, seq_len=512, precision="fp16-mixed")
    eager = estimate_memory(config, attention="eager", gpu="V100-16GB", **kw)
    fused = estimate_memory(config, attention="sdpa", gpu="V100-16GB", **kw)
    assert fused.activations < eager.activations


def test_peaks_are_ordered_and_the_margin_is_in_what_must_fit():
    est = estimate_memory("gpt2", micro_batch=4, seq_len=512, precision="bf16-mixed", gpu="A100-80GB")
    assert est.peak_allocated <= est.peak_reserved <= est.peak_process <= est.peak
    assert est.margin > 0 and est.peak == est.peak_process + est.margin
    assert est.margin_basis in ("rows", "activations")  # sized by rows like it, or by the activation margin
    cpu = estimate_memory("gpt2", micro_batch=4, seq_len=512, precision="bf16-mixed", device="cpu")
    assert cpu.margin == 0 and cpu.peak == cpu.peak_allocated


def test_replaying_a_real_steps_events_covers_its_live_peak():
    """The tracker's allocation events of a real CPU step, replayed through the allocator model: the allocator
    holds at least the live bytes (rounded to blocks) and reserves segments above them."""
    model = transformers.LlamaForCausalLM._from_config(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=300))
    batch = make_batch(model, 2, 64)
    tracker = LiveStorageTracker()
    with tracker:
        tracker.track_all(list(model.parameters()) + list(batch.values()))
        base = tracker.reset_peak()
        tracker.record()
        micro_step(model, batch, None)
    stats = replay(tracker.events)
    live_peak = tracker.peak - base
    assert live_peak <= stats.peak_allocated <= live_peak * 1.05 + 512 * len(tracker.events)
    assert stats.peak_reserved >= stats.peak_allocated and not stats.oom


def test_allocated_counts_the_blocks_the_allocator_keeps_whole():
    """max_memory_allocated counts whole blocks, requested bytes do not (CCA alloc_found_block): a sharded estimate,
    whose step and model states are replayed apart, holds both replays' rounding in its allocated peak and their
    slack above it."""
    from planner.config import Config
    from planner.hardware import lookup_gpu
    from planner.memory.estimate import Evaluation
    from planner.memory.gpu import states_view
    from planner.models import resolve_model

    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=768, intermediate_size=2048,
                                      num_attention_heads=12, vocab_size=3000, architectures=["LlamaForCausalLM"])
    evaluation = Evaluation(resolve_model(config), seq_len=128, optimizer="adamw", device="cuda",
                            gpu=lookup_gpu("A100-80GB"), gpus_per_node=2)
    cfg = Config.of(micro_batch=2, grad_accum=1, world_size=2, precision="bf16-mixed", checkpointing="none",
                    zero_stage=3, offload="none", engine="fsdp")
    est = evaluation.estimate(cfg, "trace")
    spec = evaluation.resolved.spec
    view = evaluation.step_view(cfg, est.activations, "trace") + states_view(spec, cfg, evaluation.states(cfg), "adamw")
    assert (est.terms.allocator_rounding, est.terms.allocator_slack) == (view.rounding, view.slack)
    assert view.rounding > 0 and est.peak_allocated - view.rounding == (
        est.model_states + est.activations + est.terms.model_buffers + est.terms.cublas_workspace)


def test_the_margin_is_fitted_to_the_published_rows_and_says_so():
    """The margin is the published HF-code rows' 90th percentile of measured / predicted activations, predicted on
    plan's path: every prediction that holds it back is in-sample for every row of published_memory.json, its source
    is that benchmark's results, and those results hold the fit it names (the value fitted on all rows and the
    leave-one-source-out judgement of it)."""
    margin = facts.fact("memory.activation_margin")
    assert margin.fitted_to == ("published_memory.json#*",) and margin.unit == "fraction"
    assert "benchmarks/results/published_memory-margin.json" in margin.source and RESULTS.exists()
    assert "leave-one-source-out" in margin.source
    assert facts.in_sample_by(["memory.activation_margin"], "published_memory.json", "any-row", "elsewhere") == [
        "memory.activation_margin"]
    fit = json.loads(RESULTS.read_text())["activation_margin"]
    # its value against the fit those results record: tests/test_facts.py, every fitted fact
    folds = fit["leave_one_source_out"]["folds"]
    assert len(folds) >= 2 and sum(f["rows"] for f in folds.values()) == fit["fit_rows"] == len(fit["rows"])


def test_objective_sum_skips_the_loss():
    kw = dict(micro_batch=2, seq_len=256, precision="bf16-true", optimizer="sgd", gpu="A100-80GB")
    labels = estimate_memory("gpt2", **kw)
    summed = estimate_memory("gpt2", objective="sum", **kw)
    assert summed.activations < labels.activations  # no fp32 log-softmax over the vocabulary
    with pytest.raises(Exception):
        estimate_memory("gpt2", objective="mean", **kw)




def test_cublas_copies_an_expanded_operand_for_the_kernels_duration():
    import torch

    from planner.program.tracker import LiveStorageTracker, cublas_operand_copies

    w = torch.randn(64, 32)
    grad = torch.ones(()).expand(128, 64)  # what SumBackward hands the LM head: a stride-0 view
    assert cublas_operand_copies(torch.ops.aten.mm.default, (grad, w)) == 128 * 64 * 4
    assert cublas_operand_copies(torch.ops.aten.mm.default, (grad.contiguous(), w)) == 0
    assert cublas_operand_copies(torch.ops.aten.mm.default, (w.t(), grad.contiguous().t())) == 0  # transposes: as is
    peaks = {}
    for cuda in (False, True):
        tracker = LiveStorageTracker(cuda_matmuls=cuda)
        with tracker:
            tracker.track_all([w, grad])
            base = tracker.reset_peak()
            out = grad @ w
        peaks[cuda] = tracker.peak - base
    assert peaks[False] == out.numel() * 4 and peaks[True] == peaks[False] + 128 * 64 * 4


def test_a_sum_objective_keeps_its_outputs_through_the_backward_as_the_benchmarks_loop_does():
    from transformers import GPT2Config

    from planner.program.trace import TraceRequest, run_trace

    # no dropout: CUDA's fused kernel keeps smaller masks than the CPU's (planner/program/dropout.py)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=4096, n_positions=128, resid_pdrop=0.0,
                        embd_pdrop=0.0)
    config.architectures = ["GPT2LMHeadModel"]
    req = dict(micro_batch=2, seq_len=128, activations="half", checkpointing="none", attention="flash",
               attention_dropout=False, objective="sum")
    cpu, cuda = (run_trace(config, 2, TraceRequest(**req, autocast_device=device)) for device in ("cpu", "cuda"))
    logits = 2 * 128 * 4096 * 2  # bf16
    # in the LM head's backward (the peak) CUDA adds cuBLAS's copy of the logits' expanded gradient
    assert cpu.backward + logits // 2 < cuda.backward <= cpu.backward + logits and cuda.forward == cpu.forward
    import torch
    from transformers import GPT2LMHeadModel

    from planner.program.step import forward_loss

    held: list = []
    loss = forward_loss(GPT2LMHeadModel(config), {"input_ids": torch.zeros(2, 8, dtype=torch.long)}, None,
                        objective="sum", hold=held)
    assert held and held[0].logits.shape == (2, 8, 4096) and loss.requires_grad  # kept for the caller's backward


def test_the_benchmarks_loop_keeps_a_steps_outputs_through_the_next_forward():
    """`outputs = model(**inputs); outputs.logits.sum().backward()` in a loop: the previous step's outputs are
    rebound only when the next forward returns. The trace's forward peak matches a real CPU loop's second forward,
    with a model that returns its cache (use_cache) as the benchmarks' loops leave it."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from planner.program.trace import TraceRequest, run_trace

    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=4096, n_positions=128, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=True)
    config.architectures = ["GPT2LMHeadModel"]
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).train()
    batch = {"input_ids": torch.randint(0, 4096, (2, 128))}
    tracker = LiveStorageTracker()
    with tracker:
        tracker.track_all(list(model.parameters()) + list(model.buffers()) + list(batch.values()))
        base = tracker.reset_peak()
        outputs = model(**batch)  # the warm-up step, whose outputs the loop still holds
        loss = outputs.logits.sum()
        loss.backward()
        model.zero_grad()
        tracker.reset_peak()  # the live outputs are pinned: they die only in the accounting's next reset
        outputs = model(**batch)
        loss = outputs.logits.sum()
        real_forward = tracker.peak - base
    held = outputs.logits.numel() * 4
    req = TraceRequest(micro_batch=2, seq_len=128, activations="fp32", checkpointing="none", attention="flash",
                       attention_dropout=False, objective="sum", grads_allocated=False, use_cache=True)
    traced = run_trace(config, 2, req, profile=False)
    assert traced.forward == real_forward and real_forward > held * 2  # this step's logits and the previous ones


def test_a_gpu_trace_runs_dropout_as_cudas_fused_kernel():
    """CUDA's `aten::dropout` keeps a bool mask (native_dropout), the CPU's a mask of the input's dtype: a trace for
    a GPU keeps 1 byte per dropped element where a CPU trace keeps 4 in fp32 (GPT-2: the embeddings' dropout and
    two per block), also through a checkpointed block's recomputation."""
    import torch
    from transformers import GPT2Config

    from planner.program.dropout import fused_dropout
    from planner.program.trace import TraceRequest, run_trace

    x, original = torch.randn(4, 8, requires_grad=True), torch.nn.functional.dropout
    with fused_dropout():
        assert type(torch.nn.Dropout(0.1)(x).grad_fn).__name__ == "NativeDropoutBackward0"
        assert torch.nn.functional.dropout(x, 0.1, training=False) is x
        assert type(torch.nn.functional.dropout(x.clone(), 0.1, inplace=True).grad_fn).__name__ != \
            "NativeDropoutBackward0"  # the in-place dropout is never fused
    assert torch.nn.functional.dropout is original  # restored on leaving
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=128, resid_pdrop=0.1,
                        embd_pdrop=0.1, attn_pdrop=0.0)
    config.architectures = ["GPT2LMHeadModel"]
    for checkpointing in ("none", "full"):
        req = dict(micro_batch=2, seq_len=128, activations="fp32", checkpointing=checkpointing, attention="flash",
                   attention_dropout=False)
        cpu, cuda = (run_trace(config, 2, TraceRequest(**req, autocast_device=device), profile=False)
                     for device in ("cpu", "cuda"))
        masks = 0 if checkpointing == "full" else (1 + 2 * 2) * 2 * 128 * 64  # dropped elements saved
        assert cpu.forward - cuda.forward >= 3 * masks and cuda.backward <= cpu.backward


def test_the_traced_program_sets_use_cache_as_its_loop_does():
    """The Trainer sets the config's use_cache from TrainingArguments (False by default); a benchmark's own loop
    (the sum objective) leaves the config's, which returns the decoding cache with the outputs."""
    from planner.config import Config
    from planner.models import resolve_model
    from planner.program.trace import _prepare_config
    from planner.program.workload import Workload

    resolved = resolve_model("gpt2")
    assert resolved.config.use_cache is True and transformers.TrainingArguments("out").use_cache is False
    cfg = Config.of(world_size=1, precision="bf16-mixed", zero_stage=0, offload="none", engine=None, micro_batch=1,
                    grad_accum=1, checkpointing="none")
    for objective, expected in (("labels", False), ("sum", True)):
        req = Workload(resolved, seq_len=128, optimizer="adamw", objective=objective).request(cfg)
        assert req.use_cache is expected and _prepare_config(resolved.config, 2, req).use_cache is expected


def test_carried_outputs_are_live_in_the_replay_until_the_next_forward_returns():
    from planner.program.trace import _with_carried

    events = [("alloc", 1, 100), ("alloc", 2, 50), ("free", 1, 0)]
    assert _with_carried(events, [], 2) == events
    assert _with_carried(events, [(7, 30)], 2) == [("alloc", ("carried", 7), 30), ("alloc", 1, 100), ("alloc", 2, 50),
                                                   ("free", ("carried", 7), 0), ("free", 1, 0)]
    assert replay(_with_carried(events, [(7, 3 << 20)], 2)).peak_allocated > replay(events).peak_allocated


@pytest.mark.gpu
def test_on_a_gpu_the_backward_has_a_workspace_of_its_own_and_dropout_keeps_a_bool_mask():
    """The two CUDA rules the trace follows (cuda.blas_threads, planner/program/dropout.py), measured in a fresh
    process (benchmarks/gpu_mechanisms.py `measure_step_rules`) so no earlier backward has made the workspace."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    code = ("import json, sys, torch; sys.path.insert(0, 'benchmarks'); from gpu_mechanisms import measure_step_rules; "
            "from planner.hardware import detect_gpus; "
            "print(json.dumps(measure_step_rules(torch, detect_gpus().gpu)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300,
                          check=True)
    rules = json.loads(done.stdout.strip().splitlines()[-1])
    assert rules["backward_thread_workspace_allocated"] == rules["planner_workspace_per_thread"]
    for dtype in ("float32", "bfloat16"):
        assert rules[f"dropout_{dtype}_saved_bytes_per_element"] == pytest.approx(1.0, abs=0.01)
