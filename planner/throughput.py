"""Step-time model: compute at an efficiency that grows with the matrices' size, communication over the
links that carry it, offload over PCIe, the optimizer step amortised over gradient accumulation.

Every constant is named with where it comes from. The efficiency curve is fitted to published measured
throughput (shared/data/throughput_calibration.json; `benchmarks/throughput_accuracy.py` reports how well
it reproduces them). Those rows come from optimised stacks (fused kernels, FlashAttention, FSDP); HF model
code runs below them, which `HF_CODE_FACTOR` accounts for.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from planner.config import Config
from planner.hardware import GPU
from planner.models.spec import ModelSpec
from planner.vocab import ATTENTION, CHECKPOINTING, FP32, OFFLOAD, PRECISION, SDPA

# --- compute efficiency: achieved / peak tensor FLOP/s for a dense transformer step
#: Ceiling of model-FLOPs utilisation at large matrices, falling with the GPU's peak FLOPs per byte of HBM
#: bandwidth: the memory-bound part of a step (norms, activations, softmax, optimizer) takes a larger share
#: on GPUs whose matmuls got faster than their memory. ceiling = 1 / (A + B * FLOP/byte). Fitted to
#: llm-foundry's MPT sweeps (A100: 153 FLOP/B -> ~0.70; H100 SXM: 295 FLOP/B -> ~0.50) by
#: benchmarks/throughput_accuracy.py --fit.
EFFICIENCY_CEILING_A = 0.80
EFFICIENCY_CEILING_B = 0.0040
#: Tokens per micro-batch at which efficiency reaches half its ceiling (fitted; the calibration rows all have
#: >= 3k tokens per micro-batch, so it is loosely determined: x1.25 either way costs < 0.005 in the fit).
EFFICIENCY_HALF_TOKENS = 790
#: Hidden size at which efficiency reaches half its ceiling: narrow models have small matmuls (fitted).
EFFICIENCY_HALF_HIDDEN = 300
#: Kernel launches per block and micro-step in HF model code (~30 forward, ~60 backward) x ~6 us each: a
#: fixed cost per micro-step that makes tiny micro-batches slow however small their FLOPs.
LAUNCH_OVERHEAD_S_PER_BLOCK = 90 * 6e-6
#: HF transformers model code vs. the optimised stacks of the calibration data (unfused norms, rotary
#: and loss; no FlashAttention-2 by default).
HF_CODE_FACTOR = 0.80
#: Eager attention materialises the s x s scores: its attention FLOPs run memory-bound at this fraction.
EAGER_ATTENTION_EFFICIENCY = 0.25
#: fp32 matmuls run on the plain FP32 pipes, which kernels keep busier than tensor cores (fitted on the
#: six fp32 rows of the calibration data, NVIDIA's BERT; weakly determined).
FP32_EFFICIENCY_BOOST = 1.1

# --- communication
#: Per-GPU NIC bandwidth, GB/s per direction: one 200 Gb/s HDR InfiniBand NIC per GPU (DGX A100);
#: DGX H100 has 400 Gb/s NDR per GPU. NCCL runs one ring per NIC, so a collective spanning nodes crosses
#: them at the node's aggregate NIC bandwidth (capped by the intra-node link).
INTER_NODE_GBps = {"default": 25.0, "H100-80GB": 50.0, "H200-141GB": 50.0, "B200-192GB": 50.0}
#: Achieved fraction of link bandwidth for large NCCL collectives (nccl-tests bus bandwidth vs. link peak).
LINK_EFFICIENCY = 0.75
#: Share of gradient communication hidden behind the backward pass (DDP buckets, DeepSpeed overlap_comm);
#: the calibration fit prefers full overlap (0.9-1.0) for FSDP's prefetching.
COMM_OVERLAP = 0.9
#: Host link achieved fraction (pinned-memory copies reach ~80% of PCIe peak).
PCIE_EFFICIENCY = 0.8
#: DeepSpeed CPUAdam throughput, parameters per second per node (ZeRO-Offload paper, arXiv 2101.06840,
#: Fig. 7: ~1.5B params/s on a dual-socket host with AVX512); divided among the node's ranks.
CPU_ADAM_PARAMS_PER_S = 1.5e9
#: Bytes a fused Adam step reads and writes per parameter on the GPU: param 4 + grad 4 + m 4 + v 4 read,
#: param 4 + m 4 + v 4 written (+2 for the 16-bit copy under mixed precision).
ADAM_STEP_BYTES_PER_PARAM = 30


class StepParts(BaseModel):
    """Seconds per optimizer step, by what they are spent on."""

    model_config = ConfigDict(frozen=True)

    compute: float = 0.0
    optimizer: float = 0.0
    communication: float = 0.0
    offload: float = 0.0


@dataclass(frozen=True)
class Throughput:
    tokens_per_s: float
    samples_per_s: float
    mfu: float
    step_time_s: float
    parts: StepParts


def matmul_parameters(spec: ModelSpec) -> int:
    """Parameters that take part in matmuls per token: all but the embedding lookups, plus the LM head
    when it shares the embedding; for MoE only the experts a token is routed to."""
    params = spec.parameters - spec.embedding_parameters
    if spec.tied_embeddings and spec.vocab and spec.has_lm_head:
        params += spec.vocab * spec.hidden
    if spec.num_experts > 1:
        per_expert = (3 if spec.gated_mlp else 2) * spec.hidden * spec.ffn
        params -= spec.layers * per_expert * (spec.num_experts - spec.experts_per_token)
    return max(params, 1)


def flops_per_token(spec: ModelSpec, seq_len: int) -> tuple[float, float]:
    """Training FLOPs per token as (dense, attention): 6N (fwd 2N + bwd 4N) and 12·L·h·s for the attention
    score and value matmuls (PaLM appendix B; llm-foundry counts MFU the same way)."""
    return 6.0 * matmul_parameters(spec), 12.0 * spec.layers * spec.hidden * seq_len


def efficiency_ceiling(gpu: GPU, precision: str) -> float:
    flops_per_byte = gpu.peak_tflops(precision) * 1e12 / (gpu.hbm_bandwidth_GBps * 1e9)
    return 1.0 / (EFFICIENCY_CEILING_A + EFFICIENCY_CEILING_B * flops_per_byte)


def compute_efficiency(spec: ModelSpec, gpu: GPU, micro_batch: int, seq_len: int, precision: str) -> float:
    tokens = micro_batch * seq_len
    fp32 = PRECISION[precision].compute == PRECISION[FP32].compute
    ceiling = efficiency_ceiling(gpu, precision)
    eff = ceiling * tokens / (tokens + EFFICIENCY_HALF_TOKENS) * spec.hidden / (spec.hidden + EFFICIENCY_HALF_HIDDEN)
    if fp32:
        eff = min(0.9, eff * FP32_EFFICIENCY_BOOST)
    return eff * HF_CODE_FACTOR


def inter_node_bandwidth(gpu: GPU, per_node: int) -> float:
    nic = INTER_NODE_GBps.get(gpu.name, INTER_NODE_GBps["default"])
    return min(gpu.intra_node_bandwidth_GBps, nic * max(1, per_node))


def _collective_seconds(bytes_: float, world: int, per_node: int, gpu: GPU) -> float:
    """Ring all-gather or reduce-scatter of `bytes_` (full size) over `world` ranks: (W-1)/W · bytes through
    the slowest link."""
    if world <= 1:
        return 0.0
    link = gpu.intra_node_bandwidth_GBps if world <= per_node else inter_node_bandwidth(gpu, per_node)
    return (world - 1) / world * bytes_ / (link * 1e9 * LINK_EFFICIENCY)


def recompute_factor(checkpointing: str) -> float:
    """Extra compute of activation checkpointing: full recomputes the forward (4/3 of fwd+bwd, Korthikanti et al.
    2022; llm-foundry's HFU/MFU = 55.0/41.25 = 1.33 for full checkpointing agrees). Selective (torchtitan's per-op
    policy) recomputes every second forward matmul and the elementwise ops: about half the forward again."""
    info = CHECKPOINTING[checkpointing]
    if not info.enabled:
        return 1.0
    return 7.0 / 6.0 if info.per_op_policy else 4.0 / 3.0


def step_time(spec: ModelSpec, gpu: GPU, cfg: Config, *, seq_len: int, gpus_per_node: int,
              attention: str = SDPA) -> Throughput:
    micro_batch, grad_accum, world_size, zero_stage = cfg.micro_batch, cfg.grad_accum, cfg.world_size, cfg.zero_stage
    dense, attn = flops_per_token(spec, seq_len)
    eff = compute_efficiency(spec, gpu, micro_batch, seq_len, cfg.precision)
    peak = gpu.peak_tflops(cfg.precision) * 1e12
    attn_eff = eff * (EAGER_ATTENTION_EFFICIENCY if ATTENTION[attention].saves_scores else 1.0)
    tokens_micro = micro_batch * seq_len
    micro_compute = (tokens_micro * (dense / (peak * eff) + attn / (peak * attn_eff)) * recompute_factor(cfg.checkpointing)
                     + spec.layers * LAUNCH_OVERHEAD_S_PER_BLOCK)
    compute = micro_compute * grad_accum

    params, trainable = spec.parameters, spec.trainable_parameters
    grad_width = cfg.grad_bytes()
    shard = world_size if cfg.sharded else 1
    optimizer = trainable / shard * ADAM_STEP_BYTES_PER_PARAM / (gpu.hbm_bandwidth_GBps * 1e9)

    backward = micro_compute * 2 / 3
    comm_once = 2 * _collective_seconds(trainable * grad_width, world_size, gpus_per_node, gpu)  # all-reduce
    if zero_stage == 3:  # gather params in forward and backward, reduce-scatter grads, every micro-step
        per_micro = 3 * _collective_seconds(params * 2, world_size, gpus_per_node, gpu)
        comm = grad_accum * max(0.0, per_micro - COMM_OVERLAP * micro_compute)
    elif zero_stage == 2:  # reduce-scatter every micro-step (ipg buckets), all-gather params once
        rs = _collective_seconds(trainable * grad_width, world_size, gpus_per_node, gpu)
        comm = grad_accum * max(0.0, rs - COMM_OVERLAP * backward) + rs
    else:  # DDP / ZeRO-1: one all-reduce (or reduce-scatter + all-gather) per optimizer step
        comm = max(0.0, comm_once - COMM_OVERLAP * backward)

    offload_s = 0.0
    off = OFFLOAD[cfg.offload]
    if off.optimizer_on_cpu:
        pcie = gpu.host_bandwidth_GBps * 1e9 * PCIE_EFFICIENCY
        ranks_per_node = min(world_size, gpus_per_node)
        cpu_adam = trainable / shard / (CPU_ADAM_PARAMS_PER_S / ranks_per_node)
        traffic = (trainable / shard) * 2 * 2 / pcie          # 16-bit grads down, 16-bit params up
        optimizer = cpu_adam + traffic
        if off.params_on_cpu:                                  # params fetched for fwd and bwd, each micro-step
            offload_s = grad_accum * 2 * (params / shard) * 2 / pcie
    total = compute + optimizer + comm + offload_s
    tokens = micro_batch * grad_accum * world_size * seq_len
    model_flops = (dense + attn) * tokens
    return Throughput(
        tokens_per_s=tokens / total, samples_per_s=micro_batch * grad_accum * world_size / total,
        mfu=model_flops / total / (world_size * peak), step_time_s=total,
        parts=StepParts(compute=compute, optimizer=optimizer, communication=comm, offload=offload_s),
    )
