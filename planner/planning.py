"""`plan()`: the pipeline from a request to a Plan.

    request -> hardware and model, resolved once -> the search space -> ranked candidates (memory and speed)
            -> nothing fits: what would -> probes refine -> learning rate -> notes

Notes are typed records (planner/notes.py); planner/render.py writes their sentences.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

from planner import facts
from planner import hardware as hw
from planner.config import Config
from planner.errors import InputError, NoFitError
from planner.hardware.efficiency_data import efficiency_of
from planner.hardware.host import measured_here
from planner.hardware.systems import system_for
from planner.lr import scale_lr
from planner.memory.analytic import tensor_parallel_share
from planner.dataset import DatasetLengths, load_lengths, mean_length, packing_waste, padding_waste
from planner.memory.estimate import Evaluation
from planner.models import ResolvedModel, resolve_model
from planner.models.build import effective_attention, model_class, samples_kept_apart
from planner.notes import Note, Verdict, note
from planner.program.float8 import Float8Linears, torchao_missing
from planner.program.liger import applies, patches_for
from planner import calibration
from planner.receipts import read_receipts
from planner.refine import DEFAULT_PROBE_BUDGET_S, refine_with_measurements
from planner.render import no_fit_message, suggestion_text
from planner.request import PlanRequest, flag_of, prediction_request
from planner.search import MemoryEvaluator, SearchSpace, nearest_valid_batches, rank, search, speed_of
from planner.speed.data import DataSpeed
from planner.speed.model import SpeedModel
from planner.suggest import Pins, Splits, suggestions
from planner.uncertainty import Stratum, bar_for
from planner.types import (
    Candidate, DatasetSummary, ErrorBar, Hardware, LearningRate, ModelInfo, Plan, ReceiptCheck, Requirement,
    SpeedCorrection,
)
from planner.vocab import (
    ADAPTER, ATTENTION, AUTO, AUTO_SPLIT_FROM, BF16_MIXED, CHECKPOINTING, COMPILE, COMPILE_OFF, COMPILE_ON, DEEPSPEED,
    DEFAULT_PRECISION, EAGER, ENGINE, FLASH, FP16_MIXED, FP32, FULL, GROUPED, LIGER, LIGER_OFF, LIGER_ON, LONGEST,
    NO_ADAPTER, NO_OFFLOAD, OFFLOAD, OPTIMIZER, PACKAGE, PACKING, PADDING, PADDING_FREE, PRECISION, SDPA, SPLIT_FIELDS,
    SPLIT_OFF, TASK, TF32, TOKEN_LABELS, TOKEN_TARGETS,
)



@dataclass(frozen=True)
class Job:
    """A request with its hardware and model resolved, and what the search needs from them."""

    request: PlanRequest
    hardware: Hardware
    resolved: ResolvedModel
    seq_len: int
    run_steps: int | None
    evaluator: MemoryEvaluator
    speed: SpeedModel | DataSpeed
    data: DataLengths | None = None    # the user's dataset, where given
    packed_rows: int | None = None     # packed rows per optimizer step (a dataset's packing candidates)

    def run_steps_of(self, cfg: Config) -> int | None:
        """The run's optimizer steps at `cfg`'s step size (a packed step trains about --batch samples, not exactly)."""
        if cfg.padding != PACKING or self.data is None:
            return self.run_steps
        return self.speed.packed.setup.train_steps

    def samples_per_step(self, cfg: Config) -> float:
        """The samples of data one optimizer step of `cfg` trains (a packed row holds several)."""
        return self.speed.step_size(cfg).samples

    @property
    def gpu(self) -> hw.GPU:
        return self.hardware.entry

    @property
    def spec(self):
        return self.resolved.spec

    @property
    def attention(self) -> str:
        """The attention implementation the model really runs (SDPA asked of a model without it runs eager)."""
        config = self.resolved.config
        if config is None:
            return self.request.attention
        return effective_attention(config, self.request.attention, self.resolved.trust_remote_code)


def plan(model, global_batch: int, *, measure: Callable | None = None, progress: Callable | None = None,
         probe_budget_s: float | None = None, detect: bool = True, **fields) -> Plan:
    """The fastest configuration that fits. `fields` are `PlanRequest`'s (planner/request.py: gpu, gpus_per_node,
    nodes, seq_len, precision, peft, lr, lr_batch, train_steps, compile, ...). `measure(candidate, ...)` measures a
    candidate (the probes' Prober); `detect=False` ignores the local GPU. Raises InputError or NoFitError."""
    request = PlanRequest.of(model=model, global_batch=global_batch, **fields)
    return plan_request(request, measure=measure, progress=progress, probe_budget_s=probe_budget_s, detect=detect)


def plan_request(request: PlanRequest, *, measure: Callable | None = None, progress: Callable | None = None,
                 probe_budget_s: float | None = None, detect: bool = True) -> Plan:
    """`plan` for a validated request."""
    receipts, unreadable = read_receipts([request.receipts] if request.receipts else [], cache=request.use_receipts)
    job = resolve_job(request, resolve_hardware(request, detect), progress)
    ranked = search(job.gpu, search_space(job), job.evaluator, job.hardware.budget_bytes,
                    host_budget=job.hardware.host_memory_bytes, speed=job.speed, progress=progress)
    ranked, correction = corrected_speeds(ranked, job)
    lessons = calibration.learn(receipts, unreadable, receipt_workload(job))
    before = ranked[0]
    ranked = calibration.applied(ranked, lessons, job.hardware.budget_bytes, rank)
    ranked += hardware_rejections(request.precision, job.gpu, ranked[0])
    notes = search_notes(job, ranked) + calibration.notes(before, ranked[0], lessons)
    draft = Plan(model=ModelInfo.of(job.spec, job.seq_len, job.resolved.adapter), hardware=job.hardware,
                 seq_len=job.seq_len, optimizer=request.optimizer, attention=job.attention, choice=ranked[0],
                 candidates=tuple(ranked), lr=learning_rate(ranked[0], job), notes=notes,
                 dataset=dataset_summary(job, ranked[0].config), speed_calibrations=tuple(lessons.speeds.values()),
                 receipt_checks=receipt_checks(lessons.like, job), speed_correction=correction,
                 request=prediction_request(request))
    if not ranked[0].fits:
        levers = suggestions(draft, job.evaluator, job.gpu, request.offload,
                             "max_length" if job.data else "seq_len", advice_splits(job), advice_pins(request))
        raise NoFitError(no_fit_message(draft), suggestions=[suggestion_text(s) for s in levers], plan=draft,
                         levers=levers)
    if measure is not None:
        draft = measured(draft, job, measure, progress, probe_budget_s)
    return finished(with_learning_rates(draft, job), job)


def resolve_hardware(request: PlanRequest, detect: bool) -> Hardware:
    """The GPU (named, else detected, else the reference one), its count and memory budget, the host RAM offload is
    checked against, and the network between nodes."""
    detected = hw.detect_gpus() if detect else None
    headroom = facts.get("planning.headroom_fraction") if request.headroom is None else request.headroom
    if request.gpu:
        entry = hw.lookup_gpu(request.gpu)
        is_local = detected is not None and detected.gpu.name == entry.name
    elif detected:
        entry, is_local = detected.gpu, True
    else:
        entry, is_local = hw.lookup_gpu(hw.REFERENCE_GPU), False
    count = request.gpus_per_node or (detected.count if is_local else 1)
    budget = int(entry.memory_bytes * (1 - headroom))
    if is_local and detected.free_bytes:
        budget = min(budget, int(min(detected.free_bytes) * (1 - headroom)))
    system = system_for(entry.name, count)
    if request.host_memory is not None:
        host, source = request.host_memory, "given"
    elif is_local and (local := _local_host_memory()):
        host, source = local, "this machine"
    else:
        host, source = system.host_bytes_for(count), "assumed"
    # the host's costs where the plan runs with the GPU it plans for (planner/hardware/host.py), else the usual system's
    costs = measured_here(entry.name) if is_local else None
    entry = entry.model_copy(update={"nic_Gbps": request.nic_gbps, "host": costs})
    network = efficiency_of(entry)
    return Hardware(gpu=entry.name, gpu_memory_bytes=entry.memory_bytes, gpus_per_node=count, nodes=request.nodes,
                    detected=is_local, budget_bytes=budget, headroom=headroom, host_memory_bytes=host,
                    host_memory_source=source, host_system=system.system if source == "assumed" else "",
                    network_Gbps=network.nic_GBps * 8, network_source=network.network,
                    reference=not request.gpu and not detected, entry=entry)


def _local_host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True)
class DataLengths:
    """The user's dataset as the plan uses it: its lengths, the truncation, and the row length memory is planned at
    (the longest sample after truncation; packed rows are as long)."""

    lengths: DatasetLengths
    max_length: int          # --max-length, else the model's maximum
    seq_len: int             # min(max_length, the longest sample): padded rows
    pack_len: int            # packed rows: --max-length where given, else seq_len

    @property
    def histogram(self):
        return self.lengths.clipped(self.seq_len)

    @property
    def samples_per_row(self) -> float:
        """The samples a packed row holds on average: its tokens of data over the mean sample's."""
        return self.pack_len * (1 - packing_waste(self.histogram, self.pack_len)) / mean_length(self.histogram)

    def packed_rows(self, samples: int, unit: int) -> int:
        """Packed rows per optimizer step that train about `samples` samples: a multiple of `unit` (the GPUs times a
        pinned micro-batch, so that every data-parallel split of them divides it), at least one unit."""
        return unit * max(1, round(samples / self.samples_per_row / unit))


def resolve_job(request: PlanRequest, hardware: Hardware, progress: Callable | None = None) -> Job:
    resolved = resolve_model(request.model, trust_remote_code=request.trust_remote_code, task=request.task,
                             num_labels=request.num_labels, adapter=request.resolved_adapter())
    data = dataset_lengths(request, resolved.spec, progress) if request.dataset else None
    seq_len = data.seq_len if data else _sequence(request.seq_len, resolved.spec)
    batch = request.global_batch
    run_steps = _run_steps(request, batch, batch * seq_len, data)

    def at(rows: int, steps: int | None) -> tuple[Evaluation, SpeedModel]:
        evaluation = Evaluation(resolved, seq_len=rows, optimizer=request.optimizer, attention=request.attention,
                                gpus_per_node=hardware.gpus_per_node, gpu=hardware.entry)
        return evaluation, SpeedModel(evaluation.workload, hardware.entry, hardware.gpus_per_node, steps)

    evaluation, speed = at(seq_len, run_steps)
    if data is None:
        return Job(request=request, hardware=hardware, resolved=resolved, seq_len=seq_len, run_steps=run_steps,
                   evaluator=MemoryEvaluator(evaluation, request.memory_method), speed=speed)
    rows = data.packed_rows(batch, hardware.gpus_per_node * hardware.nodes * (request.micro_batch or 1))
    packed = at(data.pack_len, _run_steps(request, rows * data.samples_per_row, rows * data.pack_len, data))
    return Job(request=request, hardware=hardware, resolved=resolved, seq_len=seq_len, run_steps=run_steps,
               evaluator=MemoryEvaluator(evaluation, request.memory_method,
                                         packed[0] if data.pack_len != seq_len else None),
               data=data, packed_rows=rows, speed=DataSpeed(speed, data.histogram, seq_len, packed[1]))


def dataset_lengths(request: PlanRequest, spec, progress: Callable | None) -> DataLengths:
    """The dataset's sample lengths in tokens (its `input_ids` where it is pre-tokenised, else tokenised with
    --tokenizer or the model's folder or hub id in the local cache), truncated at --max-length (else the model's
    maximum)."""
    tokenizer = data_tokenizer(request, spec)
    report = (lambda done, total: progress(f"tokenizing {done:,} of {total:,} rows")) if progress else None
    lengths = load_lengths(request.dataset, tokenizer=tokenizer, text_field=request.text_field,
                           max_rows=request.dataset_rows or DEFAULT_DATASET_ROWS, progress=report)
    max_length = request.max_length or spec.max_positions or lengths.max
    if spec.max_positions and max_length > spec.max_positions:
        raise InputError(f"{max_length} tokens exceed the model's {spec.max_positions} positions", flag="--max-length",
                         hint=f"Use --max-length {spec.max_positions} or less.",
                         changes={"max_length": spec.max_positions})
    return DataLengths(lengths=lengths, max_length=max_length, seq_len=min(max_length, lengths.max),
                       pack_len=request.max_length or min(max_length, lengths.max))


def data_tokenizer(request: PlanRequest, spec) -> str:
    """--tokenizer, else the model's folder or hub id (whose tokenizer the local cache may hold)."""
    return str(request.tokenizer or (request.model if spec.source == "folder" else spec.name))


def _sequence(seq_len: int | None, spec) -> int:
    s = seq_len or spec.seq_len
    if spec.max_positions and s > spec.max_positions:
        raise InputError(f"sequence length {s} exceeds the model's {spec.max_positions} positions", flag="--seq-len",
                         hint=f"Use --seq-len {spec.max_positions} or less, or a model folder whose config.json "
                              "allows more positions.", changes={"seq_len": spec.max_positions})
    return s


def _run_steps(request: PlanRequest, samples_per_step: float, tokens_per_step: float,
               data: DataLengths | None) -> int | None:
    """Optimizer steps of the whole run with steps of this size, from its steps or its tokens, else from the dataset's
    samples times its epochs (None when nothing says)."""
    if request.train_steps is not None:
        return request.train_steps
    if request.train_tokens is not None:
        return max(1, math.ceil(request.train_tokens / tokens_per_step))
    if data is not None:
        return max(1, math.ceil(data.lengths.samples * (request.epochs or 1.0) / samples_per_step))
    return None


def search_space(job: Job) -> SearchSpace:
    request, hardware = job.request, job.hardware
    world = hardware.gpus_per_node * hardware.nodes
    batch, splits = request.global_batch, sequence_splits(job)
    # the data-parallel ranks a sequence split leaves (world / N) take the batch; whole sequences need all of them
    ranks = [world // n for n in (*((1,) if splits["whole_sequences"] else ()), *splits.get("context_parallel", ()),
                                   *splits.get("sequence_parallel", ()))]
    dp = next((r for r in ranks if batch % r == 0), None)
    if dp is None:
        low, high = nearest_valid_batches(batch, ranks[0])
        raise InputError(f"global batch {batch} is not divisible by {ranks[0]} data-parallel GPUs", flag="--batch",
                         hint=f"Use a multiple of {ranks[0]}: the nearest are --batch {low} and --batch {high}.",
                         changes={"global_batch": high})
    if request.micro_batch and (batch // dp) % request.micro_batch:
        fitting = max(d for d in range(1, request.micro_batch) if (batch // dp) % d == 0)
        raise InputError(f"micro-batch {request.micro_batch} does not divide the per-GPU batch {batch // dp}",
                         flag="--micro-batch", hint=f"Pick a divisor of global batch / number of GPUs, e.g. "
                                                    f"--micro-batch {fitting}.", changes={"micro_batch": fitting})
    offloads = tuple(OFFLOAD) if request.offload == AUTO else (request.offload,)
    return SearchSpace(
        global_batch=batch, world_size=world, gpus_per_node=hardware.gpus_per_node,
        precisions=_precisions(request.precision, job.gpu, request.attention, job.spec),
        checkpointing=tuple(CHECKPOINTING) if request.checkpointing is None else (request.checkpointing,),
        zero_stages=_zero_stages(request.zero_stage, world, offloads, request.engine), offloads=offloads,
        micro_batch=request.micro_batch, engine=request.engine, optimizer=request.optimizer, packed_rows=job.packed_rows,
        adapter=job.spec.adapter, **tensor_parallel_splits(job),
        **splits,
        compiled=_compiled(request.compile, job.run_steps), train_steps=job.run_steps, paddings=paddings(job),
        liger=_liger(job))


def dataset_summary(job: Job, choice: Config) -> DatasetSummary | None:
    data = job.data
    if data is None:
        return None
    summary = data.lengths.to_json(data.max_length)
    waste = {name: padding_waste(name, data.histogram, choice.micro_batch, max_length=data.pack_len,
                                 mega_batch_mult=None, grad_accum=choice.grad_accum) for name in PADDING}
    row = data.pack_len if choice.padding == PACKING else data.seq_len
    steps = math.ceil(data.lengths.samples / job.samples_per_step(choice))
    request = job.request
    return DatasetSummary(**summary, sampled=data.lengths.sampled_rows, max_length=data.max_length, row_length=row,
                          padding_waste=waste, steps_per_epoch=steps, source=str(request.dataset),
                          text_field=request.text_field, tokenizer=data_tokenizer(request, job.spec))


def paddings(job: Job) -> tuple[str | None, ...]:
    """The batching strategies a dataset can be trained with here: padded ones always; packed and padding-free rows
    where the attention keeps their samples apart (padding-free cannot run otherwise; packing would attend across
    samples, so it is not chosen)."""
    if job.data is None:
        return (None,)
    apart = samples_kept_apart(job.resolved.config, job.attention, job.resolved.trust_remote_code)
    usable = tuple(name for name, info in PADDING.items() if not info.apart_with or apart)
    pinned = job.request.padding
    if pinned == AUTO:
        return usable
    if pinned not in usable:
        raise InputError(f"{job.spec.architecture} with {job.attention} attention would let {pinned} rows' samples "
                         "attend to each other", flag="--padding", hint="Use --attention flash, or --padding longest.",
                         changes={"padding": LONGEST})
    return (pinned,)


def _zero_stages(value: int | None, world: int, offloads: tuple[str, ...], engine: str) -> tuple[int, ...]:
    """The sharding stages to search: all the engine has (on one GPU stage 1 is stage 2), or the one pinned."""
    stages = (0, *ENGINE[engine].zero_stages)
    if value is None:
        return stages if world > 1 else tuple(s for s in stages if s != 1)
    if value not in stages:
        nearest = min(stages, key=lambda stage: (abs(stage - value), -stage))
        raise InputError(f"the {engine} engine has no stage {value}", flag="--zero-stage",
                         hint=f"Use one of {', '.join(map(str, stages))} (--zero-stage {nearest} is the nearest), or "
                              "another --engine.", changes={"zero_stage": nearest})
    redundant = [Config.sharding_redundant(world, value, offload) for offload in offloads]
    if value > 0 and all(redundant):
        raise InputError(redundant[0], flag="--zero-stage", hint="Drop --no-offload, or use --zero-stage 0.",
                         changes={"zero_stage": 0})
    return (value,)


def _precisions(precision: str, gpu, attention: str, spec) -> tuple[str, ...]:
    """The precisions to search: those `auto` may choose that the GPU can run (float8 only where torchao is installed
    here and converts some of the model's layers), else the one asked for, if the GPU can run it (with the attention
    implementation asked for)."""
    converted = Float8Linears.of(spec).converted_layers
    if precision == AUTO:
        wanted = [p for p, info in PRECISION.items()
                  if info.in_auto and not (info.float8 and (torchao_missing() or not converted))]
    else:
        wanted = [precision]
    problems = {p: gpu.cannot_run(p, attention) for p in wanted}
    usable = tuple(p for p in wanted if not problems[p])
    if not usable:
        if gpu.cannot_run(wanted[0]) is None:  # the precision runs here, the attention kernel does not
            raise InputError(problems[wanted[0]], flag="--attention", hint="Use --attention sdpa.",
                             changes={"attention": SDPA})
        raise _precision_refused(problems[wanted[0]], wanted[0], gpu, attention)
    if PRECISION[wanted[0]].float8 and not converted:
        raise _precision_refused(f"accelerate's float8 filter converts none of {spec.name}'s layers: torchao swaps "
                                 "nn.Linear layers whose dimensions divide by 16, not the first or the last",
                                 wanted[0], gpu, attention)
    if precision != AUTO and (problem := _adapter_problem(precision, spec.adapter)):
        raise _precision_refused(problem, precision, gpu, attention, spec.adapter)
    return _without_loss_scaling_twins(usable) if precision == AUTO else usable


def _precision_refused(problem: str, precision: str, gpu, attention: str, adapter: str = NO_ADAPTER) -> InputError:
    """`precision` refused: the hint offers the nearest precision this GPU runs (with the adapter, where one trains),
    and, where the adapter rules `precision` out, training without it."""
    nearest = next((p for p in (gpu.nearest_precision(precision, attention), BF16_MIXED, FP16_MIXED)
                    if p and not gpu.cannot_run(p, attention) and not _adapter_problem(p, adapter)), None)
    if nearest is None:
        return InputError(problem, flag="--precision")
    scaled = "; fp16 trains with dynamic loss scaling" if PRECISION[nearest].loss_scaling else ""
    with_adapter = f" with --peft {adapter}" if adapter != NO_ADAPTER else ""
    hint = f"Use --precision {nearest} (the nearest precision {gpu.name} runs{with_adapter}{scaled})"
    hint += f", or drop --peft to train in {precision}." if adapter != NO_ADAPTER else "."
    return InputError(problem, flag="--precision", hint=hint, changes={"precision": nearest})


def _adapter_problem(precision: str, adapter: str) -> str | None:
    """Why `precision` cannot train `adapter` on one GPU (`Config.adapter_problem`: fp8 with adapters, QLoRA in
    fp32)."""
    return Config.of(micro_batch=1, grad_accum=1, world_size=1, precision=precision, checkpointing=FULL, zero_stage=0,
                     offload=NO_OFFLOAD).adapter_problem(adapter)


def _without_loss_scaling_twins(precisions: tuple[str, ...]) -> tuple[str, ...]:
    """`auto` leaves out a loss-scaled precision where a twin runs without loss scaling (fp16-mixed where the GPU has
    bf16-mixed): the same bytes and tensor-core rate, without the GradScaler's skipped steps."""
    def twin(p: str, q: str) -> bool:
        a, b = PRECISION[p], PRECISION[q]
        same_program = a.weight_bytes == b.weight_bytes and (a.autocast is None) == (b.autocast is None)
        return q != p and same_program and not b.loss_scaling

    return tuple(p for p in precisions if not (PRECISION[p].loss_scaling and any(twin(p, q) for q in precisions)))


def _compiled(compile: str, run_steps: int | None) -> tuple[bool, ...]:
    """Eager and/or compiled candidates: auto weighs compiling only when the run's length says what it costs."""
    return COMPILE[compile].candidates if compile != AUTO or run_steps else (False,)


def _liger(job: Job) -> tuple[bool, ...]:
    """Without and/or with Liger-Kernel: `on` wherever its patches apply to the model on the GPU (an input error where
    they do not), `auto` only where liger-kernel is also installed here."""
    mode = job.request.liger
    if True not in LIGER[mode].candidates:
        return LIGER[mode].candidates
    problem = applies(job.resolved.config, job.gpu, check_installed=mode == AUTO) if job.resolved.config is not None \
        else "a model passed as a module is planned as it is"
    if problem is None:
        return LIGER[mode].candidates
    if mode == AUTO:
        return (False,)
    raise InputError(f"Liger-Kernel does not apply: {problem}", flag="--liger", hint="Use --liger off (or auto).",
                     changes={"liger": LIGER_OFF})


def tensor_parallel_splits(job: Job) -> dict:
    """The tensor-parallel sizes to search (`SearchSpace.tensor_parallel`, `.whole_layers`): those the model's plan
    and the node allow under auto, none when off, or the one pinned (an InputError saying why where it cannot
    run)."""
    request = job.request
    sizes, missing = tensor_parallel_sizes(job.resolved, job.hardware.gpus_per_node)
    pinned = request.split_sizes("tensor_parallel")
    if request.tensor_parallel == SPLIT_OFF:
        return {"tensor_parallel": ()}
    if pinned is None:
        return {"tensor_parallel": sizes}
    if pinned not in sizes:
        why = (f"{job.spec.architecture} has no tensor-parallel plan in this transformers" if missing is not None
               and missing.kind == "no-tp-plan" else f"{pinned} GPUs do not split {job.spec.name}'s layers within a "
               f"node of {job.hardware.gpus_per_node} GPUs" + (f" ({', '.join(map(str, sizes))} do)" if sizes else ""))
        raise InputError(why, flag="--tensor-parallel", hint="Use another size, or off.")
    return {"tensor_parallel": (pinned,), "whole_layers": False}


def tensor_parallel_sizes(resolved, gpus_per_node: int) -> tuple[tuple[int, ...], Note | None]:
    """Tensor-parallel sizes worth planning within a node, and why there are none: the model's transformers TP plan
    (`config.base_model_tp_plan`, which `from_pretrained(tp_plan="auto")` applies) must exist, and a size must divide
    the node's GPUs and the attention and key/value heads it splits."""
    spec, config = resolved.spec, resolved.config
    if gpus_per_node < 2:
        return (), None
    if not (getattr(config, "base_model_tp_plan", None) if config is not None else None):
        return (), note("no-tp-plan", architecture=spec.architecture)
    sizes = tuple(t for t in (2, 4, 8, 16, 32, 64) if t <= gpus_per_node and gpus_per_node % t == 0
                  and spec.heads % t == 0 and spec.kv_heads % t == 0)
    return sizes, None if sizes else note("no-tp-size", kv_heads=spec.kv_heads)


def sequence_splits(job: Job) -> dict:
    """The sequence splits to search (`SearchSpace.context_parallel`, `.sequence_parallel`, `.whole_sequences`): the
    sizes the libraries accept for this model and sequence, each N pinned (an InputError saying why where it cannot
    run) or, under auto, those within a node from AUTO_SPLIT_FROM tokens."""
    request, world = job.request, job.hardware.gpus_per_node * job.hardware.nodes
    pinned = {field: request.split_sizes(field) for field in SPLIT_FIELDS}
    if all(pinned.values()):  # accelerate/parallelism_config.py:328-334
        raise InputError("context and sequence parallelism are mutually exclusive", flag="--sequence-parallel",
                         hint=f"Pin one of them: --sequence-parallel {AUTO} keeps the --context-parallel split.",
                         changes={"sequence_parallel": AUTO})
    out = {"whole_sequences": not any(pinned.values())}
    for field in SPLIT_FIELDS:
        size, mode = pinned[field], getattr(request, field)
        if size is not None:
            problem = split_problem(job, field, size, world)
            if problem:
                flag = flag_of(PlanRequest, field)
                raise InputError(problem, flag=flag, hint=f"Use another size, or {flag} {SPLIT_OFF}.",
                                 changes={field: SPLIT_OFF})
            out[field] = (size,)
        elif mode == AUTO and job.seq_len >= AUTO_SPLIT_FROM and not any(pinned.values()):
            out[field] = tuple(n for n in range(2, min(world, job.hardware.gpus_per_node) + 1)
                               if world % n == 0 and not split_problem(job, field, n, world))
    return out


def advice_pins(request: PlanRequest) -> Pins:
    """What the request pinned, which the no-fit advice keeps (a re-plan with a suggestion's flags keeps it too)."""
    return Pins(precision=None if request.precision == AUTO else request.precision,
                checkpointing=request.checkpointing, micro_batch=request.micro_batch, zero_stage=request.zero_stage,
                engine=request.engine)


def advice_splits(job: Job) -> Splits:
    """The sequence splits the no-fit advice weighs: the request's pin, else those auto weighs (any size the
    libraries run, `split_problem`)."""
    request = job.request
    pinned = next(((field, size) for field in SPLIT_FIELDS if (size := request.split_sizes(field))), None)
    return Splits(seq_len=job.seq_len, pinned=pinned, modes={field: getattr(request, field) for field in SPLIT_FIELDS},
                  problem=lambda field, size, world, seq_len: split_problem(job, field, size, world, seq_len))


def split_problem(job: Job, field: str, size: int, world: int, seq_len: int | None = None) -> str | None:
    """Why `size` GPUs cannot split each sequence this way for this model, attention and sequence (the plan's, or
    `seq_len`), or None."""
    spec, config, seq = job.spec, job.resolved.config, seq_len or job.seq_len
    ring = field == "context_parallel"
    if world % size:
        return f"{size} does not divide the {world} GPUs"
    if job.data is not None:  # the split drops the attention mask (accelerate/big_modeling.py:828-847)
        return "a split sequence is planned on full rows of --seq-len tokens, not on a dataset's padded rows"
    if spec.causal_attention < 1 or spec.is_encoder_decoder:
        return f"{spec.name} is not a decoder with causal attention throughout"
    refused = _refused_layer_types(config, ring)
    if refused:
        return f"accelerate refuses to split {spec.name}'s {', '.join(refused)} layers"
    if ring and job.attention != SDPA:  # transformers/trainer.py:2419-2424
        return "context parallelism runs with SDPA attention only (--attention sdpa)"
    if ring and seq % (2 * size):  # torch/.../_load_balancer.py:470-478
        return f"the sequence ({seq:,} tokens) must divide by 2 x {size} for the ring's causal load balance"
    if not ring and (spec.heads % size or (spec.kv_heads % size and size % spec.kv_heads)):  # ulysses_sp.py:147-152
        return f"{spec.heads} attention and {spec.kv_heads} key/value heads do not split over {size} GPUs"
    if not ring and job.attention == EAGER:  # accelerate/utils/dataclasses.py:2252-2309
        return "Ulysses sequence parallelism runs SDPA or FlashAttention, not eager attention"
    if not ring and seq % size:  # ulysses_sp.py:706-707
        return f"the sequence ({seq:,} tokens) must divide by {size}"
    return None


def _refused_layer_types(config, ring: bool) -> list[str]:
    """The attention layer types accelerate refuses to split: for ring attention every type but full attention, and
    a sliding window where a config predates layer_types (accelerate/big_modeling.py:805-826); for Ulysses the
    linear-attention (recurrent) ones (big_modeling.py:760-784)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None)
    if not ring:
        return sorted({t for t in types or [] if "linear_attention" in t})
    if types is None:
        return ["sliding_attention"] if getattr(text, "sliding_window", None) else []
    return sorted({t for t in types if t != "full_attention"})


def hardware_rejections(precision: str, gpu, first: Candidate) -> list[Candidate]:
    """Precisions the GPU cannot run, as rejected options that say why (bf16 on a V100 or T4)."""
    if precision != AUTO:
        return []
    return [Candidate(config=first.config.model_copy(update={"precision": p}), memory=None, throughput=None,
                      verdict=Verdict(kind="hardware", problem=problem))
            for p, info in PRECISION.items() if info.in_auto and not info.packages and (problem := gpu.cannot_run(p))]


def receipt_workload(job: Job) -> calibration.Workload:
    """What receipts are matched to: this plan's GPU, model, sequence, adapter and GPUs, and today's model of a
    configuration."""
    hardware = job.hardware
    return calibration.Workload(gpu=job.gpu.name, model=receipt_model_name(job), seq_len=job.seq_len,
                                adapter=job.spec.adapter, world_size=hardware.gpus_per_node * hardware.nodes,
                                estimate=job.evaluator.estimate, speed=job.speed)


def receipt_model_name(job: Job) -> str:
    """The model's name as a receipt records it: a local folder by its name only (planner/receipts `run_plan`)."""
    spec = job.spec
    return os.path.basename(os.path.normpath(spec.name)) if spec.source == "folder" else spec.name


def receipt_checks(like, job: Job) -> tuple[ReceiptCheck, ...]:
    """Each earlier run like this plan (its model and sequence on this GPU), measured against what the planner
    predicts today for the configuration it ran (beside what its plan printed then)."""
    out = []
    for run, r in enumerate(like, start=1):
        config = r.plan.choice
        memory, speed = job.evaluator.estimate(config), job.speed(config)
        today = {"peak_allocated": memory.peak_allocated, "peak_reserved": memory.peak_reserved,
                 "peak_process": memory.peak_process, "step_time_s": speed.step_time_s,
                 "tokens_per_s": speed.tokens_per_s}
        out += [ReceiptCheck(run=run, label=config.label(), quantity=quantity, predicted=value,
                             predicted_then=r.predicted.printed.get(quantity), measured=r.measured.get(quantity))
                for quantity, value in today.items() if r.measured.get(quantity) and value > 0]
    return tuple(out)


def corrected_speeds(ranked: list[Candidate], job: Job) -> tuple[list[Candidate], SpeedCorrection | None]:
    """Every modelled candidate's step time times the median measured / predicted step time of the runs like the
    fastest fitting one (its stratum's error bar, planner/uncertainty.py), never below what the GPU's dense peak
    allows: one correction for all, so the ranking stands and every figure shown is on one basis. None where no
    run like it was measured."""
    top = next((c for c in ranked if c.fits and c.throughput is not None), None)
    if top is None:
        return ranked, None
    bar = bar_for("throughput", stratum_of(top.config, job))
    if not bar.measured:
        return ranked, None
    factor = bar.spread.median
    correction = SpeedCorrection(factor=factor, stratum=bar.stratum.key, pooled=bar.pooled, n=bar.spread.n)
    return [_corrected(c, factor) for c in ranked], correction


def _corrected(cand: Candidate, factor: float) -> Candidate:
    tp = cand.throughput
    if tp is None or tp.source != "model":
        return cand
    step = tp.step_time_s * max(factor, tp.hfu)  # the executed FLOPs stay under the dense peak
    return cand.model_copy(update={"throughput": tp.corrected(step, source="corrected")})


def stratum_of(cfg: Config, job: Job) -> Stratum:
    return Stratum.of_config(cfg, job.gpu.name, job.hardware.gpus_per_node, job.spec.adapter)


def search_notes(job: Job, ranked: list[Candidate]) -> tuple[Note, ...]:
    """The notes that depend on the search's ranking."""
    request, hardware, gpu, choice = job.request, job.hardware, job.gpu, ranked[0]
    notes = [note("reference-gpu", gpu=gpu.name)] if hardware.reference else []
    if job.resolved.variant_of:
        notes.append(note("preset-variant", name=job.spec.name, base=job.resolved.variant_of))
    if request.precision == AUTO and any(gpu.cannot_run(p) for p, info in PRECISION.items()
                                         if info.in_auto and info.autocast and not info.float8):
        notes.append(note("no-bf16", gpu=gpu.name, compute_capability=gpu.compute_capability))
    notes += _tf32_note(job, choice) + _parallelism_notes(job, ranked) + _host_note(hardware, choice)
    notes += _moe_note(job.spec, choice) + _adapter_notes(job) + _qlora_notes(job) + _liger_notes(job, choice)
    notes += _float8_notes(job, ranked)
    return tuple(notes) + _compile_notes(job, choice)


def _tf32_note(job: Job, choice: Candidate) -> list[Note]:
    """With fp32 asked for on a GPU with TF32 tensor cores: what TF32 would gain on the chosen configuration."""
    if job.request.precision != FP32 or job.gpu.cannot_run(TF32) or not choice.fits or choice.throughput is None:
        return []
    faster = job.speed(choice.config.model_copy(update={"precision": TF32})).step_time_s
    return [note("tf32-gain", {"precision": TF32}, gpu=job.gpu.name, tf32_step_s=faster,
                 step_s=choice.throughput.step_time_s, gain=choice.throughput.step_time_s / faster)]


def _parallelism_notes(job: Job, ranked: list[Candidate]) -> list[Note]:
    _, missing = tensor_parallel_sizes(job.resolved, job.hardware.gpus_per_node)
    notes = [missing] if missing else []
    choice = ranked[0]
    cfg = choice.config
    if cfg.tensor_parallel > 1 and choice.fits:
        plain = next((c for c in ranked if c.fits and c.config.tensor_parallel == 1 and c.throughput), None)
        notes.append(note("tensor-parallel", tp=cfg.tensor_parallel, dp=cfg.data_parallel,
                          speedup=choice.throughput.tokens_per_s / plain.throughput.tokens_per_s if plain else None,
                          plain=plain.config.label() if plain else None))
    if cfg.sequence_split > 1 and choice.fits:
        whole = next((c for c in ranked if c.fits and c.config.sequence_split == 1 and c.throughput), None)
        narrowest = min(c.config.sequence_split for c in ranked if c.fits)
        notes.append(note("sequence-split", by="context" if cfg.context_parallel > 1 else "sequence",
                          split=cfg.sequence_split, narrowest=narrowest, seq_len=job.seq_len,
                          per_gpu=job.seq_len // cfg.sequence_split,
                          gpus=job.hardware.gpus_per_node * job.hardware.nodes, gpu=job.gpu.name,
                          whole=whole.config.label() if whole else None,
                          pinned=any(job.request.split_sizes(field) for field in SPLIT_FIELDS),
                          speedup=speed_of(choice) / speed_of(whole) if whole else None))
    if job.hardware.nodes > 1 and choice.fits:
        notes.append(note("no-pipeline"))
    fastest = max((c for c in ranked if c.fits), key=speed_of, default=None)
    if choice.fits and fastest is not None and fastest.config.structure() > cfg.structure() \
            and speed_of(fastest) > speed_of(choice):
        notes.append(note("simpler", other=fastest.config.label(), faster=speed_of(fastest) / speed_of(choice) - 1,
                          tie=facts.get("search.structure_tie") - 1))
    return notes


def _host_note(hardware: Hardware, choice: Candidate) -> list[Note]:
    """Name the host RAM an offload plan was checked against when it was assumed, not measured or given; say where the
    host's costs of eager PyTorch come from: measured on this machine, or the usual system's, with the step time on
    the fastest and slowest host known."""
    notes = []
    if hardware.host_memory_source == "assumed" and choice.memory and choice.memory.cpu_offload_bytes:
        notes.append(note("host-assumed", offload_bytes=choice.memory.cpu_offload_bytes,
                          host_bytes=hardware.host_memory_bytes, system=hardware.host_system))
    host = hardware.entry.host if hardware.entry is not None else None
    if host is not None:
        notes.append(note("host-measured", dispatch_us=host.dispatch_us, engine_dispatch_us=host.engine_dispatch_us,
                          python_op_us=host.python_op_us, module_call_us=host.module_call_us, at=host.measured_at))
    elif choice.throughput is not None and choice.throughput.step_time_fast_host_s is not None:
        tp = choice.throughput
        notes.append(note("host-range", step_s=tp.step_time_s, fast_s=tp.step_time_fast_host_s,
                          slow_s=tp.step_time_slow_host_s, gpu=hardware.gpu))
    return notes


def _moe_note(spec, choice: Candidate) -> list[Note]:
    cfg = choice.config
    if spec.num_experts <= 1 or not (cfg.engine == DEEPSPEED and cfg.zero_stage == 3):
        return []
    return [note("moe-zero3", experts_per_token=spec.experts_per_token, experts=spec.num_experts)]


def _adapter_notes(job: Job) -> list[Note]:
    """Where peft adapts fused expert weights as parameters, and QLoRA leaves them 16-bit."""
    adapter, spec = job.resolved.adapter, job.spec
    if adapter is None:
        return []
    out = []
    if adapter.fused_parameters:
        out.append(note("lora-fused-parameters", parameters=", ".join(adapter.fused_parameters),
                        dropout=adapter.dropout))
    # bitsandbytes converts linear modules only: frozen 3D parameters (fused experts) keep the compute dtype
    fused = sum(-n for n, dims in zip(spec.tensor_sizes, spec.tensor_ndims) if n < 0 and dims >= 3)
    if adapter.quantized and fused:
        out.append(note("qlora-16bit-experts", experts=fused, unquantized=spec.frozen_parameters -
                        spec.quantized_parameters, frozen=spec.frozen_parameters))
    return out


def _liger_notes(job: Job, choice: Candidate) -> list[Note]:
    """What Liger-Kernel patches in the chosen plan; or, where `auto` left it out only because it is not installed
    here, that it would apply."""
    config = job.resolved.config
    patches = patches_for(config, job.spec.task) if config is not None else None
    if patches is None:
        return []
    if choice.config.liger:
        return [note("liger", patches=patches.names(), source=patches.source, unmodelled="; ".join(patches.unmodelled))]
    if job.request.liger == AUTO and applies(config, job.gpu, check_installed=False) is None \
            and applies(config, job.gpu) is not None:
        return [note("liger-available", {"liger": LIGER_ON}, model_type=patches.model_type, patches=patches.names(),
                     install=PACKAGE["liger-kernel"].install)]
    return []


def _float8_notes(job: Job, ranked: list[Candidate]) -> list[Note]:
    """Where float8 could run on this GPU: what it converts and what it changes against bf16-mixed on the chosen
    configuration; where it lost, its fastest configuration against the choice (and, eager where compiling was not
    weighed, that compiling fuses its casts); where `auto` left it out only because torchao is not installed here,
    that it would apply."""
    fp8, choice = next(p for p, info in PRECISION.items() if info.float8), ranked[0]
    if job.request.precision not in (AUTO, fp8) or job.gpu.cannot_run(fp8) or not choice.fits:
        return []
    linears = Float8Linears.of(job.spec)
    if not linears.converted_layers:  # nothing to convert: fp8 would be bf16-mixed (`_precisions` leaves it out)
        return [note("fp8-not-planned", why=f"accelerate's float8 filter converts none of {job.spec.name}'s layers")]
    if job.request.precision == AUTO and torchao_missing():
        if choice.config.model_copy(update={"precision": fp8}).adapter_problem(job.spec.adapter):
            return []
        return [note("fp8-available", {"precision": fp8}, gpu=job.gpu.name, install=PACKAGE["torchao"].install)]
    if choice.config.precision == fp8:
        return _float8_won(job, ranked, linears)
    lost = [c for c in ranked if c.fits and c.config.precision == fp8 and c.throughput is not None]
    if not lost:
        alike = choice.config.model_copy(update={"precision": fp8})
        return [note("fp8-not-planned", why=alike.problem() or alike.adapter_problem(job.spec.adapter)
                     or "no fp8 configuration fits")]
    best = lost[0]  # compiling it is not timed here: analysing the compiled program takes seconds
    weighed = True in _compiled(job.request.compile, job.run_steps)
    return [note("fp8-lost", {"compile": COMPILE_ON} if not (best.config.compiled or weighed) else None,
                 converted=linears.converted_layers, linears=linears.total_layers, label=best.config.label(),
                 tokens_per_s=best.throughput.useful_tokens_per_s,
                 chosen_tokens_per_s=choice.throughput.useful_tokens_per_s, eager=not best.config.compiled,
                 compile_weighed=weighed)]


def _float8_won(job: Job, ranked: list[Candidate], linears: Float8Linears) -> list[Note]:
    """float8 chosen: against the bf16-mixed plan the search ranks first among those that fit, where it weighed
    bf16-mixed (what the user would run instead), else against the chosen configuration in bf16-mixed."""
    choice = ranked[0]
    best = next((c for c in ranked if c.fits and c.config.precision == BF16_MIXED and c.throughput), None)
    if best is None:
        other = choice.config.model_copy(update={"precision": BF16_MIXED})
        if other.problem() or choice.throughput is None:
            return []
        best_step, best_peak, label = job.speed(other).step_time_s, job.evaluator.estimate(other).peak, None
    else:
        best_step, best_peak, label = best.throughput.step_time_s, best.memory.peak, best.config.label()
    return [note("fp8-chosen", converted=linears.converted_layers, linears=linears.total_layers,
                 fp8_step_s=choice.throughput.step_time_s, bf16_step_s=best_step, fp8_peak=choice.memory.peak,
                 bf16_peak=best_peak, bf16_label=label)]


def _qlora_notes(job: Job) -> list[Note]:
    spec, world = job.spec, job.hardware.gpus_per_node * job.hardware.nodes
    if not ADAPTER[spec.adapter].quantized_base:
        return []
    sharded = Config.of(micro_batch=1, grad_accum=1, world_size=world, precision=DEFAULT_PRECISION,
                        checkpointing=FULL, zero_stage=3, offload=NO_OFFLOAD).adapter_problem(spec.adapter)
    ddp = [note("qlora-ddp-only", problem=sharded)] if world > 1 and sharded else []
    return ddp + [note("qlora-prepare")]


def _compile_notes(job: Job, choice: Candidate) -> tuple[Note, ...]:
    """torch.compile on the chosen configuration: its modelled step against eager, its compile time and when that
    pays off, and what it saves in memory."""
    compile_, run_steps = job.request.compile, job.run_steps_of(choice.config)
    if compile_ == COMPILE_OFF or not choice.fits or choice.throughput is None:
        return ()
    if run_steps is None and compile_ == AUTO:  # tracing the compiled program costs seconds: only when it is weighed
        return (note("compile-not-weighed", {"compile": COMPILE_ON}),)
    cfg, spec = choice.config, job.spec
    effect = job.speed.workload.compile_effect(cfg)
    if effect is None:
        return (note("compile-not-captured"),) if cfg.compiled else ()
    eager, compiled = (job.speed(cfg.model_copy(update={"compiled": on})) for on in (False, True))
    eager_s, compiled_s = (t.step_time_s - t.parts.compile for t in (eager, compiled))  # per step, compile apart
    seconds = effect.compile_seconds(spec.layers)
    values = dict(compiled_s=compiled_s, eager_s=eager_s, compile_s=seconds, run_steps=run_steps,
                  repaid_steps=seconds / (eager_s - compiled_s) if eager_s > compiled_s else None)
    if not cfg.compiled:
        return (note("compile", **values),)
    saved = effect.saved_less(spec.layers, cfg.micro_batch) if cfg.compile_saves_activations() else 0
    saved *= tensor_parallel_share(job.speed.workload, cfg) if cfg.tensor_parallel > 1 else 1.0
    return (note("compiled", saved_bytes=saved, **values),)


def measured(draft: Plan, job: Job, measure: Callable, progress, probe_budget_s: float | None) -> Plan:
    """The plan refined by measurements of its top candidates (QLoRA plans are not probed: random weights, which
    bitsandbytes does not quantise)."""
    if ADAPTER[job.spec.adapter].quantized_base:
        return draft.model_copy(update={"notes": draft.notes + (note("qlora-not-probed"),)})
    budget_s = DEFAULT_PROBE_BUDGET_S if probe_budget_s is None else probe_budget_s
    return refine_with_measurements(draft, measure, job.resolved, progress=progress, budget_s=budget_s,
                                    estimate=job.evaluator.estimate)


def learning_rate(candidate: Candidate, job: Job) -> LearningRate:
    """The base LR scaled from the batch it was tuned at (`--lr-batch`, which `--lr` needs) to the samples of the
    candidate's step; without an LR, the factor an LR tuned at micro-batch x GPUs would take (the seed rule: scale by
    N). Warmup counts the candidate's optimizer steps."""
    request, cfg = job.request, candidate.config
    if request.lr_batch:  # samples, like the step's
        batch, ref = job.samples_per_step(cfg), request.lr_batch
    else:  # rows, like the step's: a factor of N
        batch, ref = cfg.global_batch, cfg.micro_batch * cfg.data_parallel
    d = scale_lr(request.lr, batch, ref, request.lr_scaling, request.optimizer, job.run_steps_of(cfg))
    return LearningRate(learning_rate=d.learning_rate, base_lr=d.base_lr, reference_batch=d.reference_batch,
                        scaling=d.scaling, factor=d.factor, warmup_steps=d.warmup_steps, run_steps=d.run_steps)


def with_learning_rates(draft: Plan, job: Job) -> Plan:
    candidates = tuple(c.model_copy(update={"learning_rate": (lr := learning_rate(c, job)).learning_rate,
                                            "lr_scaling": lr.scaling}) for c in draft.candidates)
    return draft.model_copy(update={"lr": learning_rate(draft.choice, job), "choice": candidates[0],
                                    "candidates": candidates})


def finished(result: Plan, job: Job) -> Plan:
    """The notes that depend on the final choice: the learning rate, how the loss is normalised over the accumulated
    micro-batches, the fp16 loss-scaling policy and an optimizer the Trainer cannot name."""
    requirements = requirements_of(result, job.spec.adapter)
    data = dataset_summary(job, result.choice.config)
    result = result.model_copy(update={"dataset": data})
    if data is not None and data.row_length != result.seq_len:  # packed rows, longer than any sample
        result = result.model_copy(update={"seq_len": data.row_length,
                                           "model": result.model.model_copy(update={"seq_len": data.row_length})})
    stratum = stratum_of(result.choice.config, job)
    errors = {kind: ErrorBar.of(bar_for(kind, stratum)) for kind in ERROR_KINDS}
    notes = tuple(note("missing-package", package=r.package, install=r.install) for r in requirements
                  if not r.installed)
    notes += _data_notes(result, job) + _lr_notes(result) + _loss_normalisation_note(result, job.resolved)
    notes += _loss_scaling_note(result)
    notes += _optimizer_note(result)
    return result.model_copy(update={"notes": result.notes + notes, "requirements": requirements,
                                     "memory_error": errors["memory"], "throughput_error": errors["throughput"]})


#: Rows of a dataset tokenised at most (--dataset-rows): a seeded sample of a larger set stands for it.
DEFAULT_DATASET_ROWS = 20_000
ERROR_KINDS = ("memory", "throughput")


def requirements_of(result: Plan, adapter: str) -> tuple[Requirement, ...]:
    """The packages the chosen configuration needs beyond the base install (`vocab.PACKAGE`), and whether each
    imports here: a plan made on a laptop for a cluster may need what the laptop lacks, so it is said, not refused."""
    cfg = result.choice.config
    names = (*ENGINE[cfg.engine].packages, *ADAPTER[adapter].packages, *ATTENTION[result.attention].packages,
             *((OPTIMIZER[result.optimizer].package,) if OPTIMIZER[result.optimizer].package else ()),
             *(("liger-kernel",) if cfg.liger else ()), *PRECISION[cfg.precision].packages)
    return tuple(Requirement(package=name, installed=installed(PACKAGE[name].module), install=PACKAGE[name].install)
                 for name in dict.fromkeys(names))


def installed(module: str) -> bool:
    """Whether `module` imports here (found on the path; not imported)."""
    return importlib.util.find_spec(module) is not None


def _data_notes(result: Plan, job: Job) -> tuple[Note, ...]:
    """Truncation, how the chosen batching is run, and why packing was not planned where it was not."""
    data, padding = result.dataset, result.choice.config.padding
    if data is None:
        return ()
    notes = (note("dataset-truncated", truncated=data.truncated, samples=data.samples, max_length=data.max_length),) \
        if data.truncated else ()
    if padding in (GROUPED, PACKING, PADDING_FREE):
        notes += (note("padding", padding=padding, waste=data.padding_waste[padding],
                       longest_waste=data.padding_waste[LONGEST]),)
    if PACKING not in paddings(job):
        notes += (note("packing-unavailable", {"attention": FLASH}, attention=job.attention,
                       model=job.spec.architecture),)
    return notes


def _lr_notes(result: Plan) -> tuple[Note, ...]:
    lr = result.lr
    notes = (note("no-lr", scaling=lr.scaling, optimizer=result.optimizer),) if lr.base_lr is None else ()
    if lr.warmup_steps:
        notes += (note("lr-warmup", factor=lr.factor, warmup_steps=lr.warmup_steps, run_steps=lr.run_steps),)
    if result.model.has_batchnorm:
        notes += (note("batchnorm", micro_batch=result.choice.config.micro_batch),)
    return notes


def _loss_normalisation_note(result: Plan, resolved) -> tuple[Note, ...]:
    """Token-level losses over N micro-batches: the Trainer passes `num_items_in_batch` (the labelled tokens of all
    N) to a model that accepts loss kwargs (transformers/trainer.py: `get_batch_samples` counts them, `training_step`
    skips its own division by N when the model normalised)."""
    cfg = result.choice.config
    if cfg.grad_accum == 1 or TASK[result.model.task].labels not in (TOKEN_TARGETS, TOKEN_LABELS):
        return ()
    if resolved.config is not None and _accepts_loss_kwargs(resolved):
        return (note("loss-normalised", grad_accum=cfg.grad_accum, global_batch=cfg.global_batch),)
    return (note("loss-averaged", grad_accum=cfg.grad_accum, architecture=result.model.architecture),)


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


def _loss_scaling_note(result: Plan) -> tuple[Note, ...]:
    policy = result.loss_scaling()
    return () if policy is None else (note("fp16-loss-scaling", **policy),)


def _optimizer_note(result: Plan) -> tuple[Note, ...]:
    """How an optimizer the Trainer cannot name is trained (LAMB), or that it cannot be emitted (Sophia)."""
    info = OPTIMIZER[result.optimizer]
    if info.trainer is not None:
        return ()
    if info.client is None:
        return (note("optimizer-not-implemented", optimizer=result.optimizer),)
    return (note("optimizer-client", optimizer=result.optimizer, client=info.client),)
