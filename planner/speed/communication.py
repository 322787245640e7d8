"""Communication the compute does not hide: data-parallel gradient buckets against the backward's timeline, ZeRO-3 and
FSDP's per-block gathers, tensor-parallel all-reduces, and parameter offload over PCIe."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from planner import facts
from planner.config import Config
from planner.hardware import GPU
from planner.hardware.efficiency_data import Efficiency, nccl_channels_of
from planner.memory.gpu import DeepSpeedBuckets
from planner.models.spec import ModelSpec
from planner.program.float8 import Float8Linears, converts
from planner.program.sequence import FP32_BYTES, gathered_kv_bytes, ulysses_exchange_bytes
from planner.speed.kernels import host_link
from planner.vocab import CHECKPOINTING, DEEPSPEED, OFFLOAD, TORCH


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
    end, took = 0.0, {}  # a model's buckets come in a few sizes: each is timed once
    for bucket in buckets:
        if bucket.nbytes not in took:
            took[bucket.nbytes] = seconds(bucket.nbytes)
        end = max(end, bucket.ready * span_s) + took[bucket.nbytes]
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


@dataclass(frozen=True)
class Collectives:
    """An optimizer step's data-parallel and sharding collectives: all their time, and the part of it the compute does
    not hide."""

    total: float = 0.0
    exposed: float = 0.0

    @property
    def hidden(self) -> float:
        return self.total - self.exposed


def communication_seconds(spec: ModelSpec, cfg: Config, per_node: int, backward_s: float, micro_s: float, gpu: GPU,
                          eff: Efficiency) -> float:
    """The collectives per optimizer step the compute does not hide (`collectives`)."""
    return collectives(spec, cfg, per_node, backward_s, micro_s, gpu, eff).exposed


def collectives(spec: ModelSpec, cfg: Config, per_node: int, backward_s: float, micro_s: float, gpu: GPU,
                eff: Efficiency) -> Collectives:
    """Collectives per optimizer step, and what of them the compute does not hide, bucket by bucket against the
    backward's timeline (`gradient_buckets`): DDP all-reduces its buckets in the last micro-step's backward
    (accumulating micro-steps skip the sync); DeepSpeed ZeRO-1 reduce-scatters its reduce buckets in that backward and
    ZeRO-2 in every micro-step's (deepspeed/runtime/zero/stage_1_and_2.py `reduce_ready_partitions_and_remove_grads`),
    both gathering the updated 16-bit weights after the step (`step`: `all_gather_dp_groups`), which nothing
    overlaps; ZeRO-3 / FSDP gather and reduce-scatter block by block (`sharded_exposed_seconds`), float8 weights in 1
    byte."""
    world, n = cfg.shard_ranks, cfg.grad_accum  # a tensor-parallel rank reduces its 1/tp over the others
    if world <= 1:
        return Collectives()
    # A data-parallel group has per_node / tp ranks on each node (tensor parallelism stays inside a node), so it
    # crosses nodes whenever the job does, however few ranks it has.
    per_node = max(1, per_node // cfg.tensor_parallel)
    grad_bytes = cfg.grad_bytes() / cfg.tensor_parallel
    weights16 = spec.parameters * cfg.weight_bytes() / cfg.tensor_parallel

    def ring(nbytes: float) -> float:
        return ring_seconds(nbytes, world, per_node, gpu, eff)

    if cfg.engine == TORCH:
        caps = (facts.get("ddp.first_bucket_bytes"), facts.get("ddp.bucket_cap_bytes"))  # rebuilt in backward order
        buckets = gradient_buckets(spec, grad_bytes, caps)
        return Collectives(total=sum(2 * ring(b.nbytes) for b in buckets),
                           exposed=exposed_seconds(buckets, backward_s, lambda nbytes: 2 * ring(nbytes)))
    if cfg.engine == DEEPSPEED and cfg.zero_stage in (1, 2):
        cap = DeepSpeedBuckets.for_hidden(spec.hidden).reduce_bucket_size * grad_bytes
        buckets = gradient_buckets(spec, grad_bytes, (cap,))
        times = n if cfg.zero_stage == 2 else 1
        return Collectives(total=times * sum(ring(b.nbytes) for b in buckets) + ring(weights16),
                           exposed=times * exposed_seconds(buckets, backward_s, ring) + ring(weights16))
    layers = max(1, spec.layers)
    if converts(cfg):  # torchao's float8 all-gather under FSDP2
        weights16 = Float8Linears.of(spec).gathered_bytes(spec.parameters, cfg.weight_bytes())
    gather, reduce = ring(weights16) / layers, ring(spec.trainable_parameters * grad_bytes) / layers
    # FSDP2's stage 2 (reshard_after_forward=False) keeps the forward's gathered weights for the backward
    regather = gather if cfg.zero_stage == 3 else 0.0
    return Collectives(total=n * layers * (gather + regather + reduce),
                       exposed=n * sharded_exposed_seconds(layers, gather, regather, reduce, micro_s - backward_s,
                                                           backward_s))


def contention_seconds(hidden_s: float, gpu: GPU, eff: Efficiency) -> float:
    """What collectives running beside the compute cost it: NCCL runs one CUDA block per channel (NCCL's environment
    variables documentation, NCCL_MIN_NCHANNELS: "increasing the number of channels also increases the number of CUDA
    blocks NCCL uses"), each holding an SM the compute's kernels would otherwise fill, so while they run the compute
    proceeds on the rest: `hidden_s` of collectives slow it by their channels' share of the SMs."""
    if hidden_s <= 0:
        return 0.0
    return hidden_s * nccl_channels_of(gpu).coll / eff.sm_count


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


def sequence_split_seconds(spec: ModelSpec, cfg: Config, seq_len: int, gpus_per_node: int, gpu: GPU,
                           eff: Efficiency) -> float:
    """A micro-step's collectives of a split sequence, which attention waits for, per layer. Ring attention under
    accelerate's default rotation (allgather, accelerate/utils/dataclasses.py:2224-2249) gathers the layer's keys
    and values before its forward (and its recompute) and again in the backward, then passes their gradients round
    the ring in fp32 (_attention.py:512-520, :624-627). Ulysses runs four all-to-alls (q, k, v, the output) in the
    forward, the recompute and the backward (ulysses_sp.py:168-229)."""
    split = cfg.sequence_split
    if split <= 1:
        return 0.0
    per_node, forwards = min(split, gpus_per_node), 1 + int(CHECKPOINTING[cfg.checkpointing].enabled)

    def collective(nbytes: float) -> float:
        return ring_seconds(nbytes, split, per_node, gpu, eff)

    if cfg.context_parallel > 1:
        layer = (forwards + 1) * collective(gathered_kv_bytes(spec, cfg, seq_len)) + collective(
            gathered_kv_bytes(spec, cfg, seq_len, FP32_BYTES))
    else:
        layer = (forwards + 1) * collective(ulysses_exchange_bytes(spec, cfg, seq_len))
    return spec.layers * layer
