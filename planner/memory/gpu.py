"""The GPU view above the tensors: what the CUDA caching allocator reserves beyond them, and what the process holds
outside it.

What the allocator's statistics show above the tensors' own bytes (`AllocatorView`: allocated beyond the requests,
reserved beyond allocated) comes from replaying allocations through the allocator model
(planner/memory/allocator.py). A one-GPU or DDP run is replayed whole (planner/memory/whole_run.py). For the others:
the step's own allocations and frees as the trace recorded them (trace.TracePoint), and here the model states,
allocated once and kept: one tensor per parameter for weights, gradients and optimizer states on the torch and FSDP2
engines (FSDP2 keeps each parameter's shard as its own tensor), a few flat buffers on DeepSpeed (its ZeRO optimizer
flattens each parameter group: deepspeed/runtime/zero/stage_1_and_2.py `flatten_dense_tensors_aligned`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from pydantic import BaseModel, ConfigDict

from planner.config import Config
from planner.hardware.efficiency_data import nccl_channels_of
from planner.memory.allocator import AllocatorStats, replay
from planner.memory.nccl import nccl_buffers
from planner.vocab import DEEPSPEED, OPTIMIZER

#: The margin held back on predicted activations for the model's measured error: over the published HF-code GPU
#: measurements the planner reproduces (benchmarks/published_memory.py, out-of-sample: nothing is fitted to them),
#: traced with the installed transformers, measured/predicted activations have a 90th percentile of 1.34
#: (benchmarks/results/published_memory.json; tests/test_gpu_view.py keeps this constant equal to that file). Those
#: rows ran older transformers releases, whose model code kept more than the installed one (traced with the release
#: each table ran, the same rows are predicted to a median 0.2% and at worst 3.3% under): the margin is the cautious
#: side of that gap. The steps we ran ourselves on an H100 with the installed code (benchmarks/gpu_measured.py, 38
#: rows) are predicted to a median 0.0% and at worst 1.7% under, so the margin is deliberately the published rows'
#: and not ours: it is what guards a plan against a model code or library release the trace has not seen.
ACTIVATION_MARGIN = 0.34
#: Without a trace (formula estimates) the step's allocator slack is taken as this share of its activations: the
#: largest share seen in traced steps (benchmarks/published_memory.py prints them), kept for screens.
ANALYTIC_SLACK_FRACTION = 0.10


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
    width, grad_width = cfg.weight_bytes(), cfg.grad_bytes()
    count, state_width = state_tensors(cfg, optimizer)
    shard = cfg.world_size if cfg.sharded else 1
    sizes: list[int] = []
    for numel in spec.tensor_sizes:
        part = -(-abs(numel) // shard)
        sizes.append(part * width)
        if numel > 0:
            sizes.append(part * grad_width)
            sizes += [part * state_width] * count
    return _view(tuple(sizes))


@lru_cache(maxsize=256)
def _view(sizes: tuple[int, ...]) -> AllocatorView:
    return AllocatorView.of(replay(("alloc", i, size) for i, size in enumerate(sizes)))


MiB = 2**20

#: CUDA context with lazy module loading (CUDA >= 11.7 default): 0.3-1.5 GiB depending on GPU, driver and kernels
#: loaded (the HF docs' "Model training anatomy" measures ~1.3 GB on a V100 after `torch.ones(1).cuda()`, before lazy
#: loading). Measured on an H100 (torch 2.11, driver 580): 615.6 MiB after the first allocation, +69 MB once cuBLAS
#: loads and +19 MB for the SDPA kernels' modules (benchmarks/results/gpu_mechanisms-H100-80GB-2026-11-22.json);
#: a training step loads more modules (loss, optimizer, norms) and the NVML process totals of 38 steps sit at a
#: median 0.2% from the prediction with this value and the whole run replayed (2.6% when this value was set, with
#: the step and the states replayed apart; benchmarks/results/gpu_measured-H100-80GB.json). Other architectures:
#: `cuda_context_bytes`.
CUDA_CONTEXT_BYTES = 768 * MiB
#: The bare context, created before any kernel runs, measured per architecture (compute capability -> bytes), each
#: with lazy module loading (torch sets CUDA_MODULE_LOADING=LAZY since 1.13, pytorch/pytorch PR #86509):
#: - sm 9.0: 645464064 B on the lent H100 (torch 2.11, CUDA 13.0: NVML used minus used-before minus reserved, the
#:   `outside_allocator` stage "context" of the file above);
#: - sm 10.0: 612 MiB on a B200, a fresh process's per-PID nvidia-smi after `torch.cuda.mem_get_info`, nothing
#:   allocated (unslothai/unsloth PR #8677, "mem_get_info and synchronize cost 612 MiB, permanently");
#: - sm 8.9: 426 MiB on an RTX 6000 Ada (torch 2.10+cu130, nvidia-smi after `torch.cuda.mem_get_info`,
#:   unslothai/unsloth-zoo PR #1053);
#: - sm 8.6: 256 MiB on an RTX 3090, an idle server's per-process nvidia-smi, no tensor allocated (torch 2.7.1+cu128,
#:   invoke-ai/InvokeAI issue #9413, "a flat 256 MiB");
#: - sm 7.5: 474 MiB on a T4 after `torch.ones(1, 1).cuda()`: nvidia-smi's 476 MiB less the 2 MiB segment torch
#:   reserved (torch 2.0.1+cu117, CUDA_MODULE_LOADING=LAZY; pytorch/pytorch issue #109888, where a maintainer calls it
#:   the CUDA context).
#: A training step's kernels add what `CUDA_CONTEXT_BYTES` holds beyond the H100's bare context (in-sample to the
#: H100 steps). An architecture not measured (sm 7.0, sm 8.0, AMD's) gets the largest measured, the H100's: no
#: published bare-context measurement with lazy loading was found for a V100 or an A100.
CUDA_BARE_CONTEXT_BYTES = {"9.0": 645464064, "10.0": 612 * MiB, "8.9": 426 * MiB, "8.6": 256 * MiB, "7.5": 474 * MiB}
CUDA_STEP_MODULES_BYTES = CUDA_CONTEXT_BYTES - CUDA_BARE_CONTEXT_BYTES["9.0"]


def cuda_context_bytes(gpu) -> int:
    """The CUDA context a training process holds on `gpu` (a catalog entry; None: unknown), outside the allocator."""
    bare = CUDA_BARE_CONTEXT_BYTES.get(gpu.compute_capability if gpu else "", max(CUDA_BARE_CONTEXT_BYTES.values()))
    return bare + CUDA_STEP_MODULES_BYTES


#: cuBLAS workspace, allocated through torch's caching allocator (so in max_memory_allocated), one per handle and
#: stream: torch's default (aten/src/ATen/cuda/CublasHandlePool.cpp `parseChosenWorkspaceSize`, "/* :4096:2:16:8
#: default, 32MiB for Hopper */") is 32 MiB on sm 9.0 exactly (measured on the lent H100: 33554432 B,
#: benchmarks/results/gpu_mechanisms-H100-80GB-2026-11-22.json) and 2 x 4 MiB + 8 x 16 KiB elsewhere, Blackwell
#: included; cuBLASLt shares it (`getCUDABlasLtWorkspaceSize`: unified unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=0).
#: A ROCm build keeps hipBLAS's, 128 MiB on gfx94x/gfx95x (MI300) and 32 MiB elsewhere, and hipBLASLt's own 76 MiB
#: (the unified workspace is CUDA-only). None: a GPU of unknown make, planned at Hopper's.
CUBLAS_WORKSPACE_BYTES = 32 * MiB
#: Threads whose matmuls each get a handle, so a workspace, of their own: the handle pool reserves handles per
#: thread (aten/src/ATen/cuda/detail/DeviceThreadHandles.h, `DeviceThreadHandlePool`) and CublasHandlePool.cpp keys
#: the workspaces by (handle, stream) (`cublas_handle_stream_to_workspace`); a training step runs its forward on the
#: Python thread and its backward on the autograd engine's thread for the device (torch/csrc/autograd/engine.cpp,
#: `Engine::start_device_threads`). Measured on the lent H100: the allocations the backward thread made (no Python
#: frame) at Llama-3.2-1B's peak were its 146 gradients plus one block of 33554432 B
#: (benchmarks/results/gpu_memory_peak-H100-80GB-2026-11-23.json), and the steps measured there sat 32-38 MiB above
#: a single workspace's prediction (BLOOM-560m, Llama-3.2-1B, BERT-large; GPT-2 46-60 MiB;
#: benchmarks/results/gpu_measured-H100-80GB.json before this rule).
BLAS_THREADS = 2


def cublas_workspace_bytes(gpu) -> int:
    """The BLAS workspaces torch allocates for one thread's handle on `gpu` (a catalog entry; None: unknown); a
    training step holds `BLAS_THREADS` of them."""
    if gpu is None:
        return CUBLAS_WORKSPACE_BYTES
    if gpu.vendor == "amd":
        hipblas = 128 * MiB if gpu.compute_capability.startswith(("gfx94", "gfx95")) else 32 * MiB
        return hipblas + 76 * MiB
    return CUBLAS_WORKSPACE_BYTES if gpu.compute_capability == "9.0" else 2 * 4 * MiB + 8 * 16 * 1024


#: DDP's bucket cap (torch/nn/parallel/distributed.py, `bucket_cap_mb` default 25). On the CPU, gloo's all-reduce
#: holds a second copy of the bucket it reduces: with two ranks DDP adds 2.00x the gradient bytes on the CPU for
#: two model sizes (benchmarks/results/engine_memory_cpu.json), where NCCL reduces the bucket in place.
DDP_BUCKET_CAP_BYTES = 25 * MiB
#: DeepSpeed communication buckets, in 16-bit elements, as the emitted ds_config sets them (the values
#: transformers' "auto" derives from the hidden size, transformers/integrations/deepspeed.py
#: `HfTrainerDeepSpeedConfig.trainer_config_finalize`): reduce = allgather = h^2, stage-3 prefetch = 0.9 h^2.
#: overlap_comm double-buffers the reduce bucket. With optimizer offload, ZeRO-1/2 also copies each gradient into a
#: 16-bit partition buffer before it goes to the host (stage_1_and_2.py `copy_grads_in_partition`:
#: grads_in_partition), which DeepSpeed's estimator leaves out of its model states.
DS_REDUCE_BUCKETS_LIVE = 2


class DeepSpeedBuckets(BaseModel):
    """Bucket sizes in elements, as the emitted ds_config sets them."""

    model_config = ConfigDict(frozen=True)

    reduce_bucket_size: int
    allgather_bucket_size: int
    stage3_prefetch_bucket_size: int
    stage3_param_persistence_threshold: int

    @classmethod
    def for_hidden(cls, hidden: int) -> "DeepSpeedBuckets":
        return cls(reduce_bucket_size=hidden * hidden, allgather_bucket_size=hidden * hidden,
                   stage3_prefetch_bucket_size=int(0.9 * hidden * hidden),
                   stage3_param_persistence_threshold=10 * hidden)


def model_buffer_bytes(spec, cfg: Config) -> int:
    """The module's registered buffers (attention-mask tables some architectures keep per layer: GPT-Neo's 2048 x 2048
    bool `bias`, 4 MiB a layer), which no engine shards: the floating ones in the working weights' width (casting a
    model to 16 bits casts them, autocast does not)."""
    return spec.other_buffer_bytes + cfg.weight_bytes() * spec.float_buffer_elements


def nccl_buffer_bytes(gpu, cfg: Config, gpus_per_node: int | None = None) -> int:
    """NCCL's device buffers on each GPU of `cfg`'s run on `gpu` (a catalog entry; None: efficiency.json's defaults),
    `gpus_per_node` to a node (None: all on one): planner/memory/nccl.py."""
    buffers = nccl_buffers(nccl_channels_of(gpu), world_size=cfg.world_size,
                           gpus_per_node=gpus_per_node or cfg.world_size, tensor_parallel=cfg.tensor_parallel,
                           sharded=cfg.sharded)
    return buffers.total
