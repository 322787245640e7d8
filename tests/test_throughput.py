"""The speed model's parts: the GEMM shape model against a measured GEMM table, the traced op profile (who
dispatches what, attention kernels, causal masking), the micro-step's CPU/GPU overlap, the optimizer step's programs
(counted from the optimizers themselves), communication, and probe calibration."""

from __future__ import annotations

import math

import pytest
import torch
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
from planner.refine import _recalibrated, speed_calibrations_from
from planner.speed import communication as speed_comm
from planner.speed import kernels as speed_kernels
from planner.speed import optimizer as speed_optim
from planner.speed import step as speed_step
from planner.speed.model import SpeedModel, speed_profile
from planner.types import Candidate, Measurement, ThroughputInfo


def test_small_gemms_are_less_efficient_than_large_ones():
    gpu = lookup_gpu("A100-80GB")
    eff = efficiency(gpu.name)

    def rate(m, n, k):
        return 2 * m * n * k / speed_kernels.gemm_seconds(1, m, n, k, "bf16", gpu, eff, 2)

    assert rate(256, 256, 256) < rate(1024, 1024, 1024) < rate(8192, 8192, 8192)


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


#: The lent H100 node's host, measured (benchmarks/results/gpu_mechanisms-H100-80GB-2026-11-22.json `overheads`): a
#: Python-issued op that launches a kernel takes 11.469 us (python_kernel_us), a Python view op 1.3728 us
#: (python_view_us). efficiency.json stores both rounded to 0.1 us (11.5, 1.4), so a time worked by hand from the
#: measured figures is allowed half of 0.1 us per op: 0.44% of a kernel launch, 3.64% of a view op.
H100_HOST_KERNEL_US, H100_HOST_VIEW_US = 11.469, 1.3728
KERNEL_ROUNDING, VIEW_ROUNDING = 0.05 / 11.469, 0.05 / 1.3728
#: benchmarks/results/checkpoint_host_cost.json `result`: one checkpointed block's bookkeeping, and one op passing a
#: selective policy, in Python view ops of the host that measured them (876.59 and 21.048; stored as 877 and 21.0)
CHECKPOINT_BLOCK_VIEW_OPS, POLICY_OP_VIEW_OPS = 876.59, 21.048


def test_micro_step_is_the_longer_of_cpu_dispatch_and_gpu_kernels():
    gpu = lookup_gpu("H100-80GB")
    eff = efficiency(gpu.name)
    small = Profile(matmuls={"1,64,64,64,half,forward,0100": 100.0}, dispatch={PY_KERNELS: 100.0})
    step = speed_kernels.micro_step(small, 1.0, "bf16-mixed", gpu, eff)
    # 100 tiny GEMMs issued from Python on the lent H100's host: 100 x 11.469 us = 1.147 ms, the host's time
    assert step.seconds == step.cpu_s == pytest.approx(100 * H100_HOST_KERNEL_US * 1e-6, rel=KERNEL_ROUNDING)
    big = Profile(matmuls={"1,8192,8192,8192,half,forward,0100": 100.0}, dispatch={PY_KERNELS: 100.0})
    step = speed_kernels.micro_step(big, 1.0, "bf16-mixed", gpu, eff)
    assert step.seconds == step.gpu_s > step.cpu_s


def test_the_device_time_by_kind_adds_up_to_the_micro_steps(gpt2_profile):
    gpu = lookup_gpu("A100-80GB")
    eff = efficiency(gpu.name)
    parts = speed_kernels.device_time(gpt2_profile, 2.0, "bf16-mixed", gpu, eff)
    assert parts.seconds == pytest.approx(speed_kernels.micro_step(gpt2_profile, 2.0, "bf16-mixed", gpu, eff).gpu_s)
    assert parts.gemm_s > 0 and parts.attention_s > 0 and parts.memory_s > 0
    gemms = Profile(matmuls={"1,4096,4096,4096,half,forward,0100": 3.0})
    assert speed_kernels.device_time(gemms, 1.0, "bf16-mixed", gpu, eff) == speed_kernels.DeviceTime(
        gemm_s=3 * speed_kernels.gemm_seconds(1, 4096, 4096, 4096, "bf16", gpu, eff, 2), attention_s=0.0, memory_s=0.0)


def test_each_checkpointed_block_costs_the_host_its_measured_bookkeeping():
    gpu = lookup_gpu("H100-80GB")
    eff = efficiency(gpu.name)
    small = Profile(matmuls={"1,64,64,64,half,forward,0100": 100.0}, dispatch={PY_KERNELS: 100.0})
    plain = speed_kernels.micro_step(small, 1.0, "bf16-mixed", gpu, eff)
    checkpointed = speed_kernels.micro_step(small, 1.0, "bf16-mixed", gpu, eff, checkpointed_blocks=24)
    # 24 blocks of 876.59 view ops on the lent H100's host at 1.3728 us each: 28.88 ms more host time, no GPU time
    extra = checkpointed.cpu_s - plain.cpu_s
    assert extra == pytest.approx(24 * CHECKPOINT_BLOCK_VIEW_OPS * H100_HOST_VIEW_US * 1e-6,
                                  rel=VIEW_ROUNDING + 0.5 / 876.59)
    assert checkpointed.gpu_s == plain.gpu_s
    # measured on that node: full checkpointing's micro-step minus none's, per block, in host-bound steps (GPT-2 mb 4,
    # BLOOM-560m mb 2, Llama-3.2-1B mb 1, BERT-large mb 8: 2.75, 2.71, 2.89, 5.12 ms; benchmarks/results/
    # gpu_validation-H100-80GB-2026-11-22-allocator-matrix-0_14.json micro_step_s) holds the bookkeeping and the
    # recomputed forward's own host time: the bookkeeping alone is less than the least of them
    assert extra / 24 < 2.71e-3


def test_a_selective_policy_costs_the_host_each_op_it_handles_twice():
    """torch's per-op SAC runs a Python dispatch mode over every op of a checkpointed block, in its forward and in its
    recompute: 2 x blocks x the block's forward ops, each at the measured policy cost; none under torch.compile."""
    gpu = lookup_gpu("H100-80GB")
    eff = efficiency(gpu.name)
    block = Profile(dispatch={PY_KERNELS: 50.0, PY_VIEWS: 30.0, MODULE_CALLS: 9.0, ENGINE_KERNELS: 70.0})
    base = Profile(matmuls={"1,64,64,64,half,forward,0100": 1.0}, dispatch={PY_KERNELS: 100.0})
    full, selective = base.scaled_add(block, 24), base.scaled_add(block, 24, policy=True)
    assert selective.dispatch[POLICY_OPS] == 2 * 24 * (50 + 30) and POLICY_OPS not in full.dispatch
    extra = speed_kernels.cpu_seconds(selective, eff) - speed_kernels.cpu_seconds(full, eff)
    # 3,840 ops through the policy, each 21.048 view ops of the lent H100's host at 1.3728 us: 110.9 ms
    assert extra == pytest.approx(3840 * POLICY_OP_VIEW_OPS * H100_HOST_VIEW_US * 1e-6,
                                  rel=VIEW_ROUNDING + 0.05 / 21.048)
    assert POLICY_OPS not in selective.compiled({"forward": 1.0, "backward": 1.0},
                                                {"forward": 1.0, "backward": 1.0}).dispatch


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


def _candidate(compute, optimizer, micro_batch=4, grad_accum=2, source="model", precision="bf16-mixed"):
    cfg = Config(micro_batch=micro_batch, grad_accum=grad_accum, world_size=1, precision=precision,
                 checkpointing="none", zero_stage=0, offload="none")
    parts = speed_step.StepParts(compute=compute, optimizer=optimizer)
    tp = ThroughputInfo(tokens_per_s=1000.0 / (compute + optimizer), samples_per_s=1.0, mfu=0.3,
                        step_time_s=compute + optimizer, source=source, parts=parts)
    return Candidate(config=cfg, memory=None, throughput=tp, verdict=Verdict(kind="fits"))


def test_probes_calibrate_the_speed_of_unprobed_candidates():
    probed = _candidate(compute=2.0, optimizer=0.5)  # modelled: 1.0 s per micro-step
    measured = Measurement(status="ok", micro_step_s=1.5, optimizer_step_s=0.25, step_time_s=3.25)
    calib = speed_calibrations_from({probed.config: (probed, measured)})["mixed"]
    assert (calib.micro_step, calib.optimizer_step, calib.probes, calib.precision) == (1.5, 0.5, 1, "mixed")
    other = _recalibrated(_candidate(compute=4.0, optimizer=0.5, grad_accum=4), calib)
    assert other.throughput.source == "calibrated"
    assert other.throughput.step_time_s == pytest.approx(4.0 * 1.5 + 0.5 * 0.5)
    assert other.throughput.tokens_per_s == pytest.approx(1000.0 / 4.5 * 4.5 / 6.25)
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


@pytest.mark.parametrize("dims, rate", [((4096, 50257, 768), "misaligned"), ((4096, 30522, 1024), "misaligned_align2"),
                                        ((4096, 1020, 1024), "misaligned_align2"), ((4096, 1024, 4096), "aligned")])
def test_16_bit_gemm_rate_follows_the_alignment_of_its_dimensions(dims, rate):
    """cuBLAS runs align1 kernels for an odd dimension (GPT-2's vocabulary), align2/align4 ones for an even dimension
    that is not a multiple of 8 (BERT's), full-width ones otherwise; fp32 has no such rule."""
    eff = efficiency("H100-80GB")
    expected = eff.matmul["bf16"] if rate == "aligned" else getattr(eff, rate)
    assert speed_kernels.gemm_fraction(*dims, "bf16", eff, 2) == expected
    assert speed_kernels.gemm_fraction(*dims, "fp32", eff, 4) == eff.matmul["fp32"]
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


def test_gradient_buckets_close_at_their_cap_in_the_order_gradients_are_ready():
    # 4 bytes per element, caps 100 B for the first bucket, 150 B after: work 60|40|30|20|10|0 of 160
    buckets = speed_comm.gradient_buckets(_toy_spec(True), 4, (100, 150))
    assert [(b.ready, b.nbytes) for b in buckets] == [
        (100 / 160, 160),        # the 40-element tensor alone passes the first cap
        (150 / 160, 200),        # 30 + 20 elements: 200 B >= 150
        (1.0, 440)]              # 10 + the 100-element table, ready when the backward ends


def test_exposed_communication_follows_the_bucket_timeline():
    buckets = [speed_comm.Bucket(0.25, 2.0), speed_comm.Bucket(0.5, 1.0), speed_comm.Bucket(1.0, 3.0)]
    # backward of 8 s: the first runs 2-4 s, the second 4-5 s, the last 8-11 s: 3 s after the backward
    assert speed_comm.exposed_seconds(buckets, 8.0, lambda nbytes: nbytes) == pytest.approx(3.0)
    # a 2 s backward: 0.5-2.5, 2.5-3.5, 3.5-6.5: 4.5 s exposed
    assert speed_comm.exposed_seconds(buckets, 2.0, lambda nbytes: nbytes) == pytest.approx(4.5)


def test_sharded_blocks_hide_their_gathers_behind_the_block_before():
    # 4 blocks, 1 s gather each, forward 8 s (2 s a block) hides all but the first gather; a backward of 4 s
    # (1 s a block) cannot hide the regather + reduce (2 s): 1 s a block is exposed, plus the first and the last
    assert speed_comm.sharded_exposed_seconds(4, 1.0, 1.0, 1.0, 8.0, 4.0) == pytest.approx(1.0 + 2.0 + 3 * 1.0)
    # stage 2 keeps the forward's weights: only the reduce-scatters in the backward, all hidden but the last
    assert speed_comm.sharded_exposed_seconds(4, 1.0, 0.0, 1.0, 8.0, 4.0) == pytest.approx(1.0 + 1.0)


def test_ddp_waits_for_the_embedding_gradient_and_zero1_for_the_weight_gather():
    """However long the backward, DDP's last bucket (a tied embedding table, ready last) is all-reduced after it;
    DeepSpeed ZeRO-1 reduce-scatters its buckets during the backward but gathers the updated weights after the step."""
    spec = resolve_model("openai-community/gpt2").spec
    gpu = lookup_gpu("A100-80GB")
    eff = efficiency(gpu.name)
    ddp = Config(micro_batch=1, grad_accum=1, world_size=8, precision="bf16-mixed", checkpointing="none",
                 zero_stage=0, offload="none")
    # Worked by hand on a node of 8 A100s at NCCL's measured 234.89 GBps bus bandwidth (nccl-tests all_reduce,
    # stas00/ml-engineering@744d01e network/README.md; efficiency.json stores 234.89/300 as 0.783: 0.064%), a ring
    # moving 7/8 of the bytes. DDP all-reduces GPT-2's 39,383,808-element embedding tables (wte + wpe, fp32
    # gradients) after the backward, 2 x 7/8 x 157.5 MB = 1.174 ms at least.
    assert spec.embedding_parameters == 50257 * 768 + 1024 * 768
    rounding = 0.0005 / 0.783
    table = 2 * 7 / 8 * 39_383_808 * 4 / 234.89e9
    assert speed_comm.communication_seconds(spec, ddp, 8, 100.0, 150.0, gpu, eff) >= table * (1 - rounding)
    # ZeRO-1 gathers the 124,439,808 updated bf16 weights after the step and reduce-scatters the tables' bf16
    # gradients, its last bucket, after the backward: 7/8 x (248.9 + 78.8) MB = 1.2205 ms
    zero1 = ddp.model_copy(update={"zero_stage": 1, "engine": "deepspeed"})
    assert speed_comm.communication_seconds(spec, zero1, 8, 100.0, 150.0, gpu, eff) == pytest.approx(
        7 / 8 * (124_439_808 + 39_383_808) * 2 / 234.89e9, rel=rounding)


def test_fp16_loss_scaling_unscales_every_gradient_before_the_step():
    spec = resolve_model("openai-community/gpt2").spec
    gpu = lookup_gpu("V100-16GB")
    eff = efficiency(gpu.name)
    bf16 = Config(micro_batch=1, grad_accum=1, world_size=1, precision="bf16-mixed", checkpointing="none",
                  zero_stage=0, offload="none")
    fp16 = bf16.model_copy(update={"precision": "fp16-mixed"})
    def step(cfg):
        return speed_optim.optimizer_seconds(spec, cfg, "adamw", gpu, eff, 1)

    extra = step(fp16) - step(bf16)
    # torch's unscale (aten/src/ATen/native/cuda/AmpKernels.cu `_amp_foreach_non_finite_check_and_unscale_cuda_`)
    # reads and writes each fp32 gradient of GPT-2's 124,439,808 parameters: 995.5 MB at the V100's measured 809
    # GB/s (RRZE-HPC/gpu-benches gpu-stream/v100.txt) = 1.2305 ms. efficiency.json stores 809/900 as 0.899:
    # rounding to three digits, 0.06%
    assert extra == pytest.approx(124_439_808 * 2 * 4 / 809e9, rel=0.0005 / 0.899)


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


def test_how_adam_runs_sets_the_bytes_it_streams_and_what_the_host_issues():
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
    # Worked by hand for BERT-large's 335,174,458 parameters in 394 tensors on a V100: HBM at the measured 809 GB/s
    # (RRZE-HPC/gpu-benches gpu-stream/v100.txt), a queued kernel's GPU-side cost 2.525 us (gpu-small-kernels,
    # mean of A100 2.62 and H200 2.43), a Python-issued kernel 8 us of host (flagos-ai/Torch-FL PR #27, A100
    # add[512^2] cuda_sub), a Python scalar op 1.3728 us (the lent H100's host, gpu_mechanisms-H100-80GB-2026-11-22).
    # Tolerances: efficiency.json's rounding of these (0.899 for 809/900: 0.06%; 2.5 for 2.525, to 0.1 us: up to 2%;
    # 1.4: 3.64%), weighted by each one's share of the difference.
    assert (n, tensors, math.ceil(n / (65536 * 320))) == (335_174_458, 394, 16)  # MultiTensorApply.cuh: kChunkSize
    # x depth_to_max_blocks elements per multi-tensor launch
    # 21 fp32 accesses per parameter instead of the fused kernel's 7, 8 multi-tensor ops of 16 launches instead of
    # 2: 14 x 4 x 335,174,458 B / 809 GB/s + 96 x 2.525 us = 23.202 + 0.242 ms
    assert foreach.gpu_s - fused.gpu_s == pytest.approx(14 * 4 * 335_174_458 / 809e9 + 96 * 2.525e-6, rel=1e-3)
    # the Python loop launches 8 kernels per tensor, not 8 x 16 multi-tensor launches: (3152 - 128) x 2.525 us
    assert loop.gpu_s - foreach.gpu_s == pytest.approx(3024 * 2.525e-6, rel=0.05 / 2.525)
    # ... each dispatched by the host, with 2 host ops on its step counter: 3152 x 8 us + 788 x 1.3728 us = 26.298 ms
    assert loop.cpu_s == pytest.approx(3152 * 8e-6 + 788 * 1.3728e-6, rel=VIEW_ROUNDING * 1.08 / 26.3)
    assert fused.cpu_s < foreach.cpu_s < loop.cpu_s
    assert speed_optim.optimizer_seconds(spec, cfg, "adamw", gpu, eff, 1, "for-loop") == max(loop.gpu_s, loop.cpu_s)
    # DeepSpeed steps with its own FusedAdam whatever torch would run; SGD has no Adam step to vary
    ds = cfg.model_copy(update={"precision": "bf16-mixed", "zero_stage": 1, "engine": "deepspeed"})
    assert speed_optim.optimizer_step(spec, ds, "adamw", gpu, eff, 1, "for-loop") == speed_optim.optimizer_step(spec, ds, "adamw", gpu,
                                                                                           eff, 1)
    assert speed_optim.optimizer_step(spec, cfg, "sgd", gpu, eff, 1, "for-loop") == speed_optim.optimizer_step(spec, cfg, "sgd", gpu,
                                                                                          eff, 1)


def test_adafactors_python_loop_costs_the_host_its_kernels_per_matrix_and_per_vector():
    from planner.vocab import OPTIMIZER_STEP

    spec = resolve_model("google-bert/bert-large-uncased").spec
    gpu = lookup_gpu("A100-80GB")
    eff = efficiency(gpu.name)
    cfg = Config(micro_batch=4, grad_accum=1, world_size=1, precision="bf16-mixed", checkpointing="none",
                 zero_stage=0, offload="none")
    matrices, vectors = speed_optim.trainable_tensors(spec)
    program = OPTIMIZER_STEP["adafactor"]
    step = speed_optim.optimizer_step(spec, cfg, "adafactor", gpu, eff, 1)
    # BERT-large's 148 matrices and 246 vectors (24 blocks of 6 + 3 embedding tables + the MLM head's dense; 24
    # blocks of 10 + 6), at the kernels Adafactor runs for each (counted from it above)
    assert (matrices, vectors, program.matrix_kernels, program.vector_kernels) == (148, 246, 24, 16)
    # 7,488 kernels from Python at 8 us of host each (flagos-ai/Torch-FL PR #27, A100 add[512^2] cuda_sub) = 59.9 ms
    assert step.cpu_s == pytest.approx(7488 * 8e-6, rel=1e-12)
    assert step.cpu_s > step.gpu_s  # the host binds
    # weights 3, gradients 2, temporaries 16, clipping 2 fp32 accesses per parameter: 92 B x 335,174,458 at the
    # A100-80GB's measured 1737 GB/s (RRZE-HPC/gpu-benches gpu-stream/a100_80.txt), and 7,488 queued kernels at
    # its measured 2.62 us (gpu-small-kernels/a100_80.txt) = 17.753 + 19.619 ms. Tolerance: 1737/2039 stored as
    # 0.852, rounding to three digits
    assert step.gpu_s == pytest.approx(92 * 335_174_458 / 1737e9 + 7488 * 2.62e-6, rel=0.0005 / 0.852)
    # an optimizer whose step no table counts (bitsandbytes') keeps the bytes-only estimate, with no host time
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
    mle = folds["github:stas00/ml-engineering"]
    assert mle.overrides["inductor.compiled_device_residual"] == 1.0
    assert mle.efficiency["efficiency:H200-141GB:attention"].key == "efficiency:H100-80GB:attention"
    assert "inductor.compile_seconds_per_op" in mle.dropped


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
