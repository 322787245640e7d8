"""The GPU view above the tensors: what the CUDA caching allocator reserves beyond them, and what the process holds
outside it.

What the allocator's statistics show above the tensors' own bytes (`AllocatorView`: allocated beyond the requests,
reserved beyond allocated) comes from replaying allocations through the allocator model
(planner/allocator.py). A one-GPU or DDP run is replayed whole (planner/memory/whole_run.py). For the others:
the step's own allocations and frees as the trace recorded them (trace.TracePoint), and here the model states,
allocated once and kept: one tensor per parameter for weights, gradients and optimizer states on the torch and FSDP2
engines (FSDP2 keeps each parameter's shard as its own tensor), a few flat buffers on DeepSpeed (its ZeRO optimizer
flattens each parameter group: deepspeed/runtime/zero/stage_1_and_2.py `flatten_dense_tensors_aligned`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from pydantic import BaseModel, ConfigDict

from planner import facts
from planner.config import Config
from planner.hardware.efficiency_data import nccl_channels_of
from planner.allocator import AllocatorStats, replay
from planner.memory.nccl import nccl_buffers
from planner.vocab import DEEPSPEED, OPTIMIZER

@dataclass(frozen=True)
class AllocatorView:
    """What torch's allocator statistics add to the tensors' own bytes, per GPU: `rounding`, max_memory_allocated
    beyond the bytes requested (whole blocks the allocator did not split: `AllocatorStats.rounding`), and `slack`,
    max_memory_reserved beyond max_memory_allocated (the segments' free room)."""

    rounding: int = 0
    slack: int = 0

    @classmethod
    def of(cls, stats: AllocatorStats) -> AllocatorView:
        return cls(rounding=stats.rounding, slack=stats.peak_reserved - stats.peak_allocated)

    def __add__(self, other: AllocatorView) -> AllocatorView:
        return AllocatorView(self.rounding + other.rounding, self.slack + other.slack)

    def scaled(self, factor: float) -> AllocatorView:
        return AllocatorView(int(self.rounding * factor), int(self.slack * factor))


def state_tensors(cfg: Config, optimizer: str) -> tuple[int, int]:
    """The optimizer's state tensors per parameter and their bytes per element, as the allocator sees them: fp32-wide
    states follow the weights' width, quantised ones are one byte per element; a factored optimizer's (Adafactor's
    row and column vectors) are not per-parameter tensors (0)."""
    info = OPTIMIZER[optimizer]
    count = 0 if info.factored else (info.state_bytes // 4 if info.follows_weights else info.state_bytes)
    return count, cfg.state_width() if info.follows_weights else 1


def states_view(spec, cfg: Config, states, optimizer: str) -> AllocatorView:
    """The allocator's view of the model states' own allocations."""
    if cfg.engine == DEEPSPEED:
        sizes = tuple(part for part in (states.parameters, states.gradients, states.optimizer_states) if part > 0)
        return _view(sizes)
    count, state_width = state_tensors(cfg, optimizer)
    return _tensors_view(spec.tensor_sizes, cfg.world_size if cfg.sharded else 1, cfg.weight_bytes(),
                         cfg.grad_bytes(), count, state_width)


@lru_cache(maxsize=64)
def _tensors_view(tensor_sizes: tuple[int, ...], shard: int, width: int, grad_width: int, count: int,
                  state_width: int) -> AllocatorView:
    """Each tensor's `shard`-th part as weight, gradient (trainable ones) and `count` optimizer states."""
    sizes: list[int] = []
    for numel in tensor_sizes:
        part = -(-abs(numel) // shard)
        sizes.append(part * width)
        if numel > 0:
            sizes.append(part * grad_width)
            sizes += [part * state_width] * count
    return _view(tuple(sizes))


@lru_cache(maxsize=256)
def _view(sizes: tuple[int, ...]) -> AllocatorView:
    return AllocatorView.of(replay(("alloc", i, size) for i, size in enumerate(sizes)))


def cuda_context_bytes(gpu) -> int:
    """The CUDA context a training process holds on `gpu` (a catalog entry; None: unknown), outside the allocator: the
    bare context of its architecture (the largest measured where it is not) and the modules a step loads."""
    bare = facts.get("cuda.bare_context_bytes")
    return bare.get(gpu.compute_capability if gpu else "", max(bare.values())) + facts.get("cuda.step_modules_bytes")


def cublas_workspace_bytes(gpu) -> int:
    """The BLAS workspaces torch allocates for one thread's handle on `gpu` (a catalog entry; None: unknown); a
    training step holds `cuda.blas_threads` of them."""
    sizes = facts.get("cublas.workspace_bytes")
    if gpu is None:
        return sizes["9.0"]  # a GPU of unknown make: planned at Hopper's
    if gpu.vendor == "amd":
        rocm = facts.get("rocm.blas_workspace_bytes")
        gfx94 = gpu.compute_capability.startswith(("gfx94", "gfx95"))
        return rocm["hipblas_gfx94x_gfx95x" if gfx94 else "hipblas_other"] + rocm["hipblaslt"]
    return sizes.get(gpu.compute_capability, sizes["default"])


class DeepSpeedBuckets(BaseModel):
    """Bucket sizes in elements, as the emitted ds_config sets them."""

    model_config = ConfigDict(frozen=True)

    reduce_bucket_size: int
    allgather_bucket_size: int
    stage3_prefetch_bucket_size: int
    stage3_param_persistence_threshold: int

    @classmethod
    def for_hidden(cls, hidden: int) -> "DeepSpeedBuckets":
        """What transformers' "auto" derives from the hidden size (`deepspeed.auto_buckets`)."""
        c = facts.get("deepspeed.auto_buckets")
        return cls(reduce_bucket_size=c["reduce_bucket_size"] * hidden * hidden,
                   allgather_bucket_size=c["allgather_bucket_size"] * hidden * hidden,
                   stage3_prefetch_bucket_size=int(c["stage3_prefetch_bucket_size"] * hidden * hidden),
                   stage3_param_persistence_threshold=c["stage3_param_persistence_threshold"] * hidden)


def model_buffer_bytes(spec, cfg: Config) -> int:
    """The module's registered buffers (attention-mask tables some architectures keep per layer: GPT-Neo's 2048 x 2048
    bool `bias`, 4 MiB a layer), which no engine shards: the floating ones in the working weights' width (casting a
    model to 16 bits casts them, autocast does not)."""
    return spec.other_buffer_bytes + cfg.weight_bytes() * spec.float_buffer_elements


def nccl_buffer_bytes(gpu, cfg: Config, gpus_per_node: int | None = None) -> int:
    """NCCL's device buffers on each GPU of `cfg`'s run on `gpu` (a catalog entry; None: efficiency.json's defaults),
    `gpus_per_node` to a node (None: all on one): planner/memory/nccl.py."""
    if cfg.world_size <= 1:  # no communicator
        return 0
    buffers = nccl_buffers(nccl_channels_of(gpu), world_size=cfg.world_size,
                           gpus_per_node=gpus_per_node or cfg.world_size, tensor_parallel=cfg.tensor_parallel,
                           sharded=cfg.sharded)
    return buffers.total
