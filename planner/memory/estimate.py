"""`estimate_memory`: model states + activations + device overheads for one configuration, per GPU."""

from __future__ import annotations

from dataclasses import replace

from pydantic import BaseModel, ConfigDict

from planner.config import Config
from planner.errors import InputError
from planner.memory import analytic, states
from planner.memory.gpu import ACTIVATION_MARGIN, ANALYTIC_SLACK_FRACTION, AllocatorView, states_view
from planner.memory.kernels import attention_kernel
from planner.memory.trace import TraceRequest, trace_activations
from planner.vocab import (
    ACTIVATIONS, ADAPTER, ANALYTIC, ATTENTION, AUTO_METHOD, CHECKPOINTING, DEEPSPEED, DEFAULT_OPTIMIZER,
    DEFAULT_PRECISION,
    ESTIMATE, KERNEL, LABELS_OBJECTIVE, MEMORY_METHOD, NO_CHECKPOINTING, NO_OFFLOAD, OBJECTIVE, OFFLOAD, OPTIMIZER,
    SDPA, TORCH, TRACE, Attention, EstimateMethod,
)

MiB = 2**20

# --- GPU view: what a CUDA process holds above its tensors
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


class MemoryTerms(BaseModel):
    """The named parts behind a MemoryEstimate's totals, bytes per GPU."""

    model_config = ConfigDict(frozen=True)

    optimizer_transient: int = 0   # temporaries of the optimizer step (part of the tensors' peak)
    model_buffers: int = 0         # the module's registered buffers, whole on every GPU (`model_buffer_bytes`)
    cublas_workspace: int = 0      # allocated through the caching allocator
    #: max_memory_allocated beyond the tensors' bytes: blocks the allocator hands out whole (AllocatorView.rounding)
    allocator_rounding: int = 0
    ddp_buckets: int = 0           # DDP's flat gradient buckets
    zero_buckets: int = 0          # DeepSpeed's reduce / all-gather / prefetch buckets
    allocator_slack: int = 0       # reserved - allocated
    cuda_context: int = 0          # outside the caching allocator
    nccl_buffers: int = 0          # outside the caching allocator
    error_margin: int = 0          # held back for the model's measured error on activations (`gpu.ACTIVATION_MARGIN`)

    @property
    def allocated_overheads(self) -> int:
        """What the caching allocator holds beyond model states and activations."""
        return (self.model_buffers + self.cublas_workspace + self.ddp_buckets + self.zero_buckets
                + self.allocator_rounding)

    @property
    def outside_allocator(self) -> int:
        """Device memory the caching allocator does not see (max_memory_reserved excludes it)."""
        return self.cuda_context + self.nccl_buffers


class MemoryEstimate(BaseModel):
    """Bytes per GPU. `peak_allocated` predicts torch.cuda.max_memory_allocated(), `peak_reserved`
    max_memory_reserved(), `peak_process` the process total nvidia-smi shows; `peak` is what must fit: the process
    total plus a margin for the model's measured error on activations (none for measured or CPU estimates)."""

    model_config = ConfigDict(frozen=True)

    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    overhead: int
    peak_allocated: int
    peak: int
    cpu_offload_bytes: int = 0
    method: EstimateMethod
    device: str                  # cuda | cpu
    terms: MemoryTerms = MemoryTerms()

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def peak_reserved(self) -> int:
        """Predicted torch.cuda.max_memory_reserved(): allocated plus the allocator's slack."""
        return self.peak_allocated + self.terms.allocator_slack

    @property
    def margin(self) -> int:
        """Held back for the model's measured error (part of `peak`)."""
        return self.terms.error_margin

    @property
    def peak_process(self) -> int:
        """Predicted device memory of the process (what nvidia-smi shows): reserved plus what lives outside the
        caching allocator. `peak` adds the error margin to it: that is what must fit."""
        return self.peak_reserved + self.terms.outside_allocator

    @property
    def exact(self) -> bool:
        """Computed for this very program (traced or measured), so an over-budget peak is a real OOM."""
        return ESTIMATE[self.method].exact


def estimate_memory(
    model, *, micro_batch: int = 1, seq_len: int | None = None, precision: str = DEFAULT_PRECISION,
    optimizer: str = DEFAULT_OPTIMIZER, checkpointing: str = NO_CHECKPOINTING, zero_stage: int = 0, offload: str = NO_OFFLOAD,
    world_size: int = 1, gpus_per_node: int | None = None, attention: str = SDPA, device: str = "cuda",
    gpu: str | None = None, grad_accum: int = 1, method: str = AUTO_METHOD, trust_remote_code: bool = False,
    engine: str | None = None, objective: str = LABELS_OBJECTIVE, task: str | None = None,
    num_labels: int | None = None, adapter=None,
) -> MemoryEstimate:
    """Per-GPU memory of one training configuration (see the README's library section).

    `method`: "trace" runs the model's step under FakeTensorMode (exact for what HF code saves), "analytic" uses
    formulas (< 0.1 s), "auto" traces unless the model cannot be traced. `gpu` (a catalog name) checks that the GPU
    can run the precision and attention kernel asked for, and picks the kernel and overheads it has. `objective`
    "sum" starts the backward from the output's sum instead of the head's loss (as some benchmarks do). `task` and
    `num_labels` give the model another head (`vocab.TASK_CHOICES`); `adapter` (planner.Adapter) trains LoRA or
    QLoRA adapters over the frozen model.
    """
    from planner.models import resolve_model

    resolved = resolve_model(model, trust_remote_code=trust_remote_code, task=task, num_labels=num_labels,
                             adapter=adapter)
    _check(micro_batch, seq_len, checkpointing, attention, device, method, world_size, grad_accum)
    if optimizer not in OPTIMIZER:
        raise InputError(f"unknown optimizer {optimizer!r}", flag="--optimizer",
                         hint=f"Use one of {', '.join(OPTIMIZER)}.")
    try:
        cfg = Config.of(micro_batch=micro_batch, grad_accum=grad_accum, world_size=world_size, precision=precision,
                        checkpointing=checkpointing, zero_stage=zero_stage, offload=offload, engine=engine)
    except ValueError as err:
        raise InputError(str(err)) from err
    if objective not in OBJECTIVE:
        raise InputError(f"objective must be one of {', '.join(OBJECTIVE)}")
    entry = _check_gpu(gpu, cfg, attention) if gpu is not None else None
    evaluator = Evaluation(resolved, seq_len=seq_len or resolved.spec.seq_len, optimizer=optimizer,
                           attention=attention, gpus_per_node=gpus_per_node, device=device, gpu=entry,
                           objective=objective)
    return evaluator.estimate(cfg, method)


def _check(micro_batch, seq_len, checkpointing, attention, device, method, world_size, grad_accum):
    if not isinstance(micro_batch, int) or micro_batch < 1:
        raise InputError("micro_batch must be a positive integer", flag="--micro-batch")
    if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
        raise InputError("seq_len must be a positive integer", flag="--seq-len")
    if checkpointing not in CHECKPOINTING:
        raise InputError(f"checkpointing must be one of {', '.join(CHECKPOINTING)}", flag="--checkpointing")
    if attention not in ATTENTION:
        raise InputError(f"attention must be one of {', '.join(ATTENTION)}", flag="--attention")
    if device not in ("cuda", "cpu"):
        raise InputError("device must be cuda or cpu")
    if method not in MEMORY_METHOD:
        raise InputError(f"method must be one of {', '.join(MEMORY_METHOD)}", flag="--memory-method")
    if world_size < 1 or grad_accum < 1:
        raise InputError("world_size and grad_accum must be >= 1")


def _check_gpu(gpu: str, cfg: Config, attention: str):
    from planner import hardware

    entry = hardware.lookup_gpu(gpu)
    problem = entry.cannot_run(cfg.precision, attention)
    if problem:
        raise InputError(problem, flag="--precision" if "bf16" in problem else "--attention")
    return entry


class Evaluation:
    """Memory of configurations of one model and workload: model states exactly, activations traced (or by
    formula), device overheads. The search keeps one and asks it for every candidate."""

    def __init__(self, resolved, *, seq_len: int, optimizer: str, attention: Attention = SDPA,
                 gpus_per_node: int | None = None, device: str = "cuda", gpu=None,
                 objective: str = LABELS_OBJECTIVE):
        self.resolved, self.seq_len, self.optimizer, self.objective = resolved, seq_len, optimizer, objective
        self.attention, self.gpus_per_node, self.device = attention, gpus_per_node, device
        self.gpu = gpu  # the catalog entry (kernel choice, CUDA overheads); None: a current GPU
        self._adafactor: int | None = None
        self._compile: dict = {}
        self._whole_run: dict[str, int | None] = {}

    def states(self, cfg: Config) -> states.ModelStates:
        spec = self.resolved.spec
        frozen = spec.frozen_bytes(cfg.frozen_weight_bytes()) if ADAPTER[spec.adapter].trains_adapters else None
        return states.states_for(cfg, spec.parameters, spec.trainable_parameters, self.optimizer,
                                 gpus_per_node=self.gpus_per_node, largest_layer=spec.largest_layer_parameters,
                                 adafactor_elements=self.adafactor_elements(), block_parameters=spec.block_parameters,
                                 frozen_bytes=frozen)

    def adafactor_elements(self) -> int:
        if not OPTIMIZER[self.optimizer].factored:
            return 0
        if self._adafactor is None:
            from planner.models.build import build_meta

            resolved = self.resolved
            model = resolved.module or build_meta(resolved.config, trust_remote_code=resolved.trust_remote_code,
                                                  adapter=resolved.adapter)
            self._adafactor = states.adafactor_state_elements(
                tuple(p.shape) for p in model.parameters() if p.requires_grad)
        return self._adafactor

    def trace_request(self, cfg: Config) -> TraceRequest:
        """The traced program for a configuration: the kernel the model really uses and the weights and autocast
        its engine runs."""
        from planner.models.build import effective_attention

        spec = self.resolved.spec
        family = cfg.activation_family()
        implementation = effective_attention(self.resolved.config, self.attention, self.resolved.trust_remote_code)
        kernel = attention_kernel(
            implementation, device=self.device, half=ACTIVATIONS[family].half_weights or ACTIVATIONS[family].autocast,
            # None for an AMD GPU (a gfx name): ROCm builds run SDPA's flash kernel through AOTriton on MI200/MI300
            # (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp `check_flash_attention_hardware_support`, ROCm
            # branch), as a current NVIDIA GPU does
            compute_capability=self.gpu.compute_capability_tuple if self.gpu else None, head_dim=spec.head_dim,
            dropout=spec.attention_dropout, grouped_query=spec.kv_heads < spec.heads)
        # flash and memory-efficient kernels apply dropout inside the kernel and save no mask; eager and math
        # attention save it (planner/memory/kernels.py). The Trainer sets the config's use_cache from
        # TrainingArguments.use_cache, False by default (transformers/trainer.py, `self.model.config.use_cache =
        # self.args.use_cache`; training_args.py `use_cache`); a benchmark's own loop (the sum objective) keeps the
        # config's
        return TraceRequest(
            micro_batch=cfg.micro_batch, seq_len=self.seq_len, activations=family, checkpointing=cfg.checkpointing,
            attention=kernel, attention_dropout=KERNEL[kernel].saves_scores and spec.attention_dropout > 0,
            objective=self.objective, grads_allocated=cfg.grad_accum > 1 or cfg.sharded, autocast_device=self.device,
            adapter=self.resolved.adapter, half_dtype=cfg.half_dtype() or TraceRequest.half_dtype,
            use_cache=self.objective != LABELS_OBJECTIVE and getattr(self.resolved.config, "use_cache", None) is True)

    def activations(self, cfg: Config, method: str) -> tuple[int, EstimateMethod]:
        """Activation bytes of one micro-batch and the method that produced them. Optimizer states and
        temporaries are counted by formula; traces run at this very micro-batch (two depths, extrapolated per
        block), so they are exact for it. A tensor-parallel rank keeps the traced bytes times the formulas' ratio
        of its share to the whole (`tensor_parallel_share`): the trace runs the unsplit model."""
        if cfg.tensor_parallel > 1:
            whole = cfg.model_copy(update={"tensor_parallel": 1})
            act, used = self.activations(whole, method)
            return int(act * self.tensor_parallel_share(cfg)), used
        spec, resolved = self.resolved.spec, self.resolved
        req = self.trace_request(cfg)
        if method != ANALYTIC and resolved.config is not None:
            try:
                return self._fit(cfg).activations(spec.layers, cfg.micro_batch), TRACE
            except Exception as err:  # noqa: BLE001 - any model code failure under fake tensors
                if method == TRACE:
                    raise InputError(f"tracing {spec.name} failed: {err}", flag="--model",
                                     hint="Use the analytic memory model (--memory-method analytic).") from err
        terms = analytic.activation_bytes(spec, micro_batch=cfg.micro_batch, seq_len=self.seq_len,
                                          activations=req.activations, attention=req.attention,
                                          checkpointing=cfg.checkpointing)
        return sum(terms.values()), ANALYTIC

    def compile_effect(self, cfg: Config):
        """What torch.compile changes in `cfg`'s program (planner/memory/compiled.py), or None where the model's graph
        cannot be captured (its compiled step is then modelled as the eager one)."""
        resolved = self.resolved
        key = cfg.activation_family()
        if key not in self._compile:
            self._compile[key] = None
            if resolved.config is not None:
                from planner.memory.compiled import compile_effect

                try:
                    self._compile[key] = compile_effect(resolved.config, resolved.spec.config_hash,
                                                        resolved.spec.layers, self.trace_request(cfg),
                                                        resolved.trust_remote_code)
                except Exception:  # noqa: BLE001 - any model code failure under AOTAutograd's capture
                    pass
        return self._compile[key]

    def tensor_parallel_share(self, cfg: Config) -> float:
        """A tensor-parallel rank's activations over the unsplit model's, by formula (planner/memory/analytic.py)."""
        req = self.trace_request(cfg)
        terms = [analytic.activation_bytes(self.resolved.spec, micro_batch=cfg.micro_batch, seq_len=self.seq_len,
                                           activations=req.activations, attention=req.attention,
                                           checkpointing=cfg.checkpointing, tp=tp)
                 for tp in (1, cfg.tensor_parallel)]
        return sum(terms[1].values()) / max(1, sum(terms[0].values()))

    def speed_profile(self, cfg: Config):
        """The op profile of one micro-step of `cfg`'s program (its weights' dtype and autocast, its attention
        kernel, its checkpointing) and the micro-batch it was traced at, for the speed model; None when the model
        cannot be traced. The step is traced once without checkpointing at one and two blocks; recomputation adds
        the traced forward of a block per block: all of it for full checkpointing, and for selective (torchtitan's
        per-op policy, planner/memory/step.py) its non-matmul ops and every second matmul, the attention kernel's
        outputs being kept, every op of the block passing the policy's dispatch mode twice."""
        spec, resolved = self.resolved.spec, self.resolved
        if resolved.config is None:
            return None
        req = self.speed_request(cfg)
        anchor = req.micro_batch
        try:
            one, two = speed_trace_profiles(resolved, req)
        except Exception:  # noqa: BLE001 - an untraceable model gets the formula profile
            return None
        (l1, p1), (l2, p2) = one, two
        base = p1.extrapolated(p2, l1, l2, spec.layers)
        info = CHECKPOINTING[cfg.checkpointing]
        if not info.enabled:
            return base, anchor
        block = p2.minus(p1)
        blocks = spec.layers / max(1, l2 - l1)
        if info.per_op_policy:
            return base.scaled_add(block, blocks, matmul_factor=blocks / 2, attention=False, policy=True), anchor
        return base.scaled_add(block, blocks), anchor

    def speed_request(self, cfg: Config):
        """The traced program of `cfg`'s speed profile: its micro-step at the anchor micro-batch, without
        checkpointing (recomputation is added per block), mid-accumulation."""
        return replace(self.trace_request(cfg), micro_batch=speed_anchor_micro_batch(self.resolved.spec, self.seq_len),
                       checkpointing=NO_CHECKPOINTING, grads_allocated=True)

    def prefetch_speed_traces(self, configs) -> None:
        """Trace the speed profiles `configs` need side by side where cores are spare (planner/memory/trace.py
        `prefetch_traces`); `speed_profile` then finds them cached."""
        from planner.memory.trace import prefetch_traces

        resolved = self.resolved
        if resolved.config is None:
            return
        requests = {self.speed_request(cfg) for cfg in configs}
        try:
            prefetch_traces(resolved.config, resolved.spec.config_hash,
                            [(depth, req, True) for req in requests for depth in speed_depths(resolved.config)],
                            resolved.trust_remote_code)
        except Exception:  # noqa: BLE001 - `speed_profile` meets the failure again and falls back per program
            pass

    def _fit(self, cfg: Config):
        resolved, spec = self.resolved, self.resolved.spec
        return trace_activations(resolved.config, spec.config_hash, spec.layers, self.trace_request(cfg),
                                 resolved.trust_remote_code, batch_slope=False)

    def step_view(self, cfg: Config, act: int, method: EstimateMethod) -> AllocatorView:
        """What the caching allocator's statistics add to the step's own live bytes: replayed from the trace, or for a
        formula estimate a share of its activations reserved (`gpu.ANALYTIC_SLACK_FRACTION`)."""
        if method == TRACE:
            fit = self._fit(cfg)
            view = AllocatorView(rounding=fit.rounding, slack=fit.slack)
            return view.scaled(self.tensor_parallel_share(cfg)) if cfg.tensor_parallel > 1 else view
        return AllocatorView(slack=int(ANALYTIC_SLACK_FRACTION * act))

    def whole_run_view(self, cfg: Config) -> AllocatorView | None:
        """The allocator's view of the whole run at full depth for the runs planner/memory/whole_run.py writes (one
        GPU or DDP, eager, the whole model on the Trainer's loss); None for others."""
        from planner.memory.whole_run import evaluation_view

        key = cfg.model_dump_json(include={"micro_batch", "grad_accum", "world_size", "precision", "checkpointing",
                                           "engine", "tensor_parallel", "compiled"})
        if key not in self._whole_run:
            self._whole_run[key] = evaluation_view(self, cfg)
        return self._whole_run[key]

    def allocator_view(self, cfg: Config, act: int, method: EstimateMethod, states_) -> AllocatorView:
        """Allocated beyond the tensors and reserved beyond allocated: the whole run's replay where it applies
        (`whole_run_view`), else the step's and the model states' replayed apart (or, for formula estimates, a share
        of the activations)."""
        whole = self.whole_run_view(cfg) if method == TRACE else None
        if whole is not None:
            return whole
        return self.step_view(cfg, act, method) + states_view(self.resolved.spec, cfg, states_, self.optimizer)

    def estimate(self, cfg: Config, method: str = AUTO_METHOD) -> MemoryEstimate:
        act, used = self.activations(cfg, method)
        return self.combine(cfg, act, used)

    def combine(self, cfg: Config, act: int, method: EstimateMethod) -> MemoryEstimate:
        states_ = self.states(cfg)
        view = AllocatorView()
        if self.device == "cuda":
            view = self.allocator_view(cfg, act, method, states_)
        return combine(self.resolved.spec, cfg, states_, act, method, self.optimizer, self.device, view, self.gpu,
                       self.gpus_per_node)


def speed_trace_profiles(resolved, req):
    """The speed trace at the smallest depths that show one block (1 and 2; 2 and 4 where blocks alternate), also
    for models shallower than that (the profile is extrapolated to their depth)."""
    from planner.memory.profile import Profile
    from planner.memory.trace import _cached_trace

    spec = resolved.spec
    points = [(depth, _cached_trace(resolved.config, spec.config_hash, depth, req, resolved.trust_remote_code,
                                    profile=True))
              for depth in speed_depths(resolved.config)]
    profiles = [(depth, Profile.from_json(point.profile)) for depth, point in points]
    return profiles[0], profiles[-1]


def speed_depths(config) -> tuple[int, ...]:
    """The depths of the speed trace: 1 and 2 blocks, 2 and 4 where blocks alternate."""
    from planner.memory.trace import TRACED_LAYERS_ALTERNATING

    kinds = getattr(config, "layer_types", None)
    return tuple(dict.fromkeys(TRACED_LAYERS_ALTERNATING if kinds and len(set(kinds)) > 1 else (1, 2)))


def speed_anchor_micro_batch(spec, seq_len: int) -> int:
    """The micro-batch a speed profile is traced at: the smallest from 2 whose token count equals no dimension of
    the model's weights, so that the profile can tell token-proportional dimensions from the weights' own."""
    dims = {spec.hidden, spec.ffn, spec.vocab, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim,
            2 * spec.ffn, 3 * spec.hidden, spec.hidden + 2 * spec.kv_heads * spec.head_dim, spec.num_labels}
    return next(b for b in range(2, 64) if b * seq_len not in dims)


def optimizer_transient(spec, cfg: Config, optimizer: str, device: str) -> int:
    """Temporaries of the optimizer step. torch's CPU default is a per-tensor loop (one parameter's worth); on
    CUDA we plan for fused AdamW (the Trainer's `adamw_torch_fused`), which works in place. DeepSpeed's fused/CPU
    Adam and stateless SGD work in place too."""
    if cfg.sharded or OPTIMIZER[optimizer].state_bytes == 0:
        return 0
    width = cfg.state_width()
    if device == "cpu":
        return 2 * width * spec.largest_layer_parameters
    return width * spec.largest_layer_parameters


def combine(spec, cfg: Config, ms: states.ModelStates, act: int, method: EstimateMethod, optimizer: str,
            device: str, view: AllocatorView = AllocatorView(), gpu=None, gpus_per_node: int | None = None
            ) -> MemoryEstimate:
    """Totals from model states and activations: the peak is the larger of the micro-step's and the optimizer
    step's. The first micro-batch of a step runs with no gradients allocated yet (its traced activations include
    the gradients its backward has made by its peak); later ones (grad_accum > 1) with all of them. On the CPU, host
    memory is the device: what offload keeps there counts too."""
    transient = optimizer_transient(spec, cfg, optimizer, device)
    if cfg.grad_accum > 1 or cfg.sharded:
        tensors = ms.total + max(act, transient)
    else:
        tensors = ms.parameters + ms.optimizer_states + max(act, ms.gradients + transient)
    if device == "cpu":
        tensors += ms.host_tensors
    terms = _terms(spec, cfg, ms, view, transient, device, gpu, gpus_per_node)
    if device == "cuda" and not ESTIMATE[method].measured:
        terms = terms.model_copy(update={"error_margin": int(ACTIVATION_MARGIN * act)})
    peak_allocated = tensors + terms.allocated_overheads
    overhead = terms.allocated_overheads + terms.allocator_slack + terms.outside_allocator
    return MemoryEstimate(
        parameters=ms.parameters, gradients=ms.gradients, optimizer_states=ms.optimizer_states, activations=act,
        overhead=overhead, peak_allocated=peak_allocated, peak=tensors + overhead + terms.error_margin,
        cpu_offload_bytes=ms.cpu_bytes, method=method, device=device, terms=terms,
    )


def model_buffer_bytes(spec, cfg: Config) -> int:
    """The module's registered buffers (attention-mask tables some architectures keep per layer: GPT-Neo's 2048 x 2048
    bool `bias`, 4 MiB a layer), which no engine shards: the floating ones in the working weights' width (casting a
    model to 16 bits casts them, autocast does not)."""
    return spec.other_buffer_bytes + cfg.weight_bytes() * spec.float_buffer_elements


def _terms(spec, cfg: Config, ms: states.ModelStates, view: AllocatorView, transient: int, device: str,
           gpu=None, gpus_per_node: int | None = None) -> MemoryTerms:
    """The model's and the engine's buffers (on any device) and, on CUDA, what the caching allocator and the driver
    add."""
    ddp = ms.gradients if cfg.world_size > 1 and cfg.engine == TORCH else 0  # gradient_as_bucket_view=False
    if ddp and device == "cpu":  # gloo's ring all-reduce works on a copy of one bucket (DDP_BUCKET_CAP_BYTES)
        ddp += min(ms.gradients, DDP_BUCKET_CAP_BYTES)
    zero = 0
    if cfg.engine == DEEPSPEED:
        buckets = DeepSpeedBuckets.for_hidden(spec.hidden)
        live = DS_REDUCE_BUCKETS_LIVE * buckets.reduce_bucket_size + buckets.allgather_bucket_size
        if cfg.zero_stage == 3:
            live += buckets.stage3_prefetch_bucket_size
        elif OFFLOAD[cfg.offload].optimizer_on_cpu:  # the 16-bit gradient partition, beside the estimator's states
            live += spec.trainable_parameters // cfg.world_size
        zero = cfg.weight_bytes() * live
    buffers = model_buffer_bytes(spec, cfg)
    if device != "cuda":
        return MemoryTerms(optimizer_transient=transient, model_buffers=buffers, ddp_buckets=ddp, zero_buckets=zero)
    return MemoryTerms(
        optimizer_transient=transient, model_buffers=buffers,
        cublas_workspace=BLAS_THREADS * cublas_workspace_bytes(gpu), ddp_buckets=ddp, zero_buckets=zero,
        allocator_rounding=view.rounding, allocator_slack=view.slack,
        cuda_context=cuda_context_bytes(gpu), nccl_buffers=nccl_buffer_bytes(gpu, cfg, gpus_per_node))


def nccl_buffer_bytes(gpu, cfg: Config, gpus_per_node: int | None = None) -> int:
    """NCCL's device buffers on each GPU of `cfg`'s run on `gpu` (a catalog entry; None: efficiency.json's defaults),
    `gpus_per_node` to a node (None: all on one): planner/memory/nccl.py."""
    from planner.hardware.efficiency_data import nccl_channels_of
    from planner.memory.nccl import nccl_buffers

    buffers = nccl_buffers(nccl_channels_of(gpu), world_size=cfg.world_size,
                           gpus_per_node=gpus_per_node or cfg.world_size, tensor_parallel=cfg.tensor_parallel,
                           sharded=cfg.sharded)
    return buffers.total


def sequence_fit(evaluation: Evaluation, cfg: Config, seq_lens):
    """Activations as a function of sequence length, fitted from three traces (see trace.SequenceFit)."""
    from planner.memory.trace import trace_sequence_fit

    resolved, spec = evaluation.resolved, evaluation.resolved.spec
    req = evaluation.trace_request(cfg)
    return trace_sequence_fit(resolved.config, spec.config_hash, spec.layers, req, tuple(seq_lens),
                              resolved.trust_remote_code)
