"""The speed model's parts: the GEMM shape model against a measured GEMM table, the traced op profile (who
dispatches what, attention kernels, causal masking), the micro-step's CPU/GPU overlap, the optimizer step's programs
(counted from the optimizers themselves), communication, and probe calibration."""

from __future__ import annotations

import functools
import json
import re
import statistics
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_speed_references import sources_disagree
from torch.utils._python_dispatch import TorchDispatchMode

from planner.config import Config
from planner.hardware import lookup_gpu
from planner.hardware.efficiency_data import efficiency
from planner.models import resolve_model
from planner.program.profile import (
    ENGINE_KERNELS, MODULE_CALLS, POLICY_OPS, PY_KERNELS, PY_VIEWS, OpRecorder, Profile,
)
from planner.program.workload import Workload
from planner.notes import Verdict
from planner.refine import retimed, speed_calibrations_from
from planner.speed import communication as speed_comm
from planner.speed import kernels as speed_kernels
from planner.speed import optimizer as speed_optim
from planner.speed.model import SpeedModel, speed_profile
from planner.types import Candidate, Measurement, ThroughputInfo


def test_small_gemms_are_less_efficient_than_large_ones():
    gpu = lookup_gpu("A100-80GB")
    eff = efficiency(gpu.name)

    def rate(m, n, k):
        return 2 * m * n * k / speed_kernels.gemm_seconds(1, m, n, k, "bf16", gpu, eff, 2)

    assert rate(256, 256, 256) < rate(1024, 1024, 1024) < rate(8192, 8192, 8192)



def test_the_gemm_constants_read_once_per_micro_step_still_follow_an_override_and_are_recorded():
    from planner import facts
    from planner.program.profile import analytic_profile

    gpu, eff = lookup_gpu("H100-80GB"), efficiency("H100-80GB")
    profile, _ = analytic_profile(resolve_model("gpt2").spec, 1024, "none")
    base = speed_kernels.device_time(profile, 4.0, "bf16-mixed", gpu, eff).gemm_s
    with facts.recording() as used, facts.overriding({"gemm.k_half": 4 * facts.get("gemm.k_half")}):
        longer = speed_kernels.device_time(profile, 4.0, "bf16-mixed", gpu, eff).gemm_s
    assert longer > base
    assert {"gemm.k_half", "gemm.tile_exponent", "gemm.tensor_core_alignment", "gemm.latency_s"} <= used

@pytest.fixture(scope="module")
def gpt2_profile():
    from planner.program.trace import TraceRequest, run_trace

    config = resolve_model("openai-community/gpt2").config
    req = TraceRequest(micro_batch=2, seq_len=64, activations="mixed", checkpointing="none", attention="flash",
                       attention_dropout=False)
    return Profile.from_json(run_trace(config, 2, req).profile)


def test_profile_counts_who_dispatches_what(gpt2_profile):
    d = gpt2_profile.dispatch
    assert d[PY_KERNELS] > 0 and d[ENGINE_KERNELS] > d[PY_KERNELS] / 2 and d[PY_VIEWS] > 0
    assert d[MODULE_CALLS] >= 2 * 8  # each block calls attention, MLP, norms, linears
    assert any(",backward," in key for key in gpt2_profile.matmuls)


def test_attention_backward_is_a_kernel_with_flops_and_causal_halves_them(gpt2_profile):
    fwd, bwd = gpt2_profile.attention["half,forward"], gpt2_profile.attention["half,backward"]
    assert fwd[3] == 2 and bwd[3] == 2          # one kernel per block, each way
    assert bwd[0] == pytest.approx(2.5 * fwd[0])  # backward = 2.5x forward FLOPs (torch.utils.flop_counter)
    # GPT-2 calls SDPA with is_causal: 2 blocks x 4 * b*h*s*s*d / 2
    assert fwd[0] == pytest.approx(2 * 4 * 2 * 12 * 64 * 64 * 64 / 2)


def test_metadata_queries_are_not_counted_as_dispatches():
    import torch

    recorder = OpRecorder(micro_batch=1, seq_len=4)
    with recorder:
        x = torch.ones(4)
        _ = x.device
        (x + 1).sum()
    assert recorder.profile.dispatch[PY_KERNELS] == 3  # ones, add, sum


def test_a_baddbmm_over_heads_moves_bytes_that_grow_with_the_micro_batch():
    """BLOOM's scores `alibi.baddbmm(q, k)` have micro-batch x heads as their batch, no token dimension: the copy of
    the added matrix and cuBLAS's read of it grow with the micro-batch like the GEMM itself, and so do the kernels
    that run on such scores, so that a profile traced at one micro-batch times another."""
    import torch

    mb, heads, seq, dim = 3, 4, 8, 2
    q, k = torch.ones(mb * heads, seq, dim), torch.ones(mb * heads, dim, seq)
    alibi = torch.ones(mb * heads, 1, seq)
    with OpRecorder(micro_batch=mb, seq_len=seq) as recorder:
        alibi.baddbmm(q, k)
    (scaled, fixed, _count), = recorder.profile.memory.values()
    assert scaled == mb * heads * seq * seq * 4 * 2 and fixed == 0  # the copy of alibi into the result, C read
    assert all(key.split(",")[-1][0] == "1" for key in recorder.profile.matmuls)
    scores = torch.ones(mb * heads, seq, seq)  # OPT's eager softmax runs on such scores: its bytes grow too
    with OpRecorder(micro_batch=mb, seq_len=seq) as recorder:
        torch.softmax(scores, -1)
    (scaled, fixed, _count), = recorder.profile.memory.values()
    assert scaled == 2 * scores.numel() * 4 and fixed == 0
    # a weight-shaped accumulation (experts x d x d'): as large at any micro-batch
    experts, a, b = torch.ones(mb * 2, 5, 7), torch.ones(mb * 2, 5, seq), torch.ones(mb * 2, seq, 7)
    with OpRecorder(micro_batch=mb, seq_len=seq) as recorder:
        experts.baddbmm(a, b)
    (scaled, fixed, _count), = recorder.profile.memory.values()
    assert scaled == 0 and fixed == mb * 2 * 5 * 7 * 4 * 2


def test_softmax_and_nll_loss_move_what_their_cuda_kernels_move():
    """SoftMax.cu and LossNLL.cu, counted for a GPU step: a row over 48 KiB (fp32 logits of a large vocabulary) is
    read three times forward and its gradient twice backward; softmax's backward adds its `grad * output` kernel at
    any row size; NLL loss reads one entry per row and its backward reads no input. Without `cuda_kernels` (a CPU
    step) every op moves its operands once. (Matched on the lent H100's profiled micro-steps: Llama-3.2-1B's
    log_softmax over 2048 x 128,256 fp32 took 1.42 ms forward, 1.45 ms backward, against 4.2 GB each here at its
    3.35 TB/s x 0.88: 1.42 ms; benchmarks/results/gpu_profile_step-H100-80GB-2026-11-23.json.)"""
    import torch
    import torch.nn.functional as F

    def moved(fn, *tensors, cuda=True):
        with OpRecorder(micro_batch=2, seq_len=3, cuda_kernels=cuda) as recorder:
            fn(*tensors)
        return sum(v[0] + v[1] for v in recorder.profile.memory.values()), \
            sum(v[2] for v in recorder.profile.memory.values())

    wide, narrow = torch.zeros(2, 3, 16384), torch.zeros(2, 3, 1024)  # 64 KiB and 4 KiB fp32 rows
    size = wide.numel() * 4
    assert moved(lambda x: torch.ops.aten._log_softmax(x, -1, False), wide)[0] == 4 * size
    assert moved(lambda x: torch.ops.aten._log_softmax(x, -1, False), wide, cuda=False)[0] == 2 * size
    assert moved(lambda x: torch.ops.aten._softmax(x, -1, False), narrow)[0] == 2 * narrow.numel() * 4
    assert moved(lambda g, y: torch.ops.aten._log_softmax_backward_data(g, y, -1, torch.float32), wide, wide) == \
        (4 * size, 1)
    assert moved(lambda g, y: torch.ops.aten._softmax_backward_data(g, y, -1, torch.float32), wide, wide) == \
        (7 * size, 2)
    assert moved(lambda g, y: torch.ops.aten._softmax_backward_data(g, y, -1, torch.float32), narrow, narrow) == \
        (6 * narrow.numel() * 4, 2)
    logits, target = torch.zeros(6, 16384), torch.zeros(6, dtype=torch.long)
    loss_bytes, _ = moved(lambda x, t: F.nll_loss(x, t), logits, target)
    assert loss_bytes < logits.numel() * 4 / 100  # the targets and a scalar, not the logits


def test_device_queries_pass_the_trace_modes_unrecorded(monkeypatch):
    """C++ asking a fake tensor for its device reaches the dispatch modes as `prim.device` (two in three of a traced
    step's dispatches): the op recorder and the live-storage tracker hand it on without looking at it."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from planner.program.profile import DEVICE_QUERY
    from planner.program.tracker import LiveStorageTracker

    looked_at = []
    record, untracked = OpRecorder._record, LiveStorageTracker._untracked
    monkeypatch.setattr(OpRecorder, "_record",
                        lambda self, p, func, *a: looked_at.append(func) or record(self, p, func, *a))
    monkeypatch.setattr(LiveStorageTracker, "_untracked", lambda self, t: looked_at.append(t) or untracked(self, t))
    with FakeTensorMode():
        weight, x = torch.empty(8, 4), torch.empty(2, 4)
        recorder, tracker = OpRecorder(micro_batch=1, seq_len=2), LiveStorageTracker()
        with tracker, recorder:
            torch.nn.functional.linear(x, weight)  # C++ reads both tensors' devices
    assert DEVICE_QUERY not in looked_at and looked_at


#: Single-GPU training steps measured on a lent H100 (benchmarks/data/gpu_measured_h100.json): each row's micro-step
#: and optimizer step, the truth the speed model's micro-step and optimizer step are compared with below.
H100_MEASURED = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "gpu_measured_h100.json"
#: How far a modelled time may be from a measured one: the widest disagreement between two measurements of one input
#: the model reads (tests/test_speed_references.py `sources_disagree`: one GEMM shape timed on two H100 units, 1.338).
#: A sum or a maximum of terms each within a factor r of the truth is within r of it, so a micro-step (the longer of
#: its kernels' sum and its host's) or an optimizer step the model has every part of lies within it.
AS_CLOSE_AS_ITS_INPUTS = sources_disagree()


def _h100_rows() -> list[dict]:
    return json.loads(H100_MEASURED.read_text())["rows"]


def _label(row: dict) -> str:
    return (f"{row['model'].split('/')[-1]}-s{row['seq_len']}-{row['precision']}-{row['checkpointing']}"
            f"-mb{row['micro_batch']}")


@functools.lru_cache(maxsize=None)
def _h100_speed(model: str, seq_len: int) -> SpeedModel:
    gpu = lookup_gpu("H100-80GB")
    return SpeedModel(Workload(resolve_model(model), seq_len=seq_len, optimizer="adamw", gpu=gpu), gpu, 1)


def _h100_config(row: dict) -> Config:
    return Config(micro_batch=row["micro_batch"], grad_accum=row["batch"] // row["micro_batch"], world_size=1,
                  precision=row["precision"], checkpointing=row["checkpointing"], zero_stage=0, offload="none")


def _h100_modelled(row: dict) -> ThroughputInfo:
    """The speed model's step for a measured row (the probes' training script: the Trainer's fused AdamW)."""
    return _h100_speed(row["model"], row["seq_len"])(_h100_config(row))


def _micro_step(row: dict) -> float:
    tp = _h100_modelled(row)
    return tp.parts.compute / _h100_config(row).grad_accum


def _within(predicted: float, measured: float) -> bool:
    return measured / AS_CLOSE_AS_ITS_INPUTS <= predicted <= measured * AS_CLOSE_AS_ITS_INPUTS


class KnownMiss(Exception):
    """Rows of a documented defect outside `AS_CLOSE_AS_ITS_INPUTS`, each on the defect's side: the expected failure
    of a strict xfail (a miss on the other side fails outright)."""


_DISPATCH = st.dictionaries(st.sampled_from([PY_KERNELS, ENGINE_KERNELS, PY_VIEWS, MODULE_CALLS, POLICY_OPS]),
                            st.floats(0, 1e5), max_size=5)


@settings(max_examples=50, deadline=None)
@given(gemms=st.floats(1, 1e3), side=st.sampled_from([64, 1024, 8192]), a=_DISPATCH, b=_DISPATCH)
def test_micro_step_is_the_longer_of_cpu_dispatch_and_gpu_kernels(gemms, side, a, b):
    """The host dispatches asynchronously: a micro-step is the longer of its kernels and its host's dispatch of them;
    the host's time adds up over what it dispatches, and dispatching is no GPU time."""
    gpu = lookup_gpu("H100-80GB")
    eff = efficiency(gpu.name)
    matmuls = {f"1,{side},{side},{side},half,forward,0100": gemms}

    def step(dispatch):
        return speed_kernels.micro_step(Profile(matmuls=matmuls, dispatch=dispatch), 1.0, "bf16-mixed", gpu, eff)

    both = {k: a.get(k, 0.0) + b.get(k, 0.0) for k in {*a, *b}}
    assert step(both).seconds == max(step(both).cpu_s, step(both).gpu_s)
    assert step(both).cpu_s == pytest.approx(step(a).cpu_s + step(b).cpu_s, rel=1e-9, abs=1e-15)
    assert step(a).gpu_s == step(b).gpu_s == step({}).gpu_s


#: The host-bound step the model still misses, with what was measured: BERT-large's fully checkpointed micro-step at
#: micro-batch 8 took 182 ms on the lent H100 (its GPU kernels about 46 ms, its uncheckpointed twin 59 ms), the model's
#: host 130 ms: its recompute costs the host 5.1 ms a block, twice the 2.7-2.9 ms of GPT-2's, BLOOM-560m's and
#: Llama-3.2-1B's blocks, which the model's per-op and per-block costs reproduce.
HOST_MISSES = {"bert-large-uncased-s512-bf16-mixed-full-mb8"}


def _host_bound() -> list[dict]:
    return [row for row in _h100_rows() if _h100_modelled(row).parts.bound() == "CPU-bound"]


def test_a_host_bound_micro_step_takes_what_the_lent_h100_measured():
    """Every measured step the model calls host-bound (its dispatch longer than its kernels), its micro-step within
    `AS_CLOSE_AS_ITS_INPUTS` of the measured one, but the documented miss (`HOST_MISSES`)."""
    bound = _host_bound()
    assert len(bound) >= 8
    outside = {_label(r): _micro_step(r) / r["micro_step_s"] for r in bound
               if _label(r) not in HOST_MISSES and not _within(_micro_step(r), r["micro_step_s"])}
    assert not outside, outside


@pytest.mark.xfail(strict=True, raises=KnownMiss, reason="BERT-large's fully checkpointed micro-step at micro-batch 8 "
                   "takes 182 ms on the lent H100 against 130 modelled: its recompute costs the host 5.1 ms a block, "
                   "twice what the other models' blocks do")
def test_bert_larges_checkpointed_host_bound_step_takes_what_the_lent_h100_measured():
    rows = [r for r in _host_bound() if _label(r) in HOST_MISSES]
    assert rows
    outside = {_label(r): _micro_step(r) / r["micro_step_s"] for r in rows
               if not _within(_micro_step(r), r["micro_step_s"])}
    assert all(ratio < 1 for ratio in outside.values()), outside
    if outside:
        raise KnownMiss(outside)


#: The measured none/full pairs whose steps are host-bound or near it on the lent H100
HOST_BOUND_PAIRS = ("gpt2-s1024-bf16-mixed-none-mb4", "bloom-560m-s1024-bf16-mixed-none-mb2",
                    "Llama-3.2-1B-s2048-bf16-mixed-none-mb1", "bert-large-uncased-s512-bf16-mixed-none-mb8")


def test_each_checkpointed_block_costs_the_host_its_bookkeeping_and_no_gpu_time():
    """Full checkpointing's bookkeeping per block is host time only, and less than what full checkpointing's micro-step
    measured over none's per block on the lent H100 in host-bound steps (GPT-2 mb 4, BLOOM-560m mb 2, Llama-3.2-1B
    mb 1, BERT-large mb 8: at least 2.71 ms; gpu_measured_h100.json), which holds the bookkeeping and the recomputed
    forward's own host time."""
    gpu = lookup_gpu("H100-80GB")
    eff = efficiency(gpu.name)
    small = Profile(matmuls={"1,64,64,64,half,forward,0100": 100.0}, dispatch={PY_KERNELS: 100.0})
    plain = speed_kernels.micro_step(small, 1.0, "bf16-mixed", gpu, eff)
    checkpointed = speed_kernels.micro_step(small, 1.0, "bf16-mixed", gpu, eff, checkpointed_blocks=24)
    assert checkpointed.gpu_s == plain.gpu_s and checkpointed.cpu_s > plain.cpu_s
    pairs = {_label(none): (none, full) for none, full in _pairs("none", "full")}
    per_block = [(full["micro_step_s"] - none["micro_step_s"]) / resolve_model(none["model"]).spec.layers
                 for none, full in (pairs[label] for label in HOST_BOUND_PAIRS)]
    assert (checkpointed.cpu_s - plain.cpu_s) / 24 < min(per_block)


def _pairs(first: str, second: str) -> list[tuple[dict, dict]]:
    """(the `first` checkpointing's row, the `second`'s) of every measured configuration that ran both at one
    micro-batch, sequence and precision."""
    rows = {(r["model"], r["seq_len"], r["batch"], r["precision"], r["micro_batch"], r["checkpointing"]): r
            for r in _h100_rows()}
    return [(row, rows[(*key[:5], second)]) for key, row in rows.items()
            if key[5] == first and (*key[:5], second) in rows]


#: Pairs whose measured cost of full checkpointing the model misses (product defect, planner/speed): BERT-large's
#: recompute costs the host 5.1 ms a block on the lent H100 (mb 8: 123 ms measured over 24 blocks, 52 modelled; mb 32:
#: 52 measured, 32 modelled), twice what GPT-2's, BLOOM-560m's and Llama-3.2-1B's blocks cost, which pass.
FULL_COSTS_MORE = {"bert-large-uncased-s512-bf16-mixed-none-mb8", "bert-large-uncased-s512-bf16-mixed-none-mb32"}


_FULL_COSTS_MORE = pytest.mark.xfail(strict=True, raises=AssertionError, reason="BERT-large's full checkpointing costs "
                                     "1.6-2.4x more than modelled: its recompute's host work per block is twice the "
                                     "other models'")


@pytest.mark.parametrize("none, full", [
    pytest.param(*pair, id=_label(pair[0]), marks=[_FULL_COSTS_MORE] if _label(pair[0]) in FULL_COSTS_MORE else [])
    for pair in _pairs("none", "full")])
def test_full_checkpointing_costs_what_the_lent_h100_measured(none, full):
    """Full checkpointing's micro-step minus none's at one micro-batch, modelled and measured: the recomputed
    forward and the bookkeeping, a sum of parts within `AS_CLOSE_AS_ITS_INPUTS`."""
    assert _within(_micro_step(full) - _micro_step(none), full["micro_step_s"] - none["micro_step_s"])


@pytest.mark.parametrize("selective, full", [
    pytest.param(*pair, id=_label(pair[0]), marks=pytest.mark.xfail(
        strict=True, raises=AssertionError, reason="selective checkpointing saves ~4x more than modelled against "
        "full in BLOOM-560m's steps at micro-batch 4 on the lent H100 (35-37 ms measured, 8.5-8.7 modelled): these "
        "GPU-bound steps run BLOOM's kernels 1.2-1.3x longer than modelled, the recompute selective skips with them"))
    for pair in _pairs("selective", "full")])
def test_selective_checkpointing_saves_what_the_lent_h100_measured(selective, full):
    """Full checkpointing's micro-step minus selective's at one micro-batch (what selective saves: the recompute of
    what its policy keeps, less the policy's own host time), modelled and measured."""
    assert _within(_micro_step(full) - _micro_step(selective), full["micro_step_s"] - selective["micro_step_s"])


def test_a_selective_policy_runs_no_python_under_torch_compile():
    """torch.compile traces the policy into the graph: no op passes its Python dispatch mode at run time. (How many
    ops pass it eagerly, from a trace: `test_the_traced_selective_profile_counts_every_recomputed_forward_op_twice_for_
    its_policy`.)"""
    block = Profile(dispatch={PY_KERNELS: 50.0, PY_VIEWS: 30.0, MODULE_CALLS: 9.0, ENGINE_KERNELS: 70.0})
    base = Profile(matmuls={"1,64,64,64,half,forward,0100": 1.0}, dispatch={PY_KERNELS: 100.0})
    selective = base.scaled_add(block, 24, policy=True)
    assert selective.dispatch[POLICY_OPS] > 0 and POLICY_OPS not in base.scaled_add(block, 24).dispatch
    assert POLICY_OPS not in selective.compiled({"forward": 1.0, "backward": 1.0},
                                                {"forward": 1.0, "backward": 1.0}).dispatch


def test_the_device_time_by_kind_adds_up_to_the_micro_steps(gpt2_profile):
    gpu = lookup_gpu("A100-80GB")
    eff = efficiency(gpu.name)
    parts = speed_kernels.device_time(gpt2_profile, 2.0, "bf16-mixed", gpu, eff)
    assert parts.seconds == pytest.approx(speed_kernels.micro_step(gpt2_profile, 2.0, "bf16-mixed", gpu, eff).gpu_s)
    assert parts.gemm_s > 0 and parts.attention_s > 0 and parts.memory_s > 0
    gemms = Profile(matmuls={"1,4096,4096,4096,half,forward,0100": 3.0})
    assert speed_kernels.device_time(gemms, 1.0, "bf16-mixed", gpu, eff) == speed_kernels.DeviceTime(
        gemm_s=3 * speed_kernels.gemm_seconds(1, 4096, 4096, 4096, "bf16", gpu, eff, 2), attention_s=0.0, memory_s=0.0)


def test_the_traced_selective_profile_counts_every_recomputed_forward_op_twice_for_its_policy():
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=6, hidden_size=64, intermediate_size=160,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                      architectures=["LlamaForCausalLM"])
    workload = Workload(resolve_model(config), seq_len=64, optimizer="adamw", gpu=lookup_gpu("H100-80GB"))

    def dispatch(checkpointing):
        cfg = Config(micro_batch=2, grad_accum=1, world_size=1, precision="bf16-mixed", checkpointing=checkpointing,
                     zero_stage=0, offload="none")
        return speed_profile(workload, cfg)[0].dispatch

    none, full, selective = dispatch("none"), dispatch("full"), dispatch("selective")
    recomputed = sum(full[kind] - none[kind] for kind in (PY_KERNELS, PY_VIEWS))  # 6 blocks' forward ops
    assert recomputed > 6 * 20 and selective[POLICY_OPS] == pytest.approx(2 * recomputed)
    assert POLICY_OPS not in full and POLICY_OPS not in none


def test_fp32_runs_slower_than_bf16_and_checkpointing_costs_recomputation():
    resolved = resolve_model("bigscience/bloom-560m")
    gpu = lookup_gpu("A100-80GB")
    speed = SpeedModel(Workload(resolved, seq_len=1024, optimizer="adamw", gpu=gpu), gpu, 1)

    def step(**kw):
        cfg = Config(**{"micro_batch": 4, "grad_accum": 1, "world_size": 1, "precision": "bf16-mixed",
                        "checkpointing": "none", "zero_stage": 0, "offload": "none", **kw})
        return speed(cfg).parts.compute

    assert step(precision="fp32") > 3 * step()      # 19.5 vs 312 TFLOPS peaks on A100
    assert step() < step(checkpointing="selective") < step(checkpointing="full") < 1.5 * step()
    assert step(micro_batch=8) < 2 * step()          # a larger micro-batch uses the GPU better


def _h100_candidates() -> list[tuple[dict, Candidate, Measurement]]:
    """(row, the model's candidate, what the probe measured) for every step the lent H100 measured."""
    found = []
    for row in _h100_rows():
        cfg = _h100_config(row)
        tp = _h100_modelled(row)
        step = cfg.grad_accum * row["micro_step_s"] + row["optimizer_step_s"]
        measured = Measurement(status="ok", micro_step_s=row["micro_step_s"], optimizer_step_s=row["optimizer_step_s"],
                               step_time_s=step)
        found.append((row, Candidate(config=cfg, memory=None, throughput=tp, verdict=Verdict(kind="fits")), measured))
    return found


def test_a_probe_calibrates_its_own_candidate_to_what_it_measured():
    """Calibrated from its own measurement, a candidate's step is the measured step (its accumulation of measured
    micro-steps and the measured optimizer step)."""
    for row, cand, measured in _h100_candidates():
        calibrated = retimed(cand, speed_calibrations_from({cand.config: (cand, measured)}))
        assert calibrated.throughput.source == "calibrated"
        assert calibrated.throughput.step_time_s == pytest.approx(measured.step_time_s, rel=1e-9), _label(row)


def test_probes_calibrate_the_speed_of_unprobed_candidates():
    """Leave one out over the lent H100's steps (benchmarks/probe_calibration.py's check): each step in turn is the
    probe, and every other step of the same model and precision family is predicted from it. Calibrated, they are
    nearer their measured step times than the model alone puts them (median |error|)."""
    rows = _h100_candidates()
    plain, calibrated = [], []
    for probe_row, probe, measured in rows:
        speeds = speed_calibrations_from({probe.config: (probe, measured)})
        for row, target, truth in rows:
            if row is probe_row or row["model"] != probe_row["model"] or \
                    target.config.precision_family() != probe.config.precision_family():
                continue
            plain.append(abs(target.throughput.step_time_s / truth.step_time_s - 1))
            calibrated.append(abs(retimed(target, speeds).throughput.step_time_s / truth.step_time_s - 1))
    assert len(plain) > 100 and statistics.median(calibrated) < statistics.median(plain)
    probed = rows[0][1]
    failed = Measurement(status="error", reason="boom")
    assert speed_calibrations_from({probed.config: (probed, failed)}) == {}


def test_data_parallel_groups_of_a_tensor_parallel_job_cross_nodes_at_the_nic_rate():
    """TP 2 x DP 8 on 2 nodes of 8: each DP group has 4 ranks per node, so its collectives cross the nodes' NICs
    although it has no more ranks than a node has GPUs."""
    spec = resolve_model("meta-llama/Llama-3.1-8B").spec
    gpu = lookup_gpu("A100-80GB")
    cfg = Config(micro_batch=1, grad_accum=1, world_size=16, precision="bf16-mixed", checkpointing="none",
                 zero_stage=3, offload="none", engine="fsdp", tensor_parallel=2)
    one_node = cfg.model_copy(update={"world_size": 8, "tensor_parallel": 1})

    def comm(c, per_node, nic):
        eff = efficiency(gpu.name).model_copy(update={"nic_GBps": nic / 8})
        return speed_comm.communication_seconds(spec, c, per_node, 0.0, 0.0, gpu, eff)

    assert comm(cfg, 8, 50) > 3 * comm(cfg, 8, 400)  # the NIC, not NVLink, bounds it
    assert comm(one_node, 8, 50) == comm(one_node, 8, 400)  # inside a node the NIC plays no part


def test_the_users_network_sets_the_inter_node_bandwidth():
    from planner.hardware.efficiency_data import efficiency_of

    gpu = lookup_gpu("A100-80GB")
    assert efficiency_of(gpu).nic_GBps == 200 / 8 and "DGX A100" in efficiency_of(gpu).network
    given = efficiency_of(gpu.model_copy(update={"nic_Gbps": 50.0}))
    assert given.nic_GBps == 50 / 8 and given.network == "given"


PROFILES = sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "results").glob(
    "gpu_profile_step-H100-80GB-*.json"))
ALIGNED_KERNEL = re.compile(r"_align([124])\b")


def _profiled_heads() -> list:
    """(model, head GEMM shape, alignment of the cuBLAS kernels the step ran for it: 1, 2 or 4, 8 where no narrower
    kernel ran) of every 16-bit step the lent H100 profiled (benchmarks/results/gpu_profile_step-H100-80GB-*.json)."""
    found = {}
    for path in PROFILES:
        for row in json.loads(path.read_text())["rows"]:
            if row["precision"] == "fp32" or not row.get("profile"):
                continue
            names = [op["name"] for op in row["profile"]["ops"]]
            narrow = {int(m.group(1)) for name in names if (m := ALIGNED_KERNEL.search(name))}
            spec = resolve_model(row["model"]).spec
            shape = (row["micro_batch"] * row["seq_len"], spec.vocab, spec.hidden)
            found[(row["model"], shape)] = min(narrow) if narrow else 8
    return [pytest.param(model, shape, alignment, id=f"{model.split('/')[-1]}-{shape[0]}")
            for (model, shape), alignment in sorted(found.items())]


@pytest.mark.parametrize("model, shape, alignment", _profiled_heads())
def test_16_bit_gemm_rate_follows_the_alignment_cublas_ran(model, shape, alignment):
    """The LM head's GEMM in each profiled 16-bit step: cuBLAS ran `_align1` kernels for GPT-2's odd vocabulary,
    `_align2` for BERT's even one, and none for Llama-3.2-1B's multiple of 8. The rate the model takes for the shape is
    that alignment's (the rates themselves: tests/test_facts.py, derived from these profiles)."""
    eff = efficiency("H100-80GB")
    expected = {1: eff.misaligned, 2: eff.misaligned_align2, 4: eff.misaligned_align2, 8: eff.matmul["bf16"]}
    assert speed_kernels.gemm_fraction(*shape, "bf16", eff, 2) == expected[alignment]
    assert eff.misaligned < eff.misaligned_align2 < eff.matmul["bf16"]


def _toy_spec(tied: bool):
    """An embedding table of 100 elements, then tensors of 10, 20, 30 and 40 in the model's order."""
    spec = resolve_model("openai-community/gpt2").spec
    return spec.model_copy(update={"tensor_sizes": (100, 10, 20, 30, 40), "embedding_parameters": 100,
                                   "tied_embeddings": tied, "vocab": 10, "hidden": 6, "num_labels": 0})


def test_gradients_are_ready_in_reverse_model_order_with_the_embedding_table_last():
    tied, untied = speed_comm.gradient_order(_toy_spec(True)), speed_comm.gradient_order(_toy_spec(False))
    # the tied head's matmul (vocab x hidden = 60) is the backward's first work; its gradient lands on the table
    assert tied == [(60.0, 0), (40.0, 40), (30.0, 30), (20.0, 20), (10.0, 10), (0.0, 100)]
    assert untied == tied[1:]
    llama = speed_comm.gradient_order(resolve_model("meta-llama/Llama-3.1-8B").spec)
    assert llama[0] == (525336576.0, 525336576) and llama[-1] == (0.0, 525336576)  # lm_head first, table last


def _torch_buckets(sizes_in_ready_order: list[int], grad_bytes: int, caps: tuple[int, int]) -> list[int]:
    """The bytes of each bucket torch's DDP reducer makes of gradients of these sizes (fp32 meta tensors in the order
    they are ready), with its first-bucket and later caps (torch/csrc/distributed/c10d/reducer.cpp
    `compute_bucket_assignment_by_size`), in the order the buckets fill."""
    from torch._C._distributed_c10d import _compute_bucket_assignment_by_size

    assert grad_bytes == 4
    tensors = [torch.empty(n, device="meta") for n in sizes_in_ready_order]
    buckets, _ = _compute_bucket_assignment_by_size(tensors, list(caps), [False] * len(tensors))
    return [sum(sizes_in_ready_order[i] for i in bucket) * grad_bytes for bucket in sorted(buckets, key=min)]


def test_gradient_buckets_close_at_their_cap_in_the_order_gradients_are_ready():
    """A toy of 40, 30, 20, 10 and 100 elements in the order they are ready, caps 100 B then 150 B."""
    buckets = speed_comm.gradient_buckets(_toy_spec(True), 4, (100, 150))
    assert [b.nbytes for b in buckets] == _torch_buckets([40, 30, 20, 10, 100], 4, (100, 150))
    assert [b.ready for b in buckets] == sorted(b.ready for b in buckets) and buckets[-1].ready == 1.0


@pytest.mark.parametrize("model", ["openai-community/gpt2", "google-bert/bert-large-uncased"])
def test_gradient_buckets_are_torchs_ddp_buckets(model):
    """DDP's buckets of a real model's gradients (fp32, in reverse parameter order, DDP's default caps: 1 MiB for the
    first bucket, 25 MiB after) are what torch's own reducer assigns."""
    from planner import facts

    spec = resolve_model(model).spec
    caps = (facts.get("ddp.first_bucket_bytes"), facts.get("ddp.bucket_cap_bytes"))
    from torch.nn.parallel.distributed import _BucketCapacityConfig

    defaults = _BucketCapacityConfig.create(None, None, False)  # DDP's own defaults (bucket_cap_mb=None)
    assert caps == (defaults.first_bucket_bytes_cap, defaults.bucket_bytes_cap)
    ready = [numel for _, numel in speed_comm.gradient_order(spec) if numel]
    assert [b.nbytes for b in speed_comm.gradient_buckets(spec, 4, caps)] == _torch_buckets(ready, 4, caps)


_BUCKETS = st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 10.0)), min_size=1, max_size=8).map(
    lambda pairs: [speed_comm.Bucket(ready, nbytes) for ready, nbytes in sorted(pairs)])


@settings(max_examples=200, deadline=None)
@given(buckets=_BUCKETS, span=st.floats(0.01, 100.0), longer=st.floats(0.0, 100.0))
def test_exposed_communication_follows_the_bucket_timeline(buckets, span, longer):
    """One collective per bucket, in order, each once its bucket is ready: what the backward does not hide is at most
    all of it, at least the last bucket's when that one is ready only at the end, no more for a longer backward, and,
    once the collectives run back to back, all of them less what runs before the backward ends."""
    comm = lambda nbytes: nbytes  # noqa: E731 - a collective's seconds: its bytes at 1 B/s
    exposed = speed_comm.exposed_seconds(buckets, span, comm)
    total = sum(b.nbytes for b in buckets)
    assert 0.0 <= exposed <= total + 1e-9
    if buckets[-1].ready == 1.0:
        assert exposed >= buckets[-1].nbytes - 1e-9
    assert speed_comm.exposed_seconds(buckets, span + longer, comm) <= exposed + 1e-9
    saturated = [speed_comm.Bucket(b.ready, b.nbytes + span) for b in buckets]  # each outlasts the whole backward
    assert speed_comm.exposed_seconds(saturated, span, comm) == pytest.approx(
        sum(b.nbytes for b in saturated) - span * (1 - saturated[0].ready))


@settings(max_examples=200, deadline=None)
@given(blocks=st.integers(1, 64), gather=st.floats(0.0, 5.0), regather=st.floats(0.0, 5.0),
       reduce=st.floats(0.0, 5.0), forward=st.floats(0.0, 500.0), backward=st.floats(0.0, 500.0),
       more=st.floats(0.0, 100.0))
def test_sharded_blocks_hide_their_gathers_behind_the_block_before(blocks, gather, regather, reduce, forward,
                                                                    backward, more):
    """ZeRO-3 / FSDP block by block: at least the first gather and the first backward communication are exposed, at
    most all of it; more compute hides no less; and once each block's compute outlasts its communication, nothing
    beyond the first of each pass is."""
    def exposed(f, b):
        return speed_comm.sharded_exposed_seconds(blocks, gather, regather, reduce, f, b)

    least, most = gather + regather + reduce, blocks * (gather + regather + reduce)
    assert least - 1e-9 <= exposed(forward, backward) <= most + 1e-9
    assert exposed(forward + more, backward) <= exposed(forward, backward) + 1e-9
    assert exposed(forward, backward + more) <= exposed(forward, backward) + 1e-9
    hidden = exposed(blocks * gather, blocks * (regather + reduce))
    assert hidden == pytest.approx(least)


@pytest.mark.parametrize("engine, zero_stage", [("torch", 0), ("deepspeed", 2), ("deepspeed", 3), ("fsdp", 3)])
def test_hidden_collectives_still_cost_the_compute_their_ncclsms(engine, zero_stage):
    """A step's collectives: all of them (`communication_total`), what the compute does not hide, and the hidden rest
    slowing the compute by NCCL's channels' share of the SMs (one CUDA block per channel): the step's communication
    part is exactly that, and more compute hides more without ever hiding all."""
    from planner.hardware.efficiency_data import nccl_channels_of

    spec = resolve_model("openai-community/gpt2").spec
    gpu = lookup_gpu("H100-80GB")
    eff = efficiency(gpu.name)
    cfg = Config(micro_batch=1, grad_accum=2, world_size=8, precision="bf16-mixed", checkpointing="none",
                 zero_stage=zero_stage, offload="none", engine=engine)
    short, long = (speed_comm.collectives(spec, cfg, 8, b, b * 1.5, gpu, eff) for b in (1e-4, 1.0))
    assert short.total == pytest.approx(long.total) and 0 <= long.exposed <= short.exposed <= short.total
    assert long.hidden > 0
    share = nccl_channels_of(gpu).coll / eff.sm_count
    assert speed_comm.contention_seconds(long.hidden, gpu, eff) == pytest.approx(long.hidden * share)
    assert 0 < share < 0.5


@pytest.mark.parametrize("backward_s", [0.0, 0.01, 1.0, 100.0])
def test_ddp_waits_for_the_embedding_gradient_and_zero1_for_the_weight_gather(backward_s):
    """However long the backward, DDP's last bucket (a tied embedding table, ready last) is all-reduced after it;
    DeepSpeed ZeRO-1 reduce-scatters its buckets during the backward but gathers the updated weights after the step,
    which no backward hides. (The ring time itself: tests/test_speed_references.py, against nccl-tests.)"""
    from planner import facts

    spec = resolve_model("openai-community/gpt2").spec
    gpu = lookup_gpu("A100-80GB")
    eff = efficiency(gpu.name)
    ddp = Config(micro_batch=1, grad_accum=1, world_size=8, precision="bf16-mixed", checkpointing="none",
                 zero_stage=0, offload="none")
    caps = (facts.get("ddp.first_bucket_bytes"), facts.get("ddp.bucket_cap_bytes"))
    last = speed_comm.gradient_buckets(spec, ddp.grad_bytes(), caps)[-1]
    assert last.ready == 1.0 and last.nbytes >= spec.embedding_parameters * ddp.grad_bytes()
    all_reduce = 2 * speed_comm.ring_seconds(last.nbytes, 8, 8, gpu, eff)
    rounding = 1 - 1e-9  # float sums along a timeline up to 1e5 times longer than the collective
    ddp_s = speed_comm.communication_seconds(spec, ddp, 8, backward_s, backward_s * 1.5, gpu, eff)
    assert ddp_s >= all_reduce * rounding
    zero1 = ddp.model_copy(update={"zero_stage": 1, "engine": "deepspeed"})
    gather = speed_comm.ring_seconds(spec.parameters * zero1.weight_bytes(), 8, 8, gpu, eff)
    assert speed_comm.communication_seconds(spec, zero1, 8, backward_s, backward_s * 1.5, gpu, eff) >= gather * rounding
    long, longer = (speed_comm.communication_seconds(spec, zero1, 8, b, b * 1.5, gpu, eff) for b in (1e3, 1e4))
    # once the backward hides the reduce-scatters, what is left is the post-step gather and the last bucket's
    # reduce-scatter, whatever the backward's length
    assert long == pytest.approx(longer, rel=1e-9)


def test_fp16_loss_scaling_unscales_every_gradient_before_the_step():
    """What torch's GradScaler does to the gradients, counted on the CPU (the same ops as on a GPU): `unscale_` runs
    `_amp_foreach_non_finite_check_and_unscale_`, reading and writing every gradient element. The model's fp16 step
    streams those bytes for GPT-2's parameters at the V100's HBM rate (its sourced input, 809 GB/s), and nothing more.
    (The lent H100's fp16/bf16 pairs cannot check it: the Trainer unscales inside clipping, outside the optimizer-step
    window the probes time, and the step's noise swamps 1.6 ms.)"""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((64, 32), (32,), (16, 8))]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(sum(p.sum() for p in params)).backward()
    counter = _StepCounter(params)
    with counter:
        scaler.unscale_(opt)
    n = sum(p.numel() for p in params)
    accesses_per_gradient = counter.elements["grad"] / n  # a read and a write each
    assert accesses_per_gradient == 2 and counter.elements["weight"] == 0

    spec = resolve_model("openai-community/gpt2").spec
    gpu = lookup_gpu("V100-16GB")
    eff = efficiency(gpu.name)
    bf16 = Config(micro_batch=1, grad_accum=1, world_size=1, precision="bf16-mixed", checkpointing="none",
                  zero_stage=0, offload="none")
    fp16 = bf16.model_copy(update={"precision": "fp16-mixed"})
    extra = (speed_optim.optimizer_seconds(spec, fp16, "adamw", gpu, eff, 1)
             - speed_optim.optimizer_seconds(spec, bf16, "adamw", gpu, eff, 1))
    fp32_grad = 4
    assert extra * speed_kernels.bandwidth(gpu, eff) == pytest.approx(
        accesses_per_gradient * fp32_grad * spec.trainable_parameters, rel=1e-9)


class _StepCounter(TorchDispatchMode):
    """Counts what an optimizer step does: for each kind of tensor (weight, gradient, anything else: states and
    temporaries) the elements its ops read and write (a mutated argument of the op's schema is read and written,
    an output written), the ops that launch a kernel on a GPU (views excluded), and the host-only ops: those on
    the CPU `step` counters a non-fused torch Adam keeps (`host`), and the Python scalars it wraps for them."""

    def __init__(self, params, host=()):
        super().__init__()
        self.kind = {**{p.data_ptr(): "weight" for p in params}, **{p.grad.data_ptr(): "grad" for p in params}}
        self.on_host = {t.data_ptr() for t in host}
        self.elements = {"weight": 0, "grad": 0, "state": 0}
        self.kernels, self.host = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from planner.program.profile import _FREE

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        touched, written = [], []
        for spec, arg in zip(func._schema.arguments, list(args) + [kwargs.get(a.name) for a in
                                                                   func._schema.arguments[len(args):]]):
            tensors = [arg] if isinstance(arg, torch.Tensor) else \
                [t for t in arg if isinstance(t, torch.Tensor)] if isinstance(arg, (list, tuple)) else []
            touched += tensors
            if spec.alias_info is not None and spec.alias_info.is_write:
                written += tensors
        if not func._schema.is_mutable:
            written += [out] if isinstance(out, torch.Tensor) else \
                [t for t in out if isinstance(t, torch.Tensor)] if isinstance(out, (list, tuple)) else []
        if name == "lift_fresh" or (touched and all(t.data_ptr() in self.on_host for t in touched + written)):
            self.on_host.update(t.data_ptr() for t in written)
            self.host += 1
        elif touched + written and name not in _FREE:
            self.kernels += 1
            for t in touched + written:
                self.elements[self.kind.get(t.data_ptr(), "state")] += t.numel()
        return out


def _adafactor(params):
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=1e-3, scale_parameter=False, relative_step=False)  # the Trainer's arguments


@pytest.mark.parametrize("table, key, make", [
    ("ADAM_STEP", "fused", lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True)),
    ("ADAM_STEP", "foreach", lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True)),
    ("ADAM_STEP", "for-loop", lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=False)),
    ("OPTIMIZER_STEP", "sgd", lambda ps: torch.optim.SGD(ps, lr=1e-3, foreach=True)),
    ("OPTIMIZER_STEP", "sgd-momentum", lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True)),
    ("OPTIMIZER_STEP", "adafactor", _adafactor),
])
def test_each_step_program_is_what_its_optimizer_runs(table, key, make):
    """vocab.ADAM_STEP and vocab.OPTIMIZER_STEP, counted from the optimizers themselves on the CPU (the same Python
    and the same ops as on a GPU): element accesses by kind, kernels per matrix and per vector, multi-tensor ops,
    host-only ops on the step counters."""
    import planner.vocab as V

    program = getattr(V, table)[key]
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((512, 256), (256, 128), (256,))]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = make(params)
    opt.step()  # states exist
    fused = key == "fused"  # a fused step keeps its counters on the GPU: their add is one of its multi-tensor ops
    steps = [] if fused else [s for p in params if isinstance(s := opt.state[p].get("step"), torch.Tensor)]
    counter = _StepCounter(params, steps)
    with counter:
        opt.step()
    n = sum(p.numel() for p in params)
    grad_written = n if fused else 0  # `_fused_adamw_`'s schema marks the gradients mutable (for its grad_scale /
    # maximize variants); this step's kernel only reads them
    assert counter.elements["weight"] == program.weight * n
    assert counter.elements["grad"] == program.grad * n + grad_written
    # temporaries at the states' width; Adafactor's factored row and column statistics and its vectors' unfactored
    # second moment are the table's rounding
    assert counter.elements["state"] == pytest.approx(program.state * n, rel=0.01)
    assert counter.kernels == 2 * program.matrix_kernels + program.vector_kernels + program.foreach_ops
    # each tensor's CPU step counter, incremented and read back; foreach increments them in one op, on a wrapped 1.0
    assert counter.host == program.host_ops_per_tensor * len(params) + (2 if key == "foreach" else 0)


def test_how_adam_runs_sets_what_the_host_issues():
    """Properties of the three ways torch runs Adam, on BERT-large (its step programs are counted from torch itself
    above): the host issues least for the fused kernel and most for the Python loop, and DeepSpeed's FusedAdam or an
    SGD step does not vary with how torch would run Adam. BERT-large's tensors are counted by hand."""
    spec = resolve_model("google-bert/bert-large-uncased").spec
    gpu = lookup_gpu("V100-16GB")
    eff = efficiency(gpu.name)
    cfg = Config(micro_batch=4, grad_accum=1, world_size=1, precision="fp32", checkpointing="none", zero_stage=0,
                 offload="none")
    fused, foreach, loop = (speed_optim.optimizer_step(spec, cfg, "adamw", gpu, eff, 1, how)
                            for how in ("fused", "foreach", "for-loop"))
    n, (matrices, vectors) = spec.trainable_parameters, speed_optim.trainable_tensors(spec)
    tensors = matrices + vectors
    assert tensors == sum(1 for size in spec.tensor_sizes if size > 0) > 300  # BERT-large's weights and biases
    assert matrices == 24 * 6 + 4 and vectors > matrices  # 6 per block, 3 embedding tables, the MLM head's dense
    assert (n, tensors) == (335_174_458, 394)
    assert fused.cpu_s < foreach.cpu_s < loop.cpu_s and fused.gpu_s < foreach.gpu_s < loop.gpu_s
    assert speed_optim.optimizer_seconds(spec, cfg, "adamw", gpu, eff, 1, "for-loop") == max(loop.gpu_s, loop.cpu_s)
    ds = cfg.model_copy(update={"precision": "bf16-mixed", "zero_stage": 1, "engine": "deepspeed"})
    assert speed_optim.optimizer_step(spec, ds, "adamw", gpu, eff, 1, "for-loop") == \
        speed_optim.optimizer_step(spec, ds, "adamw", gpu, eff, 1)
    assert speed_optim.optimizer_step(spec, cfg, "sgd", gpu, eff, 1, "for-loop") == \
        speed_optim.optimizer_step(spec, cfg, "sgd", gpu, eff, 1)


@pytest.mark.parametrize("model", [
    pytest.param("openai-community/gpt2", marks=pytest.mark.xfail(
        strict=True, raises=AssertionError, reason="GPT-2's fused AdamW step on the lent H100 takes up to 1.5x "
        "longer than modelled (1.95-2.33 ms measured, 1.54 modelled, all of it the fused kernel's bytes): the "
        "probes time the step from a synchronised GPU, so the step's Python over GPT-2's 148 tensors runs before its "
        "kernels, a cost the larger models' steps (modelled within 14 %) do not show apart")),
    "bigscience/bloom-560m", "meta-llama/Llama-3.2-1B", "google-bert/bert-large-uncased"])
def test_the_fused_adam_step_takes_what_the_lent_h100_measured(model):
    """Every bf16 and fp32 step of the model the lent H100 measured: its fused AdamW optimizer step (the Trainer's
    `adamw_torch_fused`, what the probes run) within `AS_CLOSE_AS_ITS_INPUTS` of the modelled one. fp16 rows are left
    out: the Trainer unscales their gradients inside clipping, before the window the probes time, which the model's
    fp16 step includes."""
    rows = [r for r in _h100_rows() if r["model"] == model and r["precision"] != "fp16-mixed"]
    assert rows
    for row in rows:
        assert _within(_h100_modelled(row).parts.optimizer, row["optimizer_step_s"]), _label(row)


@pytest.mark.gpu
def test_the_fused_adam_step_takes_what_this_gpu_measures():
    """torch's fused AdamW on BERT-large-shaped fp32 tensors on this machine's GPU, timed (CUDA-synchronised, the
    median of 10 after a warm-up), against the model's fused step for the GPU the catalogue finds for it."""
    import time

    spec = resolve_model("google-bert/bert-large-uncased").spec
    gpu = lookup_gpu(torch.cuda.get_device_name())
    params = [torch.nn.Parameter(torch.randn(size, device="cuda")) for size in spec.tensor_sizes if size > 0]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    times = []
    for _ in range(11):
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    cfg = Config(micro_batch=4, grad_accum=1, world_size=1, precision="fp32", checkpointing="none", zero_stage=0,
                 offload="none")
    modelled = speed_optim.optimizer_seconds(spec, cfg, "adamw", gpu, efficiency(gpu.name), 1, "fused")
    assert _within(modelled, statistics.median(times[1:]))


def test_adafactors_python_loop_costs_the_host_its_kernels_per_matrix_and_per_vector():
    """transformers' Adafactor (the Trainer's arguments) stepped once over BERT-large's own parameters (a model built
    on the meta device, its 148 matrices and 246 vectors) under a dispatch counter: every kernel it launches is one
    the model's host time counts, at the GPU host's cost per Python-issued kernel. The step binds on the host; an
    optimizer whose step no table counts (bitsandbytes') has no host time."""
    import transformers

    spec = resolve_model("google-bert/bert-large-uncased").spec
    with torch.device("meta"):
        model = transformers.AutoModelForMaskedLM.from_config(resolve_model("google-bert/bert-large-uncased").config)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.empty_like(p)
    opt = _adafactor(params)
    opt.step()  # states exist
    counter = _StepCounter(params)
    with counter:
        opt.step()
    assert (sum(p.dim() >= 2 for p in params), sum(p.dim() < 2 for p in params)) == \
        speed_optim.trainable_tensors(spec) == (148, 246)
    gpu = lookup_gpu("A100-80GB")
    eff = efficiency(gpu.name)
    cfg = Config(micro_batch=4, grad_accum=1, world_size=1, precision="bf16-mixed", checkpointing="none",
                 zero_stage=0, offload="none")
    step = speed_optim.optimizer_step(spec, cfg, "adafactor", gpu, eff, 1)
    assert counter.host == 0 and step.cpu_s == pytest.approx(counter.kernels * eff.dispatch_us * 1e-6, rel=1e-12)
    assert step.cpu_s > step.gpu_s  # the host binds
    assert speed_optim.optimizer_step(spec, cfg, "adamw-8bit", gpu, eff, 1).cpu_s == 0.0


def test_a_speed_model_times_the_adam_step_its_program_runs():
    resolved = resolve_model("openai-community/gpt2")
    gpu = lookup_gpu("A100-80GB")
    workload = Workload(resolved, seq_len=128, optimizer="adamw", gpu=gpu)
    cfg = Config(micro_batch=2, grad_accum=1, world_size=1, precision="bf16-mixed", checkpointing="none",
                 zero_stage=0, offload="none")
    emitted, foreach = SpeedModel(workload, gpu, 1), SpeedModel(workload, gpu, 1, adam_step="foreach")
    assert emitted.setup.adam_step == "fused"
    assert foreach(cfg).parts.optimizer > emitted(cfg).parts.optimizer
    assert foreach(cfg).parts.compute == emitted(cfg).parts.compute


def accuracy_benchmark():
    """benchmarks/throughput_accuracy.py, loaded from its file as the script runs it."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "throughput_accuracy.py"
    spec = importlib.util.spec_from_file_location("throughput_accuracy", path)
    if spec.name in sys.modules:
        return sys.modules[spec.name]
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses resolve their annotations through the module
    spec.loader.exec_module(bench)
    return bench


def test_the_accuracy_benchmark_times_each_published_row_with_the_optimizer_step_it_ran():
    bench = accuracy_benchmark()

    def mapped(text, **row):
        return bench.map_optimizer({"optimizer": text, **row}, [])

    assert mapped("apex FusedAdam (adam_w_mode=True)") == ("adamw", "fused")
    assert mapped("AdamW via DeepSpeed config") == ("adamw", "fused")
    assert mapped("torch.optim.AdamW (lr 1e-4, defaults)") == ("adamw", "foreach")
    assert mapped("adamw_hf (HF Trainer default at transformers 4.16)") == ("adamw", "for-loop")
    assert mapped("AdamW (HF Trainer default)", source="huggingface/transformers@v4.18.0:docs") == ("adamw", "for-loop")
    assert mapped("AdamW (HF Trainer default)", source="huggingface/transformers@v4.40.0:docs") == ("adamw", "foreach")
    assert mapped("AdamW (torch 1.13 default)") == ("adamw", "for-loop")
    assert mapped("Adafactor (optim=adafactor)") == ("adafactor", "fused")
    assert mapped("adamw_bnb_8bit") == ("adamw-8bit", "fused")
    assert mapped("SGD, momentum 0.9") == ("sgd-momentum", "fused")
    assert mapped("AdamW") == ("adamw", "fused")  # unstated: the emitted program's


def test_the_accuracy_benchmark_says_which_program_ran_each_row_and_times_tf32_as_tf32():
    import json

    bench = accuracy_benchmark()
    rows = {r["id"]: r for r in json.loads((bench.DATA / bench.HF_FILE).read_text())["rows"]}
    assert bench.program_of(rows["hf15026-t5base-a100-bf16"], "hf") == "trainer"  # run_translation.py, the Trainer
    assert bench.program_of(rows["hfblog-llama2-70b-fsdp"], "hf") == "trainer"
    assert bench.program_of(rows["tlkh-v100-roberta-base-s128-b128"], "hf") == "hf-loop"  # a Lightning module
    assert bench.program_of(rows["tfdocs-bert-a100-sdpa-b4-s256"], "hf") == "hf-loop"  # fxmarty's script
    assert bench.program_of(rows["mle-decompose-h200-8k"], "hf") == "hf-loop"  # bench_decompose.py
    assert bench.program_of(rows["mle-decompose-h200-8k"], "optimised") == "optimised"
    assert bench.map_precision("fp32 (TF32 tensor cores)", []) == "tf32"
    assert bench.map_precision("fp32 (tf32 disabled)", []) == "fp32"


def test_the_accuracy_benchmark_holds_out_every_fact_fitted_to_a_source():
    from planner import facts

    bench = accuracy_benchmark()
    folds = bench.make_folds()
    members = bench.data_members()
    for source, fold in folds.items():
        names = bench.names_of(source, members[source])
        fitted = {key for key, fact in facts.all_facts().items() if names & set(fact.fitted_to)}
        assert set(fold.fitted) == fitted
        # each fact is refitted, dropped to a first-principles value, or dropped (no prediction that depends on it)
        assert set(fold.overrides) | set(fold.efficiency) | set(fold.dropped) == fitted
        for refit in fold.efficiency.values():  # a refit reads a figure nothing from the held-out source made
            assert refit.key not in fitted and not names & set(facts.fact(refit.key).fitted_to)
    for source, ids in members.items():
        names = bench.names_of(source, ids)
        if any(names & set(fact.fitted_to) for fact in facts.all_facts().values()):
            assert source in folds
    for fold in folds.values():
        for key, refit in fold.efficiency.items():
            # a refit reads the same figure of a catalogue GPU of no higher compute capability (the fold's `how`)
            _, gpu, figure = key.split(":", 2)
            _, other, other_figure = refit.key.split(":", 2)
            assert other_figure == figure and other != gpu, key
            assert lookup_gpu(other).compute_capability_tuple <= lookup_gpu(gpu).compute_capability_tuple, key
            assert refit.value == getattr(efficiency(other), figure), key
        for key, value in fold.overrides.items():
            # a first-principles value: a correction ratio at 1, the model without it
            assert facts.fact(key).unit == "ratio" and value == 1.0, key


def test_a_fold_predicts_a_row_only_where_its_dropped_facts_do_not_enter():
    from benchmarks import evidence

    bench = accuracy_benchmark()
    fold = bench.Fold("github:x/y", ("inductor.compile_seconds_per_op",), {}, {}, ("inductor.compile_seconds_per_op",),
                      {"inductor.compile_seconds_per_op": "dropped"})

    def row(value):
        return evidence.Row(id="r", data_file="f.json", source="x/y", predicted=value, measured=1.0)

    assert bench.in_fold(fold, lambda f: row(2.0)).predicted == 2.0  # does not read it
    assert bench.in_fold(fold, lambda f: row(f.overrides["inductor.compile_seconds_per_op"])) is None


def test_the_accuracy_benchmark_ranks_configurations_only_at_one_size():
    from types import SimpleNamespace

    from benchmarks import evidence

    bench = accuracy_benchmark()

    def case(id, seq, micro, checkpointing="none"):
        cfg = Config.of(micro_batch=micro, grad_accum=1, world_size=1, precision="bf16-mixed",
                        checkpointing=checkpointing, zero_stage=0, offload="none")
        return SimpleNamespace(id=id, source_group="s", model_name="m", gpu="A100-80GB", cfg=cfg, seq_len=seq,
                               compute_only=False, attention="sdpa", optimizer="adamw", adam_step="fused",
                               per_node=1, nic_Gbps=None)

    def row(id, predicted, measured):
        return evidence.Row(id=id, data_file="f.json", source="x/y", predicted=predicted, measured=measured)

    # a sequence-length sweep alone: no group, whatever the order
    sweep = [case("a", 512, 4), case("b", 1024, 4), case("c", 2048, 4)]
    ranks = bench.rank_agreement(sweep, {"a": row("a", 1, 1), "b": row("b", 2, 2), "c": row("c", 4, 4)})
    assert ranks["pairs"] == 0 and ranks["tau"] is None
    # one size, two checkpointing modes: ranked (samples per second, the larger micro-batch being no faster here)
    same = [case("a", 512, 4), case("b", 512, 4, "full"), case("c", 512, 8)]
    ranks = bench.rank_agreement(same, {"a": row("a", 1.0, 1.0), "b": row("b", 1.2, 1.3), "c": row("c", 2.1, 1.9)})
    assert ranks["pairs"] == 3 and ranks["groups"][0]["varies"] == ["micro-batch", "checkpointing"]
    assert ranks["concordant"] == 2 and ranks["discordant"] == 1


def test_a_mixture_of_experts_runs_its_experts_as_grouped_gemms_and_is_not_faster_than_a_dense_model():
    """transformers runs Mixtral's experts as torch._grouped_mm (its default `grouped_mm` experts): one GEMM per
    expert over tokens x top-k / experts rows. Mixtral-8x7B computes more per token (12.9B active parameters) than
    Mistral-7B (7.2B) with the same attention and hidden size: on the same GPU and settings (LoRA, as the issue that
    found Mixtral predicted faster planned it) it is not faster."""
    from planner.planning import resolve_hardware, resolve_job
    from planner.request import PlanRequest

    cfg = Config(micro_batch=4, grad_accum=2, world_size=1, precision="bf16-mixed", checkpointing="full",
                 zero_stage=0, offload="none")
    speeds = {}
    for name in ("mistralai/Mixtral-8x7B-v0.1", "mistralai/Mistral-7B-v0.1"):
        request = PlanRequest.of(model=name, global_batch=8, gpu="H200-141GB", peft="lora", seq_len=2048)
        job = resolve_job(request, resolve_hardware(request, detect=False))
        profile, anchor = speed_profile(job.speed.workload, cfg)
        if "Mixtral" in name:
            spec = job.spec
            rows = anchor * 2048 * spec.experts_per_token / spec.num_experts
            grouped = [dims for _, dims, _, phase, _ in profile.gemms() if dims[0] == spec.num_experts
                       and phase == "forward"]
            assert [spec.num_experts, rows, 2 * spec.ffn, spec.hidden] in grouped  # gate and up, per expert
        speeds[name] = job.speed(cfg).tokens_per_s
    assert speeds["mistralai/Mixtral-8x7B-v0.1"] < speeds["mistralai/Mistral-7B-v0.1"]


@pytest.mark.parametrize(("model", "traced"), [("llama", [2]), ("t5", [2, 1])])
def test_speed_profile_takes_one_trace_where_blocks_are_found(monkeypatch, model, traced):
    """The speed profile's 1-block step is the 2-block trace without its last block (one trace); a model whose blocks
    are not one stack (T5's encoder and decoder) is traced at both depths."""
    import transformers

    import planner.program.trace as trace_mod
    import planner.speed.model as speed_model

    config = (transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=160,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                       architectures=["LlamaForCausalLM"]) if model == "llama" else
              transformers.T5Config(num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16,
                                    vocab_size=500, decoder_start_token_id=0, pad_token_id=0,
                                    architectures=["T5ForConditionalGeneration"]))
    resolved = resolve_model(config)
    depths, run = [], trace_mod.run_trace
    monkeypatch.setattr(trace_mod, "run_trace",
                        lambda c, layers, *a, **k: depths.append(layers) or run(c, layers, *a, **k))
    monkeypatch.setattr(trace_mod, "load_json", lambda *a: None)  # traced now, whatever an earlier test stored
    monkeypatch.setattr(trace_mod, "_memory_cache", {})
    req = trace_mod.TraceRequest(micro_batch=2, seq_len=32, activations="half", checkpointing="none",
                                 attention="math", attention_dropout=False)
    (l1, p1), (l2, p2) = speed_model.speed_trace_profiles(resolved, req)
    assert depths == traced and (l1, l2) == (1, 2)
    assert sum(p2.matmuls.values()) > sum(p1.matmuls.values()) > 0


def test_configurations_sharing_a_micro_step_time_it_once(monkeypatch):
    """A search's configurations that differ in accumulation or sharding run one micro-step per traced program: it is
    timed once per speed model, and each configuration's step equals what a fresh model times for it alone."""
    import planner.speed.step as step_mod

    gpu = lookup_gpu("H100-80GB")

    def fresh() -> SpeedModel:
        return SpeedModel(Workload(resolve_model("gpt2"), seq_len=1024, optimizer="adamw", gpu=gpu), gpu, 8)

    configs = [Config(micro_batch=4, grad_accum=accum, world_size=8, precision="bf16-mixed", checkpointing="none",
                      zero_stage=stage, offload="none") for accum in (1, 2, 4) for stage in (0, 1, 2)]
    alone = [fresh()(cfg) for cfg in configs]
    timed, real = [], step_mod.micro_step
    monkeypatch.setattr(step_mod, "micro_step", lambda *a, **k: timed.append(a[1]) or real(*a, **k))
    shared = fresh()
    assert [shared(cfg) for cfg in configs] == alone
    assert len(timed) == len({cfg.trace_family() for cfg in configs}) == 2  # DDP's fp32 weights, ZeRO's 16-bit ones


def test_a_timed_micro_step_is_not_reused_under_other_facts_or_another_efficiency():
    """The micro-step memo of a speed model answers only for the facts and Efficiency it was timed with: an override
    (a benchmark's refit) and a setup copied with other figures time the step afresh."""
    from dataclasses import replace

    from planner import facts

    gpu = lookup_gpu("H100-80GB")
    speed = SpeedModel(Workload(resolve_model("gpt2"), seq_len=1024, optimizer="adamw", gpu=gpu), gpu, 1)
    cfg = Config(micro_batch=4, grad_accum=1, world_size=1, precision="bf16-mixed", checkpointing="none",
                 zero_stage=0, offload="none")
    before = speed(cfg).parts.micro_gpu
    with facts.overriding({"gemm.k_half": 4 * facts.get("gemm.k_half")}):
        assert speed(cfg).parts.micro_gpu != before
    assert speed(cfg).parts.micro_gpu == before
    slower = speed.eff.model_copy(update={"hbm": speed.eff.hbm / 2})
    speed.setup = replace(speed.setup, eff=slower)
    assert speed.setup.timed == {}
    assert speed(cfg).parts.micro_gpu > before
