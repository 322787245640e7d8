"""Step time from the traced program: a per-operation roofline with overheads.

Every op of the traced forward and backward (recomputation included) has a cost (planner/memory/profile.py):
GEMMs by shape, fused attention kernels by FLOPs and bytes, every other kernel by the bytes it moves. Each runs at
max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth), achievable figures being the GPU's own measured ones
(planner/hardware/efficiency.json): a large GEMM's fraction of peak, scaled down for small shapes by wave
quantization over the GPU's SMs (NVIDIA's "Matrix Multiplication Background" guide, sections 3.1-3.2) and by the
pipeline fill of a short K loop; HBM's streaming fraction; fused attention's fraction. Eager PyTorch dispatches
every op from the CPU: the micro-step takes the longer of the GPU's kernel time and the CPU's dispatch time (the
CPU runs ahead asynchronously, so the shorter one hides). The step adds the optimizer (the bytes and kernels of the
implementation that runs it, fused, foreach or a Python loop, against the host's time issuing them), gradient
clipping, communication the backward does not hide, offload traffic and CPU Adam.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from pydantic import BaseModel, ConfigDict

from planner.config import Config
from planner.hardware import GPU
from planner.hardware.efficiency_data import Efficiency
from planner.memory.compiled import BACKWARD, COMPILED_DEVICE_RESIDUAL, FORWARD, CompileEffect
from planner.memory.estimate import DDP_BUCKET_CAP_BYTES, DeepSpeedBuckets
from planner.memory.profile import (
    ENGINE_KERNELS, ENGINE_VIEWS, HALF, MODULE_CALLS, POLICY_OPS, PY_KERNELS, PY_VIEWS, Profile,
)
from planner.models.spec import ModelSpec
from planner.vocab import (
    ADAM_STEP, CHECKPOINTING, DEEPSPEED, FP32_COMPUTE, FUSED_STEP, OFFLOAD, OPTIMIZER, OPTIMIZER_STEP, PRECISION, TORCH,
    AdamStep,
)

#: A GEMM whose K loop is this long reaches half of its large-K efficiency: each tile streams K/64 slices through
#: its pipeline, whose fill and drain cost a few slices. Chosen against XLA's measured H100 GEMM table
#: (efficiency.json, H100-80GB shape_table_xla_sm90: 4096x4096 at K 256/512/1024/4096 run 392/543/677/783 TFLOPS),
#: a GEMM micro-benchmark, not an end-to-end row; tests/test_throughput.py checks the shape model against it.
K_HALF = 128
#: Smaller cuBLAS tiles waste less of a small GEMM but run below the largest tiles' rate: efficiency taken as
#: (tile area / 256x128) ** TILE_EXPONENT (same table: 256x4096x4096 reaches 412 TFLOPS only through small tiles).
TILE_EXPONENT = 0.25
#: What any GEMM kernel takes however small (prologue, K-loop fill, epilogue): the same table's smallest GEMM,
#: 256x256x256, runs at 6.45 TFLOPS, i.e. 5.2 us.
GEMM_LATENCY_S = 5.0e-6
#: Bytes an optimizer whose step is not counted (bitsandbytes' 8-bit AdamW, Lion, LAMB) streams per trainable
#: parameter per state byte width, beyond the weight and gradient it reads: it reads and writes each state once.
#: The others count their accesses per program (`vocab.ADAM_STEP`, `vocab.OPTIMIZER_STEP`).
STATE_PASSES = 2
#: the torch.optim classes (`vocab.OPTIMIZER` torch_class) whose step `vocab.ADAM_STEP` describes
ADAM_CLASSES = ("Adam", "AdamW")
#: DeepSpeed's CPU Adam, parameters per second per node (ZeRO-Offload, arXiv 2101.06840, Fig. 7: ~1.5B params/s on a
#: dual-socket host with AVX512; DeepSpeed PR #735: an 11.6B-parameter step in 8.2 s, 1.4B/s), shared by the node's
#: ranks. Newer hosts with more cores step faster; a probe measures the user's.
CPU_ADAM_PARAMS_PER_S = 1.5e9
#: DDP's first gradient bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, 1 MiB); the others are
#: estimate.DDP_BUCKET_CAP_BYTES. After the first iteration DDP's reducer rebuilds its buckets in the order the
#: backward produced the gradients (torch/nn/parallel/distributed.py `_ddp_init_helper`: "bucket rebuild bucketizes
#: parameters based on its real execution order in backward graph"), with these two caps.
DDP_FIRST_BUCKET_BYTES = 2**20


class StepParts(BaseModel):
    """Seconds per optimizer step, by what they are spent on."""

    model_config = ConfigDict(frozen=True)

    compute: float = 0.0
    optimizer: float = 0.0
    communication: float = 0.0
    offload: float = 0.0
    #: torch.compile's first-step compile time spread over the run's optimizer steps (0: eager, or run length unknown)
    compile: float = 0.0
    #: that first step's compile time itself, paid once per run (not part of `total`)
    compile_once: float = 0.0
    #: one micro-step's GPU kernel time and CPU dispatch time as modelled, before any probe calibration (`compute`
    #: takes the longer per micro-step; not part of `total`)
    micro_gpu: float = 0.0
    micro_cpu: float = 0.0

    def bound(self) -> str | None:
        """What binds a micro-step as modelled: the GPU's kernels or the CPU's dispatch of them (None: not
        modelled, as for a measured step)."""
        if not (self.micro_gpu or self.micro_cpu):
            return None
        return "CPU-bound" if self.micro_cpu > self.micro_gpu else "GPU-bound"

    @property
    def total(self) -> float:
        return self.compute + self.optimizer + self.communication + self.offload + self.compile


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
    params = spec.active_parameters - spec.embedding_parameters
    if spec.tied_embeddings and spec.vocab and spec.has_lm_head:
        params += spec.vocab * spec.hidden
    if spec.num_experts > 1 and not spec.expert_parameters:  # experts not found by name: from the config's shapes
        per_expert = (3 if spec.gated_mlp else 2) * spec.hidden * spec.ffn
        params -= spec.layers * per_expert * (spec.num_experts - spec.experts_per_token)
    return max(params, 1)


def flops_per_token(spec: ModelSpec, seq_len: int) -> tuple[float, float]:
    """Model FLOPs per token as (dense, attention), for MFU: 6N and 12·L·h·s (PaLM appendix B). Frozen weights
    (adapters training) skip their weight-gradient matmuls: 4 FLOPs per frozen matmul parameter, not 6."""
    matmul = matmul_parameters(spec)
    frozen = max(0, matmul - spec.trainable_parameters)
    return 6.0 * matmul - 2.0 * frozen, 12.0 * spec.layers * spec.hidden * seq_len


#: QLoRA dequantises each 4-bit weight to the compute dtype before its matmul, in the forward and again for the
#: backward's input gradient (bitsandbytes/autograd/_functions.py `MatMul4Bit.forward` / `.backward`:
#: `F.dequantize_4bit(B, quant_state)` then a 16-bit matmul); a checkpointed forward dequantises once more.
DEQUANTIZE_PASSES = 2


def dequantize_seconds(spec: ModelSpec, cfg: Config, gpu: GPU, eff: Efficiency) -> float:
    """One micro-step's 4-bit dequantisation: each pass reads the packed weights and writes a 16-bit copy."""
    if not spec.quantized_parameters:
        return 0.0
    passes = DEQUANTIZE_PASSES + int(CHECKPOINTING[cfg.checkpointing].enabled)
    return passes * (spec.quantized_bytes + 2 * spec.quantized_parameters) / bandwidth(gpu, eff)


def compute_dtype(precision: str, half: bool) -> str:
    """The GEMM dtype (an efficiency.json key) of a traced op: 16-bit ops run in the precision's 16-bit dtype,
    fp32 ops in fp32 (TF32 off, torch's default), or on TF32 tensor cores under the tf32 precision."""
    info = PRECISION[precision]
    if info.tf32:
        return info.compute
    return info.compute if half and info.compute != FP32_COMPUTE else FP32_COMPUTE


def gemm_efficiency(b: float, m: float, n: float, k: float, eff: Efficiency) -> float:
    """Fraction of a large GEMM's rate this shape reaches: the best tile's wave quantization times tile size, and
    the K loop's pipeline fill."""
    best = 0.0
    for tm, tn in eff.tiles:
        tiles = b * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / eff.sm_count)
        size = (tm * tn / (256 * 128)) ** TILE_EXPONENT
        best = max(best, tiles / (waves * eff.sm_count) * size)
    return best * k / (k + K_HALF)


def gemm_fraction(m, n, k, dtype: str, eff: Efficiency, elem_bytes: int) -> float:
    """A large GEMM's fraction of peak. A 16-bit GEMM with a dimension that is not a multiple of 8 elements (16
    bytes: NVIDIA's Matrix Multiplication Background guide, 'Tensor Core Requirements') runs cuBLAS's narrower-load
    kernels, at the rate measured for their alignment (efficiency.json, benchmarks/derive_misaligned.py): an odd
    dimension the align1 kernels of GPT-2's 50257-token LM head, an even one the align2 kernels of BERT's 30522."""
    alignment = min(_alignment(int(round(d))) for d in (m, n, k))
    if elem_bytes == 2 and alignment < TENSOR_CORE_ALIGNMENT:
        return eff.misaligned if alignment == 1 else eff.misaligned_align2
    return eff.matmul[dtype]


#: Elements a 16-bit GEMM dimension must be a multiple of for cuBLAS's full-width tensor-core kernels.
TENSOR_CORE_ALIGNMENT = 8


def _alignment(dim: int) -> int:
    """The largest power of two up to TENSOR_CORE_ALIGNMENT that divides `dim`."""
    alignment = 1
    while alignment < TENSOR_CORE_ALIGNMENT and dim % (2 * alignment) == 0:
        alignment *= 2
    return alignment


def gemm_seconds(b, m, n, k, dtype: str, gpu: GPU, eff: Efficiency, elem_bytes: int) -> float:
    fraction = gemm_fraction(m, n, k, dtype, eff, elem_bytes)
    peak = gpu.peak_tflops_for(dtype) * 1e12 * fraction * gemm_efficiency(b, m, n, k, eff)
    moved = (b * (m * k + k * n + m * n)) * elem_bytes
    return max(2.0 * b * m * n * k / peak, moved / bandwidth(gpu, eff)) + GEMM_LATENCY_S


def bandwidth(gpu: GPU, eff: Efficiency) -> float:
    return gpu.hbm_bandwidth_GBps * 1e9 * eff.hbm


def host_link(gpu: GPU, eff: Efficiency) -> float:
    """Bytes/s pinned copies achieve between host and GPU."""
    return gpu.host_bandwidth_GBps * 1e9 * eff.pcie


@dataclass(frozen=True)
class MicroStep:
    gpu_s: float
    cpu_s: float

    @property
    def seconds(self) -> float:
        """The CPU dispatches asynchronously: the longer of the two is the micro-step."""
        return max(self.gpu_s, self.cpu_s)


def cpu_seconds(profile: Profile, eff: Efficiency) -> float:
    """The CPU's side of a micro-step: every kernel launched (from Python or the autograd engine), every view op
    (Python's cost more: argument parsing), every nn.Module call, every op a selective-checkpointing policy's Python
    dispatch mode handles."""
    d = profile.dispatch
    us = (d.get(PY_KERNELS, 0.0) * eff.dispatch_us + d.get(ENGINE_KERNELS, 0.0) * eff.engine_dispatch_us
          + d.get(PY_VIEWS, 0.0) * eff.python_op_us + d.get(ENGINE_VIEWS, 0.0) * eff.cpp_op_us
          + d.get(MODULE_CALLS, 0.0) * eff.module_call_us + d.get(POLICY_OPS, 0.0) * eff.checkpoint_policy_op_us)
    return us * 1e-6


@dataclass(frozen=True)
class DeviceTime:
    """A micro-step's GPU kernel time by kind: GEMMs, fused attention kernels, every other (memory-bound) kernel."""
    gemm_s: float
    attention_s: float
    memory_s: float

    @property
    def seconds(self) -> float:
        return self.gemm_s + self.attention_s + self.memory_s


def device_time(profile: Profile, scale: float, precision: str, gpu: GPU, eff: Efficiency, tp: int = 1,
                tp_share: float = 1.0) -> DeviceTime:
    """The GPU's side of `micro_step`, by kind of kernel."""
    gemm_s = attention_s = memory_s = 0.0
    for count, dims, dtype, _phase, scaled in profile.gemms():
        dims = [d * scale if grows else d for d, grows in zip(dims, scaled)]
        cdtype = compute_dtype(precision, dtype == HALF)
        seconds = gemm_seconds(*dims, cdtype, gpu, eff, 2 if cdtype != FP32_COMPUTE else 4)
        gemm_s += count * (seconds if tp == 1 else max(seconds / tp, GEMM_LATENCY_S))
    for key, (fl, scaled, fixed, count) in profile.attention.items():
        peak = gpu.peak_tflops_for(compute_dtype(precision, key.startswith(HALF))) * 1e12 * eff.attention
        moved = scaled * scale + fixed
        attention_s += max(fl * scale / peak / tp, moved / bandwidth(gpu, eff) / tp, count * eff.launch_us * 1e-6)
    for scaled, fixed, count in profile.memory.values():  # streaming time plus each kernel's fixed cost
        memory_s += (scaled * scale + fixed) * tp_share / bandwidth(gpu, eff) + count * eff.launch_us * 1e-6
    return DeviceTime(gemm_s=gemm_s, attention_s=attention_s, memory_s=memory_s)


def micro_step(profile: Profile, scale: float, precision: str, gpu: GPU, eff: Efficiency,
               checkpointed_blocks: int = 0, tp: int = 1, tp_share: float = 1.0) -> MicroStep:
    """Time of one traced micro-step, `scale` times the traced micro-batch's tokens. The profile was traced with
    the configuration's own program (weights' dtype, autocast), so its ops carry their real dtypes; 16-bit ops
    run at the precision's 16-bit peak. Each of `checkpointed_blocks` adds torch.utils.checkpoint's host
    bookkeeping beyond the recomputed ops (`Efficiency.checkpoint_block_us`). With `tp`-way tensor parallelism every
    GEMM and attention kernel does 1/tp of the work on each GPU and the other kernels move `tp_share` of their bytes
    (the replicated norms and residual stay whole); the host still issues every kernel. A memory-bound kernel takes
    its streaming time plus its fixed cost (`Efficiency.launch_us`: launch, ramp-up and tail, the per-kernel floor of
    a queue of tiny kernels), the latency-bandwidth form. The larger of the two, which torchao's roofline takes
    (torchao/testing/training/roofline_utils.py `get_tensor_memory_traffic_ovhd_s`), leaves the mid-sized kernels
    of small HF steps without the cost they pay on top of their bytes."""
    gpu_s = device_time(profile, scale, precision, gpu, eff, tp, tp_share).seconds
    cpu_s = cpu_seconds(profile, eff) + checkpointed_blocks * eff.checkpoint_block_us * 1e-6
    return MicroStep(gpu_s=gpu_s, cpu_s=cpu_s)


#: Elements one multi-tensor kernel launch covers at most: 320 blocks of 65536-element chunks
#: (aten/src/ATen/native/cuda/MultiTensorApply.cuh `kChunkSize`, `depth_to_max_blocks`; CUDA 13 builds allow 7x more).
FOREACH_LAUNCH_ELEMENTS = 65536 * 320


def trainable_tensors(spec: ModelSpec) -> tuple[int, int]:
    """The matrices (2-D or more) and vectors among the parameter tensors the optimizer steps; where the shapes are
    unknown, one matrix."""
    ndims = spec.tensor_ndims or (2,) * len(spec.tensor_sizes)
    trained = [dims for size, dims in zip(spec.tensor_sizes, ndims) if size > 0]
    if not trained:
        return 1, 0
    vectors = sum(1 for dims in trained if dims <= 1)
    return len(trained) - vectors, vectors


def optimizer_step(spec: ModelSpec, cfg: Config, optimizer: str, gpu: GPU, eff: Efficiency, per_node: int,
                   adam_step: AdamStep = FUSED_STEP) -> MicroStep:
    """The optimizer step, gradient clipping and fp16's gradient unscaling included: the bytes they stream through
    HBM and the kernels they launch (or CPU Adam under offload, with the gradients down and the weights up over
    PCIe), beside what the host spends issuing them. The step runs the program `vocab.ADAM_STEP` (for Adam:
    `adam_step` under the torch engine, the emitted files' fused kernel by default; torch's default for CUDA
    tensors is foreach; DeepSpeed always runs its FusedAdam) or `vocab.OPTIMIZER_STEP` describes; an optimizer
    neither counts streams each state once each way, with no host cost."""
    trainable = spec.trainable_parameters / (cfg.world_size if cfg.sharded else 1)
    info = OPTIMIZER[optimizer]
    if OFFLOAD[cfg.offload].optimizer_on_cpu:
        ranks = min(cfg.world_size, per_node)
        return MicroStep(gpu_s=trainable / (CPU_ADAM_PARAMS_PER_S / ranks)
                         + trainable * 2 * cfg.weight_bytes() / host_link(gpu, eff), cpu_s=0.0)
    state = cfg.state_width() if info.follows_weights else 1
    states = info.state_bytes // 4 if info.follows_weights else info.state_bytes
    program = ADAM_STEP[FUSED_STEP if cfg.engine == DEEPSPEED else adam_step] \
        if info.torch_class in ADAM_CLASSES else OPTIMIZER_STEP.get(optimizer)
    launches = cpu_us = 0.0
    if program is not None:
        per_param = program.weight * cfg.weight_bytes() + program.grad * cfg.grad_bytes() + program.state * state
        matrices, vectors = trainable_tensors(spec)
        looped = program.matrix_kernels * matrices + program.vector_kernels * vectors
        launches = looped + program.foreach_ops * math.ceil(trainable / FOREACH_LAUNCH_ELEMENTS)
        cpu_us = ((looped + program.foreach_ops) * eff.dispatch_us
                  + program.host_ops_per_tensor * (matrices + vectors) * eff.python_op_us)
    else:
        per_param = 2 * cfg.weight_bytes() + cfg.grad_bytes() + STATE_PASSES * states * state
    per_param += info.norm_passes * cfg.weight_bytes()  # LAMB: the weights' and the update's norms per layer
    per_param += 2 * cfg.grad_bytes()  # clip_grad_norm_: the norm reads the gradients, the scale rewrites them
    if PRECISION[cfg.precision].loss_scaling:  # unscaling reads and rewrites every gradient, checking for inf/NaN
        per_param += 2 * cfg.grad_bytes()  # (torch/amp/grad_scaler.py `_amp_foreach_non_finite_check_and_unscale_`)
    if cfg.engine == DEEPSPEED:  # the fp32 master steps, then is copied into the 16-bit weights
        per_param += 2 * cfg.master_bytes() + cfg.weight_bytes()
    return MicroStep(gpu_s=trainable * per_param / bandwidth(gpu, eff) + launches * eff.launch_us * 1e-6,
                     cpu_s=cpu_us * 1e-6)


def optimizer_seconds(spec: ModelSpec, cfg: Config, optimizer: str, gpu: GPU, eff: Efficiency, per_node: int,
                      adam_step: AdamStep = FUSED_STEP) -> float:
    """The optimizer step's time (`optimizer_step`): the host issues it while the GPU runs it, the longer wins."""
    return optimizer_step(spec, cfg, optimizer, gpu, eff, per_node, adam_step).seconds


def ring_seconds(nbytes: float, world: int, per_node: int, gpu: GPU, eff: Efficiency) -> float:
    """All-gather or reduce-scatter of `nbytes` (the full size) over `world` ranks, `per_node` of them on each node.

    Every rank passes (W-1)/W of it over its node's NVLink. Across k nodes, each node must take in the (k-1)/k of it
    that the others hold, through the NICs of its `per_node` ranks (one per GPU), each at the fraction of its rate
    NCCL reaches; the collective takes the longer of the two. This is how efficiency.json's per-GPU inter-node figure
    was derived from NCCL's measured bus bandwidth (per-GPU rate = busbw x (k-1)/(n-1), stas00/ml-engineering
    network/README.md), so it reproduces that measurement: charging each rank's NIC with the whole (W-1)/W, as if
    every ring hop crossed nodes, made a 2-node job's collectives about the node's GPU count times too slow."""
    if world <= 1:
        return 0.0
    intra = (world - 1) / world * nbytes / (gpu.intra_node_bandwidth_GBps * 1e9 * eff.collective)
    nodes = -(-world // max(1, per_node))
    if nodes <= 1:
        return intra
    inter = (nodes - 1) / nodes * nbytes / (per_node * eff.nic_GBps * eff.inter_node_collective * 1e9)
    return max(intra, inter)


@dataclass(frozen=True)
class Bucket:
    ready: float    # share of the backward done when its last gradient is ready
    nbytes: float


def gradient_order(spec: ModelSpec) -> list[tuple[float, int]]:
    """(backward work, trainable elements) of each parameter tensor, in the order the backward finishes them: the
    model's order reversed (the forward's last layer is the backward's first), a tensor's work its element count (its
    matmul's two backward GEMMs cost 4 FLOPs per element and token; norms and biases next to nothing). The embedding
    tables that lead the model's order finish last at no GEMM cost (an index-add), a tied LM head's matmul being the
    backward's first work although its gradient lands on the embedding table."""
    return list(_spec_order(spec))


def _spec_order(spec: ModelSpec) -> tuple[tuple[float, int], ...]:
    head = spec.vocab * spec.hidden if spec.tied_embeddings and not spec.num_labels else 0
    return _order(spec.tensor_sizes or (spec.trainable_parameters,), spec.embedding_parameters, head)


@lru_cache(maxsize=64)
def _order(sizes: tuple[int, ...], embedding: int, tied_head: int) -> tuple[tuple[float, int], ...]:
    tables = acc = 0
    while tables < len(sizes) and acc + abs(sizes[tables]) <= embedding:
        acc += abs(sizes[tables])
        tables += 1
    order = [(float(tied_head), 0)] if tied_head and tables else []
    order += [(float(abs(n)), max(n, 0)) for n in reversed(sizes[tables:])]
    return tuple(order + [(0.0, max(n, 0)) for n in reversed(sizes[:tables])])


def gradient_buckets(spec: ModelSpec, grad_bytes: float, caps: tuple[float, ...]) -> list[Bucket]:
    """The gradients bucketed as DDP's reducer and DeepSpeed's stage 1/2 reduce buckets fill: in the order they are
    ready, a bucket closing once it holds at least its cap (`caps[0]` for the first bucket, `caps[-1]` for the rest;
    torch/csrc/distributed/c10d/reducer.cpp `compute_bucket_assignment_by_size`)."""
    return list(_buckets(_spec_order(spec), grad_bytes, tuple(caps)))


@lru_cache(maxsize=64)
def _buckets(order: tuple[tuple[float, int], ...], grad_bytes: float, caps: tuple[float, ...]) -> tuple[Bucket, ...]:
    """`gradient_buckets` for one gradient order (the search asks again for every candidate of a model)."""
    total = sum(work for work, _ in order) or 1.0
    out, done, size = [], 0.0, 0.0
    for work, numel in order:
        done += work
        if numel:
            size += numel * grad_bytes
            if size >= caps[min(len(out), len(caps) - 1)]:
                out.append(Bucket(done / total, size))
                size = 0.0
    if size:
        out.append(Bucket(done / total, size))
    return tuple(out)


def exposed_seconds(buckets: list[Bucket], span_s: float, seconds) -> float:
    """One collective per bucket on the communication stream, in order, each starting when its bucket is ready and
    the one before it is done (`seconds(nbytes)` each): how long the last one ends after the backward (`span_s`)."""
    end = 0.0
    for bucket in buckets:
        end = max(end, bucket.ready * span_s) + seconds(bucket.nbytes)
    return max(0.0, end - span_s)


def sharded_exposed_seconds(layers: int, gather_s: float, regather_s: float, reduce_s: float, forward_s: float,
                            backward_s: float) -> float:
    """ZeRO-3 / FSDP, one micro-step of `layers` blocks: each block's weights gathered before its forward
    (`gather_s` per block) and, if resharded after it, again before its backward (`regather_s`), its gradients
    reduce-scattered after its backward (`reduce_s`). A block's gather overlaps the block before it (FSDP's backward
    prefetch and rate-limited forward all-gathers, DeepSpeed's prefetch bucket); the communication stream runs them
    one after another. Exposed: the first gather of each pass, every block's communication beyond its compute
    (`forward_s` and `backward_s` over the blocks), and the last reduce-scatter."""
    blocks = max(1, layers)
    forward = gather_s + (blocks - 1) * max(0.0, gather_s - forward_s / blocks)
    backward_comm = regather_s + reduce_s
    backward = backward_comm + (blocks - 1) * max(0.0, backward_comm - backward_s / blocks)
    return forward + backward


def communication_seconds(spec: ModelSpec, cfg: Config, per_node: int, backward_s: float, micro_s: float, gpu: GPU,
                          eff: Efficiency) -> float:
    """Collectives per optimizer step that the compute does not hide, bucket by bucket against the backward's
    timeline (`gradient_buckets`): DDP all-reduces its buckets in the last micro-step's backward (accumulating
    micro-steps skip the sync); DeepSpeed ZeRO-1 reduce-scatters its reduce buckets in that backward and ZeRO-2 in
    every micro-step's (deepspeed/runtime/zero/stage_1_and_2.py `reduce_ready_partitions_and_remove_grads`), both
    gathering the updated 16-bit weights after the step (`step`: `all_gather_dp_groups`), which nothing overlaps;
    ZeRO-3 / FSDP gather and reduce-scatter block by block (`sharded_exposed_seconds`)."""
    world, n = cfg.data_parallel, cfg.grad_accum  # a tensor-parallel rank reduces its 1/tp over the others
    if world <= 1:
        return 0.0
    # A data-parallel group has per_node / tp ranks on each node (tensor parallelism stays inside a node), so it
    # crosses nodes whenever the job does, however few ranks it has.
    per_node = max(1, per_node // cfg.tensor_parallel)
    grad_bytes = cfg.grad_bytes() / cfg.tensor_parallel
    weights16 = spec.parameters * cfg.weight_bytes() / cfg.tensor_parallel

    def ring(nbytes: float) -> float:
        return ring_seconds(nbytes, world, per_node, gpu, eff)

    if cfg.engine == TORCH:
        buckets = gradient_buckets(spec, grad_bytes, (DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_CAP_BYTES))
        return exposed_seconds(buckets, backward_s, lambda nbytes: 2 * ring(nbytes))
    if cfg.engine == DEEPSPEED and cfg.zero_stage in (1, 2):
        cap = DeepSpeedBuckets.for_hidden(spec.hidden).reduce_bucket_size * grad_bytes
        reduce = exposed_seconds(gradient_buckets(spec, grad_bytes, (cap,)), backward_s, ring)
        return (n if cfg.zero_stage == 2 else 1) * reduce + ring(weights16)
    layers = max(1, spec.layers)
    gather, reduce = ring(weights16) / layers, ring(spec.trainable_parameters * grad_bytes) / layers
    # FSDP2's stage 2 (reshard_after_forward=False) keeps the forward's gathered weights for the backward
    regather = gather if cfg.zero_stage == 3 else 0.0
    return n * sharded_exposed_seconds(layers, gather, regather, reduce, micro_s - backward_s, backward_s)


def offload_seconds(spec: ModelSpec, cfg: Config, gpu: GPU, eff: Efficiency) -> float:
    """Parameters offloaded to the host cross PCIe for the forward and the backward of every micro-step."""
    if not OFFLOAD[cfg.offload].params_on_cpu:
        return 0.0
    return cfg.grad_accum * 2 * spec.parameters / cfg.world_size * cfg.weight_bytes() / host_link(gpu, eff)


def tensor_parallel_seconds(spec: ModelSpec, cfg: Config, seq_len: int, gpus_per_node: int, gpu: GPU,
                            eff: Efficiency) -> float:
    """A micro-step's tensor-parallel all-reduces, which the step waits for: one after the attention and one after
    the MLP of every block, in the forward and again in the backward (and in a checkpointed forward's recompute), each
    of the micro-batch's hidden states (Shoeybi et al. 2019, arXiv 1909.08053, section 3: the f and g operators)."""
    tp = cfg.tensor_parallel
    if tp <= 1:
        return 0.0
    width = 2 if cfg.half_dtype() else 4
    nbytes = cfg.micro_batch * seq_len * spec.hidden * width
    passes = 2 + int(CHECKPOINTING[cfg.checkpointing].enabled)
    return spec.layers * 2 * passes * 2 * ring_seconds(nbytes, tp, gpus_per_node, gpu, eff)


def compiled_profile(profile: Profile, effect: CompileEffect) -> Profile:
    """The eager step's profile under torch.compile: Inductor's fusion of the memory-bound kernels per phase."""
    phases = (FORWARD, BACKWARD)
    return profile.compiled({p: effect.phase(p).bytes_ratio for p in phases},
                            {p: effect.phase(p).kernel_ratio for p in phases})


def step_time(spec: ModelSpec, gpu: GPU, cfg: Config, *, seq_len: int, gpus_per_node: int, profile: Profile,
              traced_micro_batch: int, optimizer: str, eff: Efficiency, tp_share: float = 1.0,
              compile_effect: CompileEffect | None = None, train_steps: int | None = None,
              adam_step: AdamStep = FUSED_STEP) -> Throughput:
    """The optimizer step's time for `cfg`, from the profile of a micro-step traced at `traced_micro_batch`
    (`tp_share`: the share of the unsplit model's activation bytes a tensor-parallel rank keeps; `adam_step`: how
    an Adam-family optimizer runs, `vocab.ADAM_STEP`, the emitted files' fused kernel by default). A compiled step
    (`compile_effect`: what compiling changes, None to time it as eager) runs Inductor's fused kernels, and its
    checkpointed blocks recompute inside the compiled backward graph, without torch.utils.checkpoint's host work; its
    device time carries the measured residual (planner/memory/compiled.py `COMPILED_DEVICE_RESIDUAL`); its compile
    time is spread over `train_steps` where the run's length is known."""
    blocks = spec.layers if CHECKPOINTING[cfg.checkpointing].enabled else 0
    compile_once, residual = 0.0, 1.0
    if cfg.compiled and compile_effect is not None:
        profile, blocks, residual = compiled_profile(profile, compile_effect), 0, COMPILED_DEVICE_RESIDUAL
        compile_once = compile_effect.compile_seconds(spec.layers)
    micro = micro_step(profile, cfg.micro_batch / traced_micro_batch, cfg.precision, gpu, eff, blocks,
                       cfg.tensor_parallel, tp_share)
    extra = dequantize_seconds(spec, cfg, gpu, eff) + tensor_parallel_seconds(spec, cfg, seq_len, gpus_per_node, gpu,
                                                                               eff)
    micro = replace(micro, gpu_s=micro.gpu_s * residual + extra)
    backward = micro.seconds * _backward_share(profile)
    compute = cfg.grad_accum * micro.seconds
    opt = optimizer_seconds(spec, cfg, optimizer, gpu, eff, gpus_per_node, adam_step)
    comm = communication_seconds(spec, cfg, gpus_per_node, backward, micro.seconds, gpu, eff)
    off = offload_seconds(spec, cfg, gpu, eff)
    parts = StepParts(compute=compute, optimizer=opt, communication=comm, offload=off,
                      compile=compile_once / train_steps if train_steps else 0.0, compile_once=compile_once,
                      micro_gpu=micro.gpu_s, micro_cpu=micro.cpu_s)
    total = parts.total
    tokens = cfg.global_batch * seq_len
    dense, attn = flops_per_token(spec, seq_len)
    peak = gpu.peak_tflops(cfg.precision) * 1e12
    return Throughput(tokens_per_s=tokens / total, samples_per_s=cfg.global_batch / total,
                      mfu=(dense + attn) * tokens / total / (cfg.world_size * peak), step_time_s=total, parts=parts)


def _backward_share(profile: Profile) -> float:
    """The backward's share of a micro-step's GEMM FLOPs (the time collectives can hide behind)."""
    total = backward = 0.0
    for count, dims, _dtype, phase, _scaled in profile.gemms():
        work = count * math.prod(dims)
        total += work
        backward += work if phase == "backward" else 0.0
    return backward / total if total else 2.0 / 3.0
