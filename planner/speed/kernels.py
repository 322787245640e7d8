"""A micro-step's time from its traced op profile: a per-kernel roofline on the GPU, beside the CPU's dispatch.

GEMMs run by shape (wave quantization over the GPU's SMs and tile size, NVIDIA's "Matrix Multiplication Background"
guide, sections 3.1-3.2, and the pipeline fill of a short K loop), fused attention kernels by FLOPs and bytes, every
other kernel by the bytes it moves; each at max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth), the
achievable figures being the GPU's measured ones (planner/hardware/efficiency.json). Eager PyTorch dispatches every op
from the CPU, which runs ahead asynchronously: the micro-step takes the longer of the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from planner import facts
from planner.config import Config
from planner.hardware import GPU
from planner.hardware.efficiency_data import Efficiency
from planner.models.adapters import NF4_FACTS
from planner.models.spec import ModelSpec
from planner.program.float8 import Float8Linears
from planner.program.profile import (
    ENGINE_KERNELS, ENGINE_VIEWS, GRAPH_KERNELS, HALF, MODULE_CALLS, POLICY_OPS, PY_KERNELS, PY_VIEWS, Profile,
)
from planner.vocab import BF16_COMPUTE, CHECKPOINTING, FP8_COMPUTE, FP32_COMPUTE, PRECISION


def compute_dtype(precision: str, half: bool) -> str:
    """The GEMM dtype (an efficiency.json key) of a traced op: 16-bit ops run in the precision's 16-bit dtype,
    fp32 ops in fp32 (TF32 off, torch's default), or on TF32 tensor cores under the tf32 precision."""
    info = PRECISION[precision]
    if info.tf32:
        return info.compute
    return info.compute if half and info.compute != FP32_COMPUTE else FP32_COMPUTE


@dataclass(frozen=True)
class GemmRules:
    """The GEMM model's constants (facts), read once for all the GEMMs of a micro-step."""
    tile_exponent: float
    k_half: float
    alignment: int
    latency_s: float

    @staticmethod
    def read() -> "GemmRules":
        return GemmRules(facts.get("gemm.tile_exponent"), facts.get("gemm.k_half"),
                         facts.get("gemm.tensor_core_alignment"), facts.get("gemm.latency_s"))


def gemm_efficiency(b: float, m: float, n: float, k: float, eff: Efficiency, rules: GemmRules | None = None) -> float:
    """Fraction of a large GEMM's rate this shape reaches: the best tile's wave quantization times tile size, and
    the K loop's pipeline fill (`gemm.tile_exponent`, `gemm.k_half`)."""
    rules = rules or GemmRules.read()
    return _best_tile(b, m, n, eff.tiles, eff.sm_count, rules.tile_exponent) * k / (k + rules.k_half)


@lru_cache(maxsize=4096)
def _best_tile(b: float, m: float, n: float, tiles: tuple[tuple[int, int], ...], sm_count: int,
               exponent: float) -> float:
    best = 0.0
    for tm, tn in tiles:
        count = b * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(count / sm_count)
        size = (tm * tn / (256 * 128)) ** exponent
        best = max(best, count / (waves * sm_count) * size)
    return best


def gemm_fraction(m, n, k, dtype: str, eff: Efficiency, elem_bytes: int, rules: GemmRules | None = None) -> float:
    """A large GEMM's fraction of peak. A 16-bit GEMM with a dimension that is not a multiple of 8 elements (16
    bytes: NVIDIA's Matrix Multiplication Background guide, 'Tensor Core Requirements') runs cuBLAS's narrower-load
    kernels, at the rate measured for their alignment (efficiency.json, benchmarks/derive_misaligned.py): an odd
    dimension the align1 kernels of GPT-2's 50257-token LM head, an even one the align2 kernels of BERT's 30522."""
    full = (rules or GemmRules.read()).alignment
    alignment = min(_alignment(int(round(d)), full) for d in (m, n, k))
    if elem_bytes == 2 and alignment < full:
        return eff.misaligned if alignment == 1 else eff.misaligned_align2
    if dtype == FP8_COMPUTE and dtype not in eff.matmul:  # no FP8 GEMM measured on this GPU: bf16's share of peak
        return eff.matmul[BF16_COMPUTE]
    return eff.matmul[dtype]


def _alignment(dim: int, full: int) -> int:
    """The largest power of two up to `full` (`gemm.tensor_core_alignment`) that divides `dim`."""
    alignment = 1
    while alignment < full and dim % (2 * alignment) == 0:
        alignment *= 2
    return alignment


def gemm_seconds(b, m, n, k, dtype: str, gpu: GPU, eff: Efficiency, elem_bytes: int) -> float:
    return shaped_gemm_seconds((b, m, n, k), dtype, gpu, eff, elem_bytes, GemmRules.read())


def shaped_gemm_seconds(shape, dtype: str, gpu: GPU, eff: Efficiency, elem_bytes: int, rules: GemmRules) -> float:
    """`gemm_seconds` of a (b, m, n, k) shape with the GEMM constants already read."""
    b, m, n, k = shape
    fraction = gemm_fraction(m, n, k, dtype, eff, elem_bytes, rules)
    peak = gpu.peak_tflops_for(dtype) * 1e12 * fraction * gemm_efficiency(b, m, n, k, eff, rules)
    moved = (b * (m * k + k * n + m * n)) * elem_bytes
    return max(2.0 * b * m * n * k / peak, moved / bandwidth(gpu, eff)) + rules.latency_s


def bandwidth(gpu: GPU, eff: Efficiency) -> float:
    return gpu.hbm_bandwidth_GBps * 1e9 * eff.hbm


def host_link(gpu: GPU, eff: Efficiency) -> float:
    """Bytes/s pinned copies achieve between host and GPU."""
    return gpu.host_bandwidth_GBps * 1e9 * eff.pcie


@dataclass(frozen=True)
class MicroStep:
    gpu_s: float
    cpu_s: float
    #: (GPU, host) seconds of the stretches between the host's waits for the GPU within the micro-step (empty: none)
    segments: tuple[tuple[float, float], ...] = ()

    @property
    def wait_s(self) -> float:
        """What the host's waits for the GPU within the micro-step add (`synced_wait`)."""
        return synced_wait(self.segments) if self.segments else 0.0

    @property
    def seconds(self) -> float:
        """The CPU dispatches asynchronously: the longer of the two is the micro-step, plus its syncs' wait."""
        return max(self.gpu_s, self.cpu_s) + self.wait_s

    def on_host(self, scale: float) -> "MicroStep":
        """The same step on a host `scale` times as slow."""
        return MicroStep(gpu_s=self.gpu_s, cpu_s=self.cpu_s * scale,
                         segments=tuple((g, c * scale) for g, c in self.segments))


def synced_wait(segments: list[tuple[float, float]]) -> float:
    """What a step's syncs add: each (GPU, host) segment between them runs as the longer of its two, the host unable
    to run ahead into the next; against the longer of their sums."""
    gpu, cpu = sum(g for g, _ in segments), sum(c for _, c in segments)
    return max(0.0, sum(max(g, c) for g, c in segments) - max(gpu, cpu))


def cpu_seconds(profile: Profile, eff: Efficiency) -> float:
    """The CPU's side of a micro-step: every kernel launched (from Python or the autograd engine), every view op
    (Python's cost more: argument parsing), every nn.Module call, each at the host's cost, which where it is a
    micro-benchmark's (`Efficiency.host_micro_benchmark`) is scaled by what an eager training step's ops cost beyond
    it (`host.step_op_factor`: autograd recording, autocast, the allocator, model code's Python); every kernel a
    compiled graph's wrapper launches, at the host's cost alone; and every op a selective-checkpointing policy's
    Python dispatch mode handles (a cost measured on the policy's own code)."""
    d = profile.dispatch
    eager = (d.get(PY_KERNELS, 0.0) * eff.dispatch_us + d.get(ENGINE_KERNELS, 0.0) * eff.engine_dispatch_us
             + d.get(PY_VIEWS, 0.0) * eff.python_op_us + d.get(ENGINE_VIEWS, 0.0) * eff.cpp_op_us
             + d.get(MODULE_CALLS, 0.0) * eff.module_call_us)
    factor = facts.get("host.step_op_factor") if eager and eff.host_micro_benchmark else 1.0
    return (eager * factor + d.get(GRAPH_KERNELS, 0.0) * eff.dispatch_us
            + d.get(POLICY_OPS, 0.0) * eff.checkpoint_policy_op_us) * 1e-6


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
    rules = GemmRules.read()
    for count, dims, dtype, _phase, scaled in profile.gemms():
        dims = [d * scale if grows else d for d, grows in zip(dims, scaled)]
        cdtype = compute_dtype(precision, dtype == HALF)
        seconds = shaped_gemm_seconds(dims, cdtype, gpu, eff, 2 if cdtype != FP32_COMPUTE else 4, rules)
        # a tensor-parallel slice still takes a whole GEMM's latency
        gemm_s += count * (seconds if tp == 1 else max(seconds / tp, rules.latency_s))
    for key, (fl, scaled, fixed, count) in profile.attention.items():
        cdtype = compute_dtype(precision, key.startswith(HALF))
        peak = gpu.peak_tflops_for(cdtype) * 1e12 * (eff.attention_fp32 if cdtype == FP32_COMPUTE else eff.attention)
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
    of small HF steps without the cost they pay on top of their bytes. A step whose host waits for the GPU within it
    (`Profile.syncs`) overlaps the work between two waits apart (`synced_wait`)."""
    bookkeeping = checkpointed_blocks * eff.checkpoint_block_us * 1e-6
    synced = profile.synced()
    if synced is None:
        return MicroStep(gpu_s=device_time(profile, scale, precision, gpu, eff, tp, tp_share).seconds,
                         cpu_s=cpu_seconds(profile, eff) + bookkeeping)
    segments = [(device_time(part, scale, precision, gpu, eff, tp, tp_share).seconds, cpu_seconds(part, eff))
                for part in synced]
    segments[-1] = (segments[-1][0], segments[-1][1] + bookkeeping)  # recomputation runs in the backward
    return MicroStep(gpu_s=sum(g for g, _ in segments), cpu_s=sum(c for _, c in segments), segments=tuple(segments))


def float8_gemm_change(profile: Profile, scale: float, precision: str, gpu: GPU, eff: Efficiency,
                       float8: Float8Linears) -> float:
    """Seconds float8 changes in a micro-step's GEMMs: the share of each that `float8` converts runs on the FP8 tensor
    cores with 1-byte operands instead of in the precision's 16-bit dtype (planner/program/float8.py)."""
    change, rules = 0.0, GemmRules.read()
    for count, dims, dtype, _phase, scaled in profile.gemms():
        share = float8.share(dims, scaled)
        if share:
            dims = [d * scale if grows else d for d, grows in zip(dims, scaled)]
            cdtype = compute_dtype(precision, dtype == HALF)
            change += count * share * (shaped_gemm_seconds(dims, FP8_COMPUTE, gpu, eff, 1, rules)
                                       - shaped_gemm_seconds(dims, cdtype, gpu, eff,
                                                             2 if cdtype != FP32_COMPUTE else 4, rules))
    return change


def float8_cast_time(float8: Float8Linears, tokens: float, weight_bytes: int, compiled: bool, gpu: GPU,
                     eff: Efficiency) -> MicroStep:
    """One micro-step's float8 casts (`Float8Linears.cast_traffic`): memory-bound kernels on the GPU, each also
    dispatched by the host (the casts run in Float8Linear's Python forward and autograd Function backward)."""
    nbytes, launches = float8.cast_traffic(tokens, weight_bytes, compiled)
    host = 0.0 if compiled else launches * eff.dispatch_us * 1e-6
    return MicroStep(gpu_s=nbytes / bandwidth(gpu, eff) + launches * eff.launch_us * 1e-6, cpu_s=host)


def dequantize_seconds(spec: ModelSpec, cfg: Config, gpu: GPU, eff: Efficiency) -> float:
    """One micro-step's 4-bit dequantisation: each pass (`bitsandbytes.dequantize_passes`, a checkpointed forward one
    more) reads the packed weights and writes a 16-bit copy."""
    if not spec.quantized_parameters:
        return 0.0
    facts.record(*NF4_FACTS)  # the spec's packed bytes
    passes = facts.get("bitsandbytes.dequantize_passes") + int(CHECKPOINTING[cfg.checkpointing].enabled)
    return passes * (spec.quantized_bytes + 2 * spec.quantized_parameters) / bandwidth(gpu, eff)
