"""`plan()`: resolve the model and hardware, search, scale the LR, optionally measure, return a Plan."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from planner import hardware as hw
from planner.config import Config
from planner.errors import InputError, NoFitError
from planner.hardware.efficiency_data import efficiency_of
from planner.lr import scale_lr
from planner.memory.analytic import tensor_parallel_share
from planner.memory.estimate import Evaluation
from planner.models import resolve_model
from planner.models.build import model_class
from planner.refine import DEFAULT_PROBE_BUDGET_S, refine_with_measurements
from planner.request import LIMITS
from planner.search import MemoryEvaluator, SearchSpace, nearest_valid_batches, search
from planner.speed.model import SpeedModel
from planner.suggest import suggestions
from planner.types import Candidate, Hardware, LearningRate, ModelInfo, Plan
from planner.vocab import (
    ADAPTER, ATTENTION, AUTO, AUTO_METHOD, CHECKPOINTING, COMPILE, COMPILE_OFF, DEEPSPEED, DEFAULT_OPTIMIZER,
    DEFAULT_PRECISION, DEFAULT_SHARDING_ENGINE, ENGINE, FP32, FULL, LR_SCALING, MEMORY_METHOD, NO_ADAPTER, NO_OFFLOAD,
    OFFLOAD, OPTIMIZER, PRECISION, SDPA, SHARDING_ENGINES, TASK, TF32, TOKEN_LABELS, TOKEN_TARGETS,
)

#: Safety margin left free on the card beyond the predicted peak (whose fragmentation term models the
#: caching allocator): covers run-to-run variation of the allocator and of NCCL/driver buffers.
DEFAULT_HEADROOM = 0.05
#: Host memory per node assumed for CPU offload when we plan for another machine: DGX H100/H200/B200 and DGX
#: A100 640GB nodes have 2 TB (NVIDIA DGX H100 datasheet, "System memory: 2TB"). Offload holds the optimizer (and
#: parameters) there; DeepSpeed's estimators give the bytes.
DEFAULT_HOST_MEMORY_BYTES = 2 * 2**40


def plan(
    model, global_batch: int, *, gpu: str | None = None, gpus_per_node: int | None = None, nodes: int = 1,
    seq_len: int | None = None, optimizer: str = DEFAULT_OPTIMIZER, precision: str = AUTO, micro_batch: int | None = None,
    checkpointing: str | None = None, zero_stage: int | None = None, attention: str = SDPA,
    offload: bool | str = True, headroom: float | None = None, lr: float | None = None, lr_batch: int | None = None,
    lr_scaling: str = AUTO, memory_method: str = AUTO_METHOD, measure: Callable | None = None,
    trust_remote_code: bool = False, detect: bool = True, probe_budget_s: float | None = None,
    progress: Callable | None = None, engine: str = DEFAULT_SHARDING_ENGINE, host_memory: int | None = None,
    nic_gbps: float | None = None, task: str | None = None, num_labels: int | None = None, adapter=None,
    train_tokens: float | None = None, train_steps: int | None = None, compile: str = AUTO,
) -> Plan:
    """The fastest configuration that fits (see the README's library section). Raises InputError or NoFitError.
    `task`/`num_labels` plan another head; `adapter` (planner.Adapter) LoRA or QLoRA over the frozen model;
    `train_tokens` or `train_steps`, the run's length, sizes the LR warmup and spreads torch.compile's compile time;
    `compile` (`vocab.COMPILE`) plans the step eager, compiled, or both; `nic_gbps`: your inter-node Gb/s per GPU."""

    _check_numbers(global_batch, nodes, gpus_per_node, seq_len, micro_batch, headroom, lr_batch, host_memory, nic_gbps)
    _check_choices(optimizer, precision, checkpointing, attention, lr_scaling, memory_method, engine, compile)
    offloads = _offloads(offload)
    hardware = _hardware(gpu, gpus_per_node, nodes, headroom, detect, host_memory, nic_gbps)  # a bad --gpu fails here
    gpu_entry = hw.lookup_gpu(hardware.gpu).model_copy(update={"nic_Gbps": nic_gbps})
    resolved = resolve_model(model, trust_remote_code=trust_remote_code, task=task, num_labels=num_labels,
                             adapter=adapter)
    world = hardware.gpus_per_node * hardware.nodes
    s = _sequence(seq_len, resolved.spec)
    run_steps = _run_steps(train_tokens, train_steps, global_batch, s)
    tp_sizes, tp_note = tensor_parallel_sizes(resolved, hardware.gpus_per_node)
    space = replace(_space(global_batch, world, hardware, gpu_entry, precision, checkpointing, zero_stage, offloads,
                           micro_batch, engine, attention, optimizer, resolved.spec.adapter), tensor_parallel=tp_sizes,
                    compiled=_compiled(compile, run_steps), train_steps=run_steps)
    evaluation = Evaluation(resolved, seq_len=s, optimizer=optimizer, attention=attention,
                            gpus_per_node=hardware.gpus_per_node, gpu=gpu_entry)
    evaluator = MemoryEvaluator(evaluation, memory_method)
    ranked = search(gpu_entry, space, evaluator, hardware.budget_bytes, host_budget=hardware.host_memory_bytes)
    ranked += _hardware_rejections(precision, gpu_entry, ranked[0])
    notes = _plan_notes(precision, gpu_entry, evaluation, hardware, ranked, tp_note)
    notes += _compile_notes(compile, evaluation, gpu_entry, hardware.gpus_per_node, ranked[0], run_steps)
    lr_args = (lr, lr_batch, lr_scaling, optimizer, resolved.spec, global_batch, run_steps)
    draft = Plan(model=ModelInfo.of(resolved.spec, s, resolved.adapter), hardware=hardware, seq_len=s,
                 optimizer=optimizer, attention=attention, choice=ranked[0], candidates=tuple(ranked),
                 lr=_lr(ranked[0], *lr_args)[0], notes=notes)
    if not ranked[0].fits:
        raise NoFitError(f"no configuration of {resolved.spec.name} fits {world} x {gpu_entry.name} at global batch "
                         f"{global_batch}, sequence {s}", suggestions=suggestions(draft, evaluator, gpu_entry),
                         plan=draft)
    if measure is not None:
        draft = _measured(draft, measure, resolved, evaluator, progress, probe_budget_s)
    return _finish(_with_learning_rates(draft, lr_args), resolved)


def _measured(draft: Plan, measure, resolved, evaluator, progress, probe_budget_s) -> Plan:
    """The plan refined by measurements of its top candidates (QLoRA plans are not probed: `QLORA_NOT_PROBED`)."""
    if ADAPTER[resolved.spec.adapter].quantized_base:
        return draft.model_copy(update={"notes": draft.notes + (QLORA_NOT_PROBED,)})

    budget_s = DEFAULT_PROBE_BUDGET_S if probe_budget_s is None else probe_budget_s
    return refine_with_measurements(draft, measure, resolved, progress=progress, budget_s=budget_s,
                                    estimate=evaluator.estimate)


def _plan_notes(precision: str, gpu, evaluation, hardware: Hardware, ranked: list[Candidate],
                tp_note: str) -> tuple[str, ...]:
    """The notes that depend on the search's ranking."""
    spec, world = evaluation.resolved.spec, hardware.gpus_per_node * hardware.nodes
    notes = ((hardware.note,) if hardware.note else ()) + _precision_notes(precision, gpu)
    notes += _tf32_note(precision, gpu, evaluation, hardware.gpus_per_node, ranked[0])
    notes += _parallelism_notes(tp_note, ranked, hardware)
    return notes + _host_note(hardware, ranked[0]) + _moe_note(spec, ranked[0]) + _qlora_note(spec, world)


def _finish(result: Plan, resolved) -> Plan:
    """The notes that depend on the final choice: how the loss is normalised over the accumulated micro-batches,
    and the fp16 loss-scaling policy."""
    notes = _loss_normalisation_note(result, resolved) + _loss_scaling_note(result) + _optimizer_note(result)
    return result.model_copy(update={"notes": result.notes + notes}) if notes else result


def _loss_normalisation_note(result: Plan, resolved) -> tuple[str, ...]:
    """Token-level losses over N micro-batches: the Trainer passes `num_items_in_batch` (the labelled tokens of all
    N) to a model that accepts loss kwargs, so each micro-batch's summed loss is divided by the step's tokens
    (transformers/trainer.py: `get_batch_samples` counts them, `training_step` skips its own division by N when the
    model normalised; the model accepts them if its class says `accepts_loss_kwargs` or its forward takes
    **kwargs)."""
    cfg = result.choice.config
    if cfg.grad_accum == 1 or TASK[result.model.task].labels not in (TOKEN_TARGETS, TOKEN_LABELS):
        return ()
    pitfall = ("averaging each micro-batch's mean loss and dividing by N weights the tokens of short micro-batches "
               "more than those of long ones")
    if resolved.config is not None and _accepts_loss_kwargs(resolved):
        return (f"Loss over the {cfg.grad_accum} accumulated micro-batches: the Trainer (and the shipped script) "
                f"divides each micro-batch's summed token loss by the labelled tokens of all {cfg.grad_accum} "
                f"(num_items_in_batch), so the step's gradient is that of one batch of {cfg.global_batch}; {pitfall}. "
                "In a loop of your own, pass num_items_in_batch=<labelled tokens of the step> to the model.",)
    return (f"Loss over the {cfg.grad_accum} accumulated micro-batches: {result.model.architecture} takes no "
            f"num_items_in_batch, so the Trainer averages per-micro-batch means: {pitfall}. Pass a "
            "compute_loss_func that sums token losses and divides by the step's tokens.",)


def _accepts_loss_kwargs(resolved) -> bool:
    """The Trainer's own test (transformers/trainer.py, "Model introspection")."""
    import inspect

    cls = model_class(resolved.config, resolved.trust_remote_code)
    cls = getattr(cls, "auto", cls)
    if hasattr(cls, "accepts_loss_kwargs"):
        return bool(cls.accepts_loss_kwargs)
    forward = getattr(cls, "forward", None)
    return forward is not None and any(p.kind == inspect.Parameter.VAR_KEYWORD
                                       for p in inspect.signature(forward).parameters.values())


def _optimizer_note(result: Plan) -> tuple[str, ...]:
    """How an optimizer the Trainer cannot name is trained (LAMB), or that it cannot be emitted (Sophia)."""
    info = OPTIMIZER[result.optimizer]
    if info.trainer is not None:
        return ()
    if info.client is None:
        return (f"{result.optimizer}: planned for memory and speed; no library here implements it, so --emit "
                "refuses (the files would train another optimizer).",)
    return (f"{result.optimizer}: the Trainer has no name for it; training_args.json's optim is a placeholder: pass "
            f"Trainer(..., optimizers=(plan.create_optimizer(model), None)) ({info.client}; the shipped script "
            "does). Warm up whenever the LR is scaled up.",)


def _loss_scaling_note(result: Plan) -> tuple[str, ...]:
    policy = result.loss_scaling()
    if policy is None:
        return ()
    if policy["engine"] == DEEPSPEED:
        rule = (f"DeepSpeed's dynamic scale starts at 2^{policy['initial_scale_power']}, halves on an overflow after "
                f"{policy['hysteresis']} in a row (the step is skipped), doubles after {policy['loss_scale_window']} "
                f"clean steps, never below {policy['min_loss_scale']}")
    else:
        rule = (f"torch's GradScaler starts at {policy['init_scale']:.0f}, halves on inf/NaN gradients (the step is "
                f"skipped), doubles after {policy['growth_interval']} clean steps")
    return (f"fp16 loss scaling: {rule}; gradients are clipped to {policy['clip_grad_norm_after_unscale']} after "
            "unscaling (plan.json 'loss_scaling'). A few skipped steps early on are normal; if the loss goes NaN or "
            "the scale keeps falling, lower the LR or lengthen warmup, keep clipping, and use bf16 where the GPU has "
            "it.",)


#: A probe builds the model with random weights, and bitsandbytes quantises a checkpoint as transformers loads it.
QLORA_NOT_PROBED = ("QLoRA plans are not probed: the probe's model has random weights, which bitsandbytes does not "
                    "quantise (it quantises a checkpoint as it loads it); the plan is the model's.")


def _check_numbers(global_batch, nodes, gpus_per_node, seq_len, micro_batch, headroom, lr_batch,
                   host_memory=None, nic_gbps=None):
    for value, flag, limit in ((global_batch, "--batch", LIMITS.batch), (nodes, "--nodes", LIMITS.nodes),
                               (gpus_per_node, "--gpus-per-node", LIMITS.gpus_per_node),
                               (seq_len, "--seq-len", LIMITS.seq_len), (micro_batch, "--micro-batch", LIMITS.batch),
                               (lr_batch, "--lr-batch", LIMITS.batch)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InputError(f"must be a positive integer, got {value!r}", flag=flag)
        if value is not None and value > limit:
            raise InputError(f"{value} is above the supported {limit:,}", flag=flag,
                             hint=f"trainplan plans for at most {limit:,}; check the value.")
    if gpus_per_node is not None and gpus_per_node * nodes > LIMITS.world_size:
        raise InputError(f"{gpus_per_node * nodes} GPUs in all is above the supported {LIMITS.world_size:,}",
                         flag="--nodes")
    if host_memory is not None and not host_memory > 0:
        raise InputError(f"must be a positive number of bytes, got {host_memory}", flag="--host-memory")
    if nic_gbps is not None and (isinstance(nic_gbps, bool) or not isinstance(nic_gbps, (int, float))
                                 or not 0 < nic_gbps <= LIMITS.nic_gbps):
        raise InputError(f"must be a bandwidth in Gb/s from above 0 to {LIMITS.nic_gbps:,}, got {nic_gbps!r}",
                         flag="--nic-gbps", hint="Give the inter-node bandwidth per GPU, e.g. 200 for one HDR "
                                                 "InfiniBand NIC per GPU, 50 for AWS p4d's EFA.")
    if headroom is not None and not (0.0 <= headroom < 0.9):
        raise InputError(f"must be a fraction in [0, 0.9), got {headroom}", flag="--headroom")


def _check_choices(optimizer, precision, checkpointing, attention, lr_scaling, memory_method, engine, compile=AUTO):
    for value, table, flag in ((optimizer, OPTIMIZER, "--optimizer"), (precision, {AUTO: None, **PRECISION},
                               "--precision"), (checkpointing, CHECKPOINTING, "--checkpointing"),
                               (attention, ATTENTION, "--attention"), (lr_scaling, LR_SCALING, "--lr-scaling"),
                               (memory_method, MEMORY_METHOD, "--memory-method"),
                               (engine, dict.fromkeys(SHARDING_ENGINES), "--engine"), (compile, COMPILE, "--compile")):
        if value is not None and value not in table:
            raise InputError(f"unknown value {value!r}", flag=flag, hint=f"Use one of {', '.join(table)}.")


def _sequence(seq_len: int | None, spec) -> int:
    s = seq_len or spec.seq_len
    if spec.max_positions and s > spec.max_positions:
        raise InputError(f"sequence length {s} exceeds the model's {spec.max_positions} positions", flag="--seq-len")
    return s


def _offloads(offload: bool | str) -> tuple[str, ...]:
    """The offloads the search may use: all (True), none (False), or the one asked for."""
    if offload is True:
        return tuple(OFFLOAD)
    if offload is False:
        return (NO_OFFLOAD,)
    if offload not in OFFLOAD:
        raise InputError(f"unknown offload {offload!r}", flag="--offload", hint=f"Use one of {', '.join(OFFLOAD)}.")
    return (offload,)


def _space(global_batch, world, hardware, gpu_entry, precision, checkpointing, zero_stage, offloads, micro_batch,
           engine, attention, optimizer, adapter=NO_ADAPTER) -> SearchSpace:
    if global_batch % world:
        low, high = nearest_valid_batches(global_batch, world)
        raise InputError(f"global batch {global_batch} is not divisible by {world} GPUs", flag="--batch",
                         hint=f"Use a multiple of {world}: the nearest are {low} and {high}.")
    if micro_batch and (global_batch // world) % micro_batch:
        raise InputError(f"micro-batch {micro_batch} does not divide the per-GPU batch {global_batch // world}",
                         flag="--micro-batch", hint="Pick a divisor of global batch / number of GPUs.")
    return SearchSpace(
        global_batch=global_batch, world_size=world, gpus_per_node=hardware.gpus_per_node,
        precisions=_precisions(precision, gpu_entry, attention), checkpointing=tuple(CHECKPOINTING) if checkpointing is None
        else (checkpointing,), zero_stages=_zero_stages(zero_stage, world, offloads, engine), offloads=offloads,
        micro_batch=micro_batch, engine=engine, optimizer=optimizer, adapter=adapter)


def _moe_note(spec, choice) -> tuple[str, ...]:
    cfg = choice.config
    if spec.num_experts <= 1 or not (cfg.engine == DEEPSPEED and cfg.zero_stage == 3):
        return ()
    return (f"Mixture of experts under ZeRO-3: {spec.experts_per_token} of {spec.num_experts} experts run per token "
            f"in a data-dependent order, so plan.prepare(model) marks each MoE block a ZeRO-3 leaf "
            f"(deepspeed.utils.set_z3_leaf_modules): entering it gathers all its experts at once. Without "
            f"plan.prepare, call that yourself.",)


def _qlora_note(spec, world: int) -> tuple[str, ...]:
    if not ADAPTER[spec.adapter].quantized_base:
        return ()
    sharded = Config.of(micro_batch=1, grad_accum=1, world_size=world, precision=DEFAULT_PRECISION,
                        checkpointing=FULL, zero_stage=3, offload=NO_OFFLOAD).adapter_problem(spec.adapter)
    ddp = (f"Only DDP was planned: {sharded}.",) if world > 1 and sharded else ()
    return ddp + ("QLoRA: load the base with plan.bnb_config() and call plan.prepare(model), which keeps the "
                  "unquantised weights 16-bit. peft's prepare_model_for_kbit_training (TRL's SFTTrainer calls it for a "
                  "4-bit model) upcasts them, and so the logits, to fp32: 4.3 GB more for Mistral-7B at micro-batch 4 "
                  "x 4096 in fms-acceleration's published runs (benchmarks/peft_memory.py); pass the prepared "
                  "PeftModel instead.",)


def _host_note(hardware: Hardware, choice) -> tuple[str, ...]:
    """Name the host RAM an offload plan was checked against when it was assumed, not measured or given."""
    if hardware.host_memory_source != "assumed" or not (choice.memory and choice.memory.cpu_offload_bytes):
        return ()
    return (f"Offload holds {choice.memory.cpu_offload_bytes / 2**30:.1f} GiB per node in host RAM; it was checked "
            f"against an assumed {hardware.host_memory_bytes / 2**40:.0f} TiB node (DGX); give --host-memory GB for "
            f"yours.",)


def _hardware(gpu, gpus_per_node, nodes, headroom, detect, host_memory=None, nic_gbps=None) -> Hardware:
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
    if host_memory is not None:
        host, source = host_memory, "given"
    elif is_local:
        host, source = _local_host_memory(), "this machine"
    else:
        host, source = DEFAULT_HOST_MEMORY_BYTES, "assumed"
    network = efficiency_of(entry.model_copy(update={"nic_Gbps": nic_gbps}))
    return Hardware(gpu=entry.name, gpu_memory_bytes=entry.memory_bytes, gpus_per_node=count, nodes=nodes,
                    detected=is_local, budget_bytes=budget, headroom=frac, host_memory_bytes=host,
                    host_memory_source=source, network_Gbps=network.nic_GBps * 8, network_source=network.network,
                    note=note)


def _local_host_memory() -> int:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return DEFAULT_HOST_MEMORY_BYTES


def _precisions(precision: str, gpu, attention: str) -> tuple[str, ...]:
    """The precisions to search: those `auto` may choose that the GPU can run, else the one asked for, if the GPU
    can run it (with the attention implementation asked for)."""
    wanted = [p for p, info in PRECISION.items() if info.in_auto] if precision == AUTO else [precision]
    problems = {p: gpu.cannot_run(p, attention) for p in wanted}
    usable = tuple(p for p in wanted if not problems[p])
    if not usable:
        problem = problems[wanted[0]]
        flag = "--attention" if "FlashAttention" in problem else "--precision"
        raise InputError(problem, flag=flag, hint="Use fp16-mixed (with loss scaling) or fp32."
                         if flag == "--precision" else "Use --attention sdpa.")
    return _without_loss_scaling_twins(usable) if precision == AUTO else usable


def _without_loss_scaling_twins(precisions: tuple[str, ...]) -> tuple[str, ...]:
    """`auto` leaves out a loss-scaled precision where a twin runs without loss scaling (fp16-mixed where the GPU has
    bf16-mixed): the same bytes and tensor-core rate, without the GradScaler's skipped steps; asked for by name, it is
    planned."""
    def twin(p: str, q: str) -> bool:
        a, b = PRECISION[p], PRECISION[q]
        same_program = a.weight_bytes == b.weight_bytes and (a.autocast is None) == (b.autocast is None)
        return q != p and same_program and not b.loss_scaling

    return tuple(p for p in precisions if not (PRECISION[p].loss_scaling and any(twin(p, q) for q in precisions)))


def _hardware_rejections(precision: str, gpu, first: Candidate) -> list[Candidate]:
    """Precisions the GPU cannot run, as rejected options that say why (bf16 on a V100 or T4)."""
    if precision != AUTO:
        return []
    return [Candidate(config=first.config.model_copy(update={"precision": p}), memory=None, throughput=None,
                      fits=False, reason=problem)
            for p, info in PRECISION.items() if info.in_auto and (problem := gpu.cannot_run(p))]


def _precision_notes(precision: str, gpu) -> tuple[str, ...]:
    notes = ()
    if precision == AUTO and any(gpu.cannot_run(p) for p, info in PRECISION.items() if info.in_auto and info.autocast):
        notes += (f"{gpu.name} has no bf16 (compute capability {gpu.compute_capability}): mixed precision is fp16 "
                  "with dynamic loss scaling.",)
    return notes


def tensor_parallel_sizes(resolved, gpus_per_node: int) -> tuple[tuple[int, ...], str]:
    """Tensor-parallel sizes worth planning within a node, and why there are none: the model's transformers TP plan
    (`config.base_model_tp_plan`, which `from_pretrained(tp_plan="auto")` applies) must exist, and a size must divide
    the node's GPUs and the attention and key/value heads it splits."""
    spec, config = resolved.spec, resolved.config
    if gpus_per_node < 2:
        return (), ""
    plan_ = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if not plan_:
        return (), (f"No tensor parallelism: {spec.architecture} has no tensor-parallel plan in this transformers "
                    "(config.base_model_tp_plan), which accelerate's TP needs.")
    sizes = tuple(t for t in (2, 4, 8, 16, 32, 64) if t <= gpus_per_node and gpus_per_node % t == 0
                  and spec.heads % t == 0 and spec.kv_heads % t == 0)
    return sizes, "" if sizes else f"No tensor parallelism: no size divides {spec.kv_heads} key/value heads."


def _parallelism_notes(tp_note: str, ranked: list[Candidate], hardware: Hardware) -> tuple[str, ...]:
    notes = (tp_note,) if tp_note else ()
    choice = ranked[0]
    cfg = choice.config
    if cfg.tensor_parallel > 1 and choice.fits:
        plain = next((c for c in ranked if c.fits and c.config.tensor_parallel == 1 and c.throughput), None)
        why = (f" It runs {choice.throughput.tokens_per_s / plain.throughput.tokens_per_s:.2f}x the tokens/s of the "
               f"fastest plan without tensor parallelism ({plain.config.label()}): each GPU keeps 1/"
               f"{cfg.tensor_parallel} of every layer's activations, so larger micro-batches fit, and FSDP gathers "
               f"1/{cfg.tensor_parallel} of the weights over fewer ranks." if plain else "")
        notes += (f"Tensor parallel {cfg.tensor_parallel} x FSDP2 {cfg.data_parallel}.{why} Load the model with "
                  "from_pretrained(..., tp_plan=\"auto\") under the launcher (plan.from_pretrained_kwargs()); the "
                  "Trainer then builds accelerate's ParallelismConfig from it, as accelerate_config.yaml says.",)
    if hardware.nodes > 1 and choice.fits:
        notes += ("Pipeline parallelism (layers split across nodes) is not planned: transformers and accelerate have "
                  "no pipeline schedule for training HF models; it would be needed where a model's layers do not "
                  "fit a node even fully sharded (use torchtitan or Megatron-LM there).",)
    return notes


def _tf32_note(precision: str, gpu, evaluation, gpus_per_node: int, choice: Candidate) -> tuple[str, ...]:
    """With fp32 asked for on a GPU with TF32 tensor cores: what TF32 would gain on the chosen configuration."""
    if precision != FP32 or gpu.cannot_run(TF32) or not choice.fits or choice.throughput is None:
        return ()
    faster = SpeedModel(evaluation.workload, gpu, gpus_per_node)(choice.config.model_copy(update={"precision": TF32}))
    gain = choice.throughput.step_time_s / faster.step_time_s
    return (f"{gpu.name} has TF32 tensor cores: --precision tf32 keeps fp32 weights, gradients and memory and runs "
            f"the matmuls on them (10-bit mantissa inputs, fp32 accumulation): step {faster.step_time_s:.2f} s "
            f"instead of {choice.throughput.step_time_s:.2f} s, {gain:.2f}x faster (modelled).",)


def _compiled(compile: str, run_steps: int | None) -> tuple[bool, ...]:
    """Eager and/or compiled candidates: auto weighs compiling only when the run's length says what it costs."""
    return COMPILE[compile].candidates if compile != AUTO or run_steps else (False,)


def _compile_notes(compile: str, evaluation, gpu, gpus_per_node: int, choice: Candidate,
                   run_steps: int | None) -> tuple[str, ...]:
    """torch.compile on the chosen configuration: its modelled step against eager, its compile time and when that
    pays off, and what it saves in memory."""
    if compile == COMPILE_OFF or not choice.fits or choice.throughput is None:
        return ()
    if run_steps is None and compile == AUTO:  # tracing the compiled program costs seconds: only when it is weighed
        return ("torch.compile not weighed: --compile auto weighs its compile time against what it saves per step "
                "once the run's length is given (--train-steps or --train-tokens); --compile on plans it.",)
    cfg, spec = choice.config, evaluation.resolved.spec
    effect = evaluation.workload.compile_effect(cfg)
    if effect is None:
        return ("torch.compile: the model's graph could not be captured here, so a compiled step is modelled as the "
                "eager one.",) if cfg.compiled else ()
    speed = SpeedModel(evaluation.workload, gpu, gpus_per_node)  # per step, compile time apart
    eager, compiled = (speed(cfg.model_copy(update={"compiled": on})).step_time_s for on in (False, True))
    seconds = effect.compile_seconds(spec.layers)
    text = (f"torch.compile (Inductor): step {compiled:.3g} s compiled vs {eager:.3g} s eager "
            f"({eager / compiled:.2f}x, modelled); the first step compiles for about {seconds:.0f} s")
    if eager > compiled:
        text += f", repaid after {seconds / (eager - compiled):,.0f} steps"
    if cfg.compiled:
        saved = effect.saved_less(spec.layers, cfg.micro_batch) if cfg.compile_saves_activations() else 0
        saved *= tensor_parallel_share(evaluation.workload, cfg) if cfg.tensor_parallel > 1 else 1.0
        text = (f"Compiled. {text}." + (f" Inductor's partitioner keeps {saved / 2**30:.2f} GiB less for the "
                                         "backward (it recomputes elementwise values); the memory planned is eager's: "
                                         "on the CPU the step's peak fell by 0.6-1.5x that (benchmarks/compile_cpu.py)."
                                         if saved > 0 else "")
                + " Keep the batch shapes fixed (pad to one length): a new shape recompiles.")
    else:
        text += f"; over this run's {run_steps:,} steps eager is faster." if run_steps else "."
    return (text,)


def _zero_stages(value: int | None, world: int, offloads: tuple[str, ...], engine: str) -> tuple[int, ...]:
    offload = any(OFFLOAD[o].optimizer_on_cpu for o in offloads)
    stages = (0, *ENGINE[engine].zero_stages)
    if value is None:  # on one GPU only offload makes sharding worth it, and stage 1 is stage 2 there
        return stages if world > 1 else tuple(s for s in stages if s != 1) if offload else (0,)
    if value not in (0, 1, 2, 3):
        raise InputError(f"ZeRO stage must be 0-3, got {value}", flag="--zero-stage")
    if value not in stages:
        raise InputError(f"the {engine} engine has no stage {value}", flag="--zero-stage",
                         hint=f"Use one of {', '.join(map(str, stages))}, or another --engine.")
    if value > 0 and world == 1 and not offload:
        raise InputError("ZeRO on one GPU only helps with offload", flag="--zero-stage",
                         hint="Drop --no-offload, or use --zero-stage 0.")
    return (value,)


def _with_learning_rates(draft: Plan, lr_args) -> Plan:
    lr_info, lr_notes = _lr(draft.choice, *lr_args)
    candidates = tuple(_with_lr(c, lr_args) for c in draft.candidates)
    return draft.model_copy(update={"lr": lr_info, "notes": draft.notes + lr_notes, "choice": candidates[0],
                                    "candidates": candidates})


def _with_lr(candidate: Candidate, lr_args) -> Candidate:
    info, _ = _lr(candidate, *lr_args)
    return candidate.model_copy(update={"learning_rate": info.learning_rate, "lr_scaling": info.scaling})


def _run_steps(train_tokens, train_steps, global_batch: int, seq_len: int) -> int | None:
    """Optimizer steps of the whole run, from its steps or its tokens (None when neither is given)."""
    if train_tokens is not None and train_steps is not None:
        raise InputError("give the run's length once", flag="--train-steps",
                         hint="Drop --train-steps or --train-tokens.")
    if train_steps is not None:
        if not isinstance(train_steps, int) or isinstance(train_steps, bool) or not 0 < train_steps <= LIMITS.batch:
            raise InputError(f"must be a positive integer up to {LIMITS.batch:,}, got {train_steps!r}",
                             flag="--train-steps")
        return train_steps
    if train_tokens is None:
        return None
    if not isinstance(train_tokens, (int, float)) or not 0 < train_tokens < float("inf"):
        raise InputError(f"must be a positive number of tokens, got {train_tokens!r}", flag="--train-tokens")
    return max(1, math.ceil(train_tokens / (global_batch * seq_len)))


def _lr(choice, lr, lr_batch, lr_scaling, optimizer, spec, global_batch,
        run_steps=None) -> tuple[LearningRate, tuple[str, ...]]:
    """Scale the base LR from the batch it was tuned at (default: micro-batch x GPUs, i.e. scale by N)."""
    cfg = choice.config
    ref = lr_batch or cfg.micro_batch * cfg.data_parallel
    d = scale_lr(lr, global_batch, ref, lr_scaling, optimizer, spec.has_batchnorm, cfg.micro_batch, run_steps)
    info = LearningRate(learning_rate=d.learning_rate, base_lr=d.base_lr, reference_batch=d.reference_batch,
                        scaling=d.scaling, factor=d.factor, warmup_steps=d.warmup_steps, run_steps=d.run_steps)
    if lr is None:
        notes = ("No --lr: the files keep the Trainer's default learning rate and write no warmup; give --lr (and "
                 "--lr-batch, the batch it was tuned at) to have it scaled to this batch.",)
    elif lr_batch is None:
        notes = (f"--lr is taken as tuned at micro-batch x GPUs = {ref} samples (no accumulation), so it is scaled "
                 f"x{d.factor:.2f} ({d.scaling}) and moves with the chosen split; --lr-batch fixes the reference.",)
    else:
        notes = ()
    return info, notes + d.notes
