"""`plan()`: resolve the model and hardware, search, scale the LR, optionally measure, return a Plan."""

from __future__ import annotations

from collections.abc import Callable

from planner import hardware as hw
from planner.errors import InputError, NoFitError
from planner.lr import scale_lr
from planner.memory import states
from planner.search import MemoryEvaluator, SearchSpace, nearest_valid_batches, search
from planner.suggest import suggestions
from planner.types import Candidate, Hardware, LearningRate, Plan

#: Safety margin left free on the card beyond the predicted peak (whose fragmentation term models the
#: caching allocator): covers run-to-run variation of the allocator and of NCCL/driver buffers.
DEFAULT_HEADROOM = 0.05
#: Host memory per node assumed for CPU offload when we plan for another machine: DGX H100/H200/B200 and DGX
#: A100 640GB nodes have 2 TB. Offload holds the optimizer (and parameters) there; DeepSpeed's estimators give
#: the bytes.
DEFAULT_HOST_MEMORY_BYTES = 2 * 2**40
PRECISION_CHOICES = ("auto", *states.PRECISIONS)


def plan(
    model, global_batch: int, *, gpu: str | None = None, gpus_per_node: int | None = None, nodes: int = 1,
    seq_len: int | None = None, optimizer: str = "adamw", precision: str = "auto", micro_batch: int | None = None,
    checkpointing: str | None = None, zero_stage: int | None = None, attention: str = "sdpa",
    offload: bool = True, headroom: float | None = None, lr: float | None = None, lr_batch: int | None = None,
    lr_scaling: str = "auto", memory_method: str = "auto", measure: Callable | None = None,
    trust_remote_code: bool = False, detect: bool = True, probe_budget_s: float | None = None,
    progress: Callable | None = None,
) -> Plan:
    """The fastest configuration that fits (see shared design). Raises InputError or NoFitError."""
    from planner.models import resolve_model

    _check_numbers(global_batch, nodes, gpus_per_node, seq_len, micro_batch, headroom, lr_batch)
    if optimizer not in states.OPTIMIZERS:
        raise InputError(f"unknown optimizer {optimizer!r}", flag="--optimizer",
                         hint=f"Use one of {', '.join(states.OPTIMIZERS)}.")
    hardware = _hardware(gpu, gpus_per_node, nodes, headroom, detect)  # cheap: fail fast on a bad --gpu
    gpu_entry = hw.lookup_gpu(hardware.gpu)
    resolved = resolve_model(model, trust_remote_code=trust_remote_code)
    spec = resolved.spec
    world = hardware.gpus_per_node * hardware.nodes
    if global_batch % world:
        low, high = nearest_valid_batches(global_batch, world)
        raise InputError(f"global batch {global_batch} is not divisible by {world} GPUs", flag="--batch",
                         hint=f"Use a multiple of {world}: the nearest are {low} and {high}.")
    s = seq_len or spec.seq_len
    if spec.max_positions and s > spec.max_positions:
        raise InputError(f"sequence length {s} exceeds the model's {spec.max_positions} positions", flag="--seq-len")
    space = SearchSpace(
        global_batch=global_batch, world_size=world, gpus_per_node=hardware.gpus_per_node,
        precisions=_precisions(precision, gpu_entry), checkpointing=_checkpointing(checkpointing),
        zero_stages=_zero_stages(zero_stage, world, offload), allow_offload=offload, micro_batch=micro_batch,
    )
    if micro_batch and (global_batch // world) % micro_batch:
        raise InputError(f"micro-batch {micro_batch} does not divide the per-GPU batch {global_batch // world}",
                         flag="--micro-batch", hint="Pick a divisor of global batch / number of GPUs.")
    evaluator = MemoryEvaluator(resolved, seq_len=s, optimizer=optimizer, attention=attention,
                                gpus_per_node=hardware.gpus_per_node, method=memory_method)
    ranked = search(resolved, gpu_entry, space, evaluator, hardware.budget_bytes, attention,
                    host_budget=hardware.host_memory_bytes)
    if precision == "auto" and not gpu_entry.bf16:  # say why bf16 is absent, as a rejected option
        ranked.append(Candidate(config=ranked[0].config.model_copy(update={"precision": "bf16-mixed"}), memory=None,
                                throughput=None, fits=False,
                                reason=f"no bf16 on {gpu_entry.name} (compute capability "
                                       f"{gpu_entry.compute_capability} < 8.0)"))
    notes = [hardware.note] if hardware.note else []
    notes += _precision_notes(precision, gpu_entry)
    lr_args = (lr, lr_batch, lr_scaling, optimizer, spec, global_batch)
    draft = Plan(model=_model_json(spec, s), hardware=hardware, seq_len=s, optimizer=optimizer, attention=attention,
                 choice=ranked[0], candidates=tuple(ranked), lr=_lr(ranked[0], *lr_args)[0], notes=tuple(notes))
    if not ranked[0].fits:
        raise NoFitError(f"no configuration of {spec.name} fits {world} x {gpu_entry.name} at global batch "
                         f"{global_batch}, sequence {s}", suggestions=suggestions(draft, evaluator, gpu_entry),
                         plan=draft)
    if measure is not None:
        from planner.refine import DEFAULT_PROBE_BUDGET_S, refine_with_measurements

        draft = refine_with_measurements(draft, measure, resolved, progress=progress,
                                         budget_s=DEFAULT_PROBE_BUDGET_S if probe_budget_s is None else probe_budget_s)
    lr_info, lr_notes = _lr(draft.choice, *lr_args)
    candidates = tuple(_with_lr(c, lr_args) for c in draft.candidates)
    return draft.model_copy(update={"lr": lr_info, "notes": draft.notes + lr_notes, "choice": candidates[0],
                                    "candidates": candidates})


def _check_numbers(global_batch, nodes, gpus_per_node, seq_len, micro_batch, headroom, lr_batch):
    for value, flag in ((global_batch, "--batch"), (nodes, "--nodes"), (gpus_per_node, "--gpus-per-node"),
                        (seq_len, "--seq-len"), (micro_batch, "--micro-batch"), (lr_batch, "--lr-batch")):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InputError(f"must be a positive integer, got {value!r}", flag=flag)
    if headroom is not None and not (0.0 <= headroom < 0.9):
        raise InputError(f"must be a fraction in [0, 0.9), got {headroom}", flag="--headroom")


def _hardware(gpu, gpus_per_node, nodes, headroom, detect) -> Hardware:
    detected = hw.detect_gpus() if detect else None
    frac = DEFAULT_HEADROOM if headroom is None else headroom
    note = ""
    if gpu:
        entry = hw.lookup_gpu(gpu)
        is_local = detected is not None and detected.gpu.name == entry.name
    elif detected:
        entry, is_local = detected.gpu, True
    else:
        entry, is_local = hw.lookup_gpu(hw.REFERENCE_GPU), False
        note = f"No GPU detected and no --gpu given: planning for the reference {entry.name}."
    count = gpus_per_node or (detected.count if is_local else 1)
    budget = int(entry.memory_bytes * (1 - frac))
    if is_local and detected.free_bytes:
        budget = min(budget, int(min(detected.free_bytes) * (1 - frac)))
    host = _local_host_memory() if is_local else DEFAULT_HOST_MEMORY_BYTES
    return Hardware(gpu=entry.name, gpu_memory_bytes=entry.memory_bytes, gpus_per_node=count, nodes=nodes,
                    detected=is_local, budget_bytes=budget, headroom=frac, host_memory_bytes=host, note=note)


def _local_host_memory() -> int:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return DEFAULT_HOST_MEMORY_BYTES


def _precisions(precision: str, gpu) -> tuple[str, ...]:
    if precision not in PRECISION_CHOICES:
        raise InputError(f"unknown precision {precision!r}", flag="--precision",
                         hint=f"Use one of {', '.join(PRECISION_CHOICES)}.")
    if precision == "auto":
        return ("bf16-mixed", "fp16-mixed", "fp32") if gpu.bf16 else ("fp16-mixed", "fp32")
    if precision.startswith("bf16") and not gpu.bf16:
        raise InputError(f"{gpu.name} has no bf16 (compute capability {gpu.compute_capability} < 8.0)",
                         flag="--precision", hint="Use fp16-mixed (with loss scaling) or fp32.")
    return (precision,)


def _precision_notes(precision: str, gpu) -> list[str]:
    if precision == "auto" and not gpu.bf16:
        return [f"{gpu.name} has no bf16 (compute capability {gpu.compute_capability}): mixed precision is fp16 "
                "with dynamic loss scaling."]
    return []


def _checkpointing(value: str | None) -> tuple[str, ...]:
    if value is None:
        return ("none", "selective", "full")
    if value not in ("none", "selective", "full"):
        raise InputError(f"unknown checkpointing {value!r}", flag="--checkpointing", hint="Use none, selective or full.")
    return (value,)


def _zero_stages(value: int | None, world: int, offload: bool) -> tuple[int, ...]:
    if value is None:
        return (0, 1, 2, 3) if world > 1 else ((0, 2, 3) if offload else (0,))
    if value not in (0, 1, 2, 3):
        raise InputError(f"ZeRO stage must be 0-3, got {value}", flag="--zero-stage")
    if value > 0 and world == 1 and not offload:
        raise InputError("ZeRO on one GPU only helps with offload", flag="--zero-stage",
                         hint="Drop --no-offload, or use --zero-stage 0.")
    return (value,)


def _with_lr(candidate: Candidate, lr_args) -> Candidate:
    info, _ = _lr(candidate, *lr_args)
    return candidate.model_copy(update={"learning_rate": info.learning_rate, "lr_scaling": info.scaling})


def _model_json(spec, seq_len: int) -> dict:
    return {"name": spec.name, "parameters": spec.parameters, "trainable_parameters": spec.trainable_parameters,
            "layers": spec.layers, "hidden": spec.hidden, "heads": spec.heads, "kv_heads": spec.kv_heads,
            "vocab": spec.vocab, "seq_len": seq_len, "architecture": spec.architecture, "source": spec.source,
            "has_batchnorm": spec.has_batchnorm, "layer_class": spec.layer_class}


def _lr(choice, lr, lr_batch, lr_scaling, optimizer, spec, global_batch) -> tuple[LearningRate, tuple[str, ...]]:
    """Scale the base LR from the batch it was tuned at (default: micro-batch x GPUs, i.e. scale by N)."""
    cfg = choice.config
    ref = lr_batch or cfg.micro_batch * cfg.world_size
    d = scale_lr(lr, global_batch, ref, lr_scaling, optimizer, spec.has_batchnorm, cfg.micro_batch)
    info = LearningRate(learning_rate=d.learning_rate, base_lr=d.base_lr, reference_batch=d.reference_batch,
                        scaling=d.scaling, factor=d.factor, warmup_steps=d.warmup_steps)
    return info, d.notes
