"""`estimate_memory`: model states + activations + device overheads for one configuration, per GPU."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from planner.errors import InputError
from planner.memory import analytic, states
from planner.memory.trace import TraceRequest, trace_activations

MiB = 2**20

# --- GPU view: what a CUDA process holds above its tensors (reference.md, "GPU memory above tensor bytes")
#: CUDA context with lazy module loading (CUDA >= 11.7 default): 0.3-1.5 GiB depending on GPU, driver and
#: kernels loaded; HF measured ~1.3 GB on V100 without lazy loading. We take the middle of the range.
CUDA_CONTEXT_BYTES = 768 * MiB
#: cuBLAS/cuBLASLt workspace, allocated through torch's caching allocator (so in max_memory_allocated):
#: torch's default CUBLAS_WORKSPACE_CONFIG is ":4096:8" = 32 MiB on Hopper-class GPUs, less before.
CUBLAS_WORKSPACE_BYTES = 32 * MiB
#: Caching-allocator slack, reserved - allocated: blocks round to 512 B, large ones live in 2 MiB+
#: segments that the step's changing shapes fragment. A share of what the step allocates and frees.
FRAGMENTATION_FRACTION = 0.10
FRAGMENTATION_FLOOR_BYTES = 64 * MiB
#: NCCL's per-process buffers (NCCL_BUFFSIZE 4 MiB x channels x peers, plus NVLS/proxy buffers); outside
#: the caching allocator. Only with more than one GPU.
NCCL_BUFFER_BYTES = 512 * MiB
#: DeepSpeed communication buckets, in 16-bit elements, as the emitted ds_config sets them (the values
#: transformers' "auto" derives from the hidden size): reduce = allgather = h^2, stage-3 prefetch = 0.9 h^2.
#: overlap_comm double-buffers the reduce bucket.
DS_REDUCE_BUCKETS_LIVE = 2


def ds_bucket_elements(hidden: int) -> dict[str, int]:
    return {"reduce_bucket_size": hidden * hidden, "allgather_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden}


class MemoryEstimate(BaseModel):
    """Bytes per GPU. `peak_allocated` predicts torch.cuda.max_memory_allocated(); `peak` what must fit."""

    model_config = ConfigDict(frozen=True)

    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    overhead: int
    peak_allocated: int
    peak: int
    cpu_offload_bytes: int = 0
    method: str                  # trace | analytic
    device: str                  # cuda | cpu
    terms: dict[str, int] = {}   # the named parts behind the totals

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states


def estimate_memory(
    model, *, micro_batch: int = 1, seq_len: int | None = None, precision: str = "bf16-mixed",
    optimizer: str = "adamw", checkpointing: str = "none", zero_stage: int = 0, offload: str = "none",
    world_size: int = 1, gpus_per_node: int | None = None, attention: str = "sdpa", device: str = "cuda",
    gpu: str | None = None, grad_accum: int = 1, method: str = "auto", trust_remote_code: bool = False,
) -> MemoryEstimate:
    """Per-GPU memory of one training configuration (see shared design: library contract).

    `method`: "trace" runs the model's step under FakeTensorMode (exact for what HF code saves),
    "analytic" uses formulas (< 0.1 s), "auto" traces unless the model cannot be traced.
    """
    from planner.models import resolve_model

    resolved = resolve_model(model, trust_remote_code=trust_remote_code)
    spec = resolved.spec
    _check(micro_batch, seq_len, checkpointing, attention, device, method, world_size, grad_accum)
    try:
        states.validate_choice(precision, optimizer, zero_stage, offload)
    except ValueError as err:
        raise InputError(str(err)) from err
    s = seq_len or spec.seq_len
    ms = states.model_states(
        spec.parameters, spec.trainable_parameters, precision=precision, optimizer=optimizer,
        zero_stage=zero_stage, offload=offload, world_size=world_size, gpus_per_node=gpus_per_node,
        largest_layer=spec.largest_layer_parameters,
        adafactor_elements=_adafactor_elements(resolved) if optimizer == "adafactor" else 0,
    )
    act, used = activations(resolved, micro_batch=micro_batch, seq_len=s, precision=precision,
                            checkpointing=checkpointing, zero_stage=zero_stage, attention=attention, device=device,
                            method=method)
    return combine(spec, ms, act, used, precision=precision, optimizer=optimizer, zero_stage=zero_stage,
                   offload=offload, world_size=world_size, device=device, grad_accum=grad_accum)


def _check(micro_batch, seq_len, checkpointing, attention, device, method, world_size, grad_accum):
    if not isinstance(micro_batch, int) or micro_batch < 1:
        raise InputError("micro_batch must be a positive integer", flag="--micro-batch")
    if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
        raise InputError("seq_len must be a positive integer", flag="--seq-len")
    if checkpointing not in ("none", "selective", "full"):
        raise InputError("checkpointing must be none, selective or full", flag="--checkpointing")
    if attention not in ("eager", "sdpa", "flash"):
        raise InputError("attention must be eager, sdpa or flash", flag="--attention")
    if device not in ("cuda", "cpu"):
        raise InputError("device must be cuda or cpu")
    if method not in ("auto", "trace", "analytic"):
        raise InputError("method must be auto, trace or analytic")
    if world_size < 1 or grad_accum < 1:
        raise InputError("world_size and grad_accum must be >= 1")


def _adafactor_elements(resolved) -> int:
    from planner.models.build import build_meta

    model = resolved.module or build_meta(resolved.config, trust_remote_code=resolved.trust_remote_code)
    return states.adafactor_state_elements(tuple(p.shape) for p in model.parameters() if p.requires_grad)


def activation_precision(precision: str, zero_stage: int) -> str:
    """The trace family for a precision. DeepSpeed's fp16/bf16 engine runs a 16-bit model without
    autocast: activations as bf16-true. fp16 and bf16 tensors have the same bytes, so fp16-mixed shares
    bf16-mixed's trace."""
    if zero_stage > 0 and precision in ("fp16-mixed", "bf16-mixed"):
        return "half-true"
    return "bf16-mixed" if precision == "fp16-mixed" else precision


def trace_request(resolved, *, micro_batch, seq_len, precision, checkpointing, zero_stage, attention,
                  device) -> TraceRequest:
    """The traced program for a configuration: the kernel the model really uses and the activation dtype its
    engine keeps. The optimizer is SGD: states and temporaries are counted by formula, not traced."""
    from planner.models.build import effective_attention

    kernel = effective_attention(resolved.config, "eager" if attention == "eager" else "sdpa",
                                 resolved.trust_remote_code)
    return TraceRequest(
        micro_batch=micro_batch, seq_len=seq_len, precision=activation_precision(precision, zero_stage),
        optimizer="sgd", checkpointing=checkpointing, attention=kernel,
        # GPU flash / mem-efficient kernels apply attention dropout inside the kernel and save no mask;
        # CPU SDPA with dropout falls back to the math path, which does (reference.md)
        attention_dropout=(device == "cpu" or kernel == "eager"), foreach=False,
    )


def activations(resolved, *, micro_batch, seq_len, precision, checkpointing, zero_stage, attention, device,
                method) -> tuple[int, str]:
    """Activation bytes of one micro-batch and the method that produced them. The optimizer plays no part:
    traces step SGD so that no state is created, and optimizer states and temporaries are counted by formula.
    Traces run at this very micro-batch (two depths, extrapolated per block), so they are exact for it."""
    spec = resolved.spec
    req = trace_request(resolved, micro_batch=micro_batch, seq_len=seq_len, precision=precision,
                        checkpointing=checkpointing, zero_stage=zero_stage, attention=attention, device=device)
    if method in ("auto", "trace") and resolved.config is not None:
        try:
            fit = trace_activations(resolved.config, spec.config_hash, spec.layers, req, resolved.trust_remote_code,
                                    batch_slope=False)
            return fit.activations(spec.layers, micro_batch), "trace"
        except Exception as err:  # noqa: BLE001 - any model code failure under fake tensors
            if method == "trace":
                raise InputError(f"tracing {spec.name} failed: {err}", flag="--model",
                                 hint="Use the analytic memory model (method='analytic').") from err
    terms = analytic.activation_bytes(
        spec, micro_batch=micro_batch, seq_len=seq_len, precision=req.precision, attention=req.attention,
        checkpointing=checkpointing, autocast_copies=req.precision in ("fp16-mixed", "bf16-mixed"))
    return sum(terms.values()), "analytic"


def sequence_fit(resolved, *, micro_batch, seq_lens, precision, checkpointing, zero_stage, attention, device="cuda"):
    """Activations as a function of sequence length, fitted from three traces (see trace.SequenceFit)."""
    from planner.memory.trace import trace_sequence_fit

    req = trace_request(resolved, micro_batch=micro_batch, seq_len=seq_lens[-1], precision=precision,
                        checkpointing=checkpointing, zero_stage=zero_stage, attention=attention, device=device)
    spec = resolved.spec
    return trace_sequence_fit(resolved.config, spec.config_hash, spec.layers, req, tuple(seq_lens),
                              resolved.trust_remote_code)


def optimizer_transient(spec, precision: str, optimizer: str, zero_stage: int, device: str) -> int:
    """Temporaries of the optimizer step. torch's CPU default is a per-tensor loop (one parameter's worth);
    on CUDA we plan for fused AdamW (the Trainer default, `adamw_torch_fused`), which works in place.
    DeepSpeed's fused/CPU Adam work in place too."""
    if zero_stage > 0 or optimizer == "sgd":
        return 0
    width = states.HALF_BYTES if precision == "bf16-true" else states.FP32_BYTES
    if device == "cpu":
        return 2 * width * spec.largest_layer_parameters
    return width * spec.largest_layer_parameters


def combine(spec, ms: states.ModelStates, act: int, method: str, *, precision, optimizer, zero_stage, offload,
            world_size, device, grad_accum) -> MemoryEstimate:
    """Totals from model states and activations: the peak is the larger of the micro-step's and the
    optimizer step's. The first micro-batch of a step runs with no gradients allocated yet; later ones
    (grad_accum > 1) with all of them."""
    transient = optimizer_transient(spec, precision, optimizer, zero_stage, device)
    if grad_accum > 1 or zero_stage > 0:
        tensors = ms.total + max(act, transient)
    else:
        tensors = ms.parameters + ms.optimizer_states + max(act, ms.gradients + transient)
    terms = {"optimizer_transient": transient}
    allocated_extra = 0
    if device == "cuda":
        terms["cublas_workspace"] = CUBLAS_WORKSPACE_BYTES
        if world_size > 1 and zero_stage == 0:  # DDP's flat gradient buckets (gradient_as_bucket_view=False)
            terms["ddp_buckets"] = ms.gradients
        if zero_stage > 0:
            width = 2 if precision != "fp32" else 4
            buckets = ds_bucket_elements(spec.hidden)
            live = DS_REDUCE_BUCKETS_LIVE * buckets["reduce_bucket_size"] + buckets["allgather_bucket_size"]
            if zero_stage == 3:
                live += buckets["stage3_prefetch_bucket_size"]
            terms["deepspeed_buckets"] = width * live
        allocated_extra = sum(v for k, v in terms.items() if k != "optimizer_transient")
    peak_allocated = tensors + allocated_extra
    overhead = allocated_extra
    if device == "cuda":
        terms["allocator_fragmentation"] = int(max(FRAGMENTATION_FLOOR_BYTES, FRAGMENTATION_FRACTION * max(act, transient)))
        terms["cuda_context"] = CUDA_CONTEXT_BYTES
        if world_size > 1:
            terms["nccl_buffers"] = NCCL_BUFFER_BYTES
        overhead += terms["allocator_fragmentation"] + terms["cuda_context"] + terms.get("nccl_buffers", 0)
    peak = peak_allocated + (overhead - allocated_extra)
    return MemoryEstimate(
        parameters=ms.parameters, gradients=ms.gradients, optimizer_states=ms.optimizer_states, activations=act,
        overhead=overhead, peak_allocated=peak_allocated, peak=peak, cpu_offload_bytes=ms.cpu_bytes,
        method=method, device=device, terms=terms,
    )
