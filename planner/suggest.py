"""What would fit when nothing does: more GPUs, a larger GPU, offload, 8-bit Adam, LoRA / QLoRA adapters, a shorter
sequence.

Each suggestion is computed with the same memory model as the plan (traced where it can be), at the
smallest micro-batch, with full checkpointing (the least memory any candidate can have), and says its
numbers. The shorter-sequence figure comes from a quadratic fit of three traced sequence lengths.
"""

from __future__ import annotations

import math

from planner import hardware as hw
from planner.config import Config
from planner.errors import InputError
from planner.hardware.systems import usual_system
from planner.memory.estimate import Evaluation, sequence_fit
from planner.models import trained_as
from planner.models.adapters import Adapter
from planner.notes import Lever, lever
from planner.search import MemoryEvaluator
from planner.vocab import ADAMW_8BIT, AUTO, FULL, NO_OFFLOAD, OFFLOAD_ALL, PRECISION

#: --host-memory is suggested in steps of this many GB (a machine's RAM comes in such sizes).
HOST_STEP_GB = 64


def _least_memory_config(world: int, precision: str, zero: int, offload: str, batch: int) -> Config:
    """Micro-batch 1 with full checkpointing: the least memory any candidate of a `batch` global batch can have
    (accumulation holds a gradient buffer of its own where there is accumulation)."""
    return Config(micro_batch=1, grad_accum=max(1, batch // world), world_size=world, precision=precision,
                  checkpointing=FULL, zero_stage=zero, offload=offload)


def _mixed_precision(gpu) -> str:
    """The GPU's 16-bit autocast precision (bf16 where it has it)."""
    usable = [p for p, info in PRECISION.items() if info.autocast and not gpu.cannot_run(p)]
    return max(usable, key=lambda p: PRECISION[p].needs_bf16)


def suggestions(plan, evaluator, gpu, offload: str, sequence: str = "seq_len") -> list[Lever]:
    """The levers that would fit, each a configuration trainplan plans (QLoRA: no ZeRO-3, no offload), with the
    request's fields that make it fit; `offload` is the request's (`none` pinned means offload was ruled out by the
    user); `sequence` the field a shorter sequence is asked with (max_length for a dataset's rows)."""
    hwinfo, batch = plan.hardware, plan.choice.config.global_batch
    budget = hwinfo.budget_bytes
    precision = _mixed_precision(gpu)
    world = hwinfo.gpus_per_node * hwinfo.nodes
    shards = _least_memory_config(2, precision, 3, NO_OFFLOAD, 2).adapter_problem(evaluator.evaluation.resolved.spec
                                                                                .adapter) is None
    zero3 = world > 1 and shards
    best = evaluator.estimate(_least_memory_config(world, precision, 3 if zero3 else 0, NO_OFFLOAD, batch))
    smallest = dict(precision=precision, zero3=zero3, peak=best.peak, budget=budget)
    if best.peak <= budget:  # the search ruled it out: the user's pinned choices exclude every fitting one
        return [lever("pinned", **smallest)]
    more = _more_gpus(evaluator, hwinfo, gpu, precision, budget, batch) if shards else []
    larger = _larger_gpus(gpu, best.peak / (1 - hwinfo.headroom), precision)
    out = [lever("smallest", **smallest)]
    if larger:
        out.append(lever("larger-gpu", {"gpu": larger[0].name}, gpu=larger[0].name, gpu_gib=larger[0].memory_gib,
                         peak=best.peak))
    adapters = _adapter_lever(evaluator, world, precision, budget, gpu, hwinfo.headroom, batch)
    # adapters before a suggestion of many more GPUs (tens of nodes), after one of a few
    out += adapters + more if more and more[0]["gpus"] >= MANY_GPUS else more + adapters
    off = evaluator.estimate(_least_memory_config(world, precision, 3, OFFLOAD_ALL, batch)) if shards else None
    if off is not None:
        out.append(_offload_lever(plan, off, budget, offload))
    eight = _with_optimizer(evaluator, ADAMW_8BIT, world, precision, smallest["zero3"], batch)
    if plan.optimizer != ADAMW_8BIT and eight.peak <= budget:
        out.append(lever(ADAMW_8BIT, {"optimizer": ADAMW_8BIT}, peak=eight.peak))
    shorter = _shorter_sequence(plan, evaluator, best, budget, world, precision, NO_OFFLOAD, smallest["zero3"])
    if shorter:
        out.append(lever("shorter-sequence", {sequence: shorter}, seq_len=shorter))
    elif off is not None and off.peak > budget:  # the states alone overflow: a shorter sequence, all offloaded
        shorter = _shorter_sequence(plan, evaluator, off, budget, world, precision, OFFLOAD_ALL)
        if shorter:
            out.append(lever("offload-shorter-sequence", {sequence: shorter, "offload": AUTO},
                             seq_len=shorter))
    return out


#: A suggestion of this many GPUs or more comes after the adapters' (full fine-tuning on tens of nodes).
MANY_GPUS = 64
#: Where a user of each kind of GPU looks for another, in order.
SEGMENTS = {"consumer": ("consumer", "data-centre"), "data-centre": ("data-centre", "consumer")}


def _larger_gpus(gpu, need: float, precision: str) -> list:
    """Catalog GPUs holding `need` bytes that run `precision`: the user's vendor and kind of GPU first (consumer,
    then data-centre), the smallest first within each."""
    order = SEGMENTS.get(gpu.segment, SEGMENTS["data-centre"])
    fits = [g for g in hw.catalog() if g.memory_bytes >= need and not g.cannot_run(precision)]
    return sorted(fits, key=lambda g: (g.vendor != gpu.vendor, order.index(g.segment) if g.segment in order
                                       else len(order), g.memory_bytes))


def _more_gpus(evaluator, hwinfo, gpu, precision: str, budget: int, batch: int) -> list[Lever]:
    """The fewest GPUs (the current count times a power of two, dividing the global batch) whose ZeRO-3 shards fit,
    as one lever."""
    world = hwinfo.gpus_per_node * hwinfo.nodes
    for n in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        total = world * n
        if total > 4096 or batch % total:
            break
        est = evaluator.estimate(_least_memory_config(total, precision, 3, NO_OFFLOAD, batch))
        if est.peak <= budget:
            # a single node grows to its usual system's GPU count before more nodes are added
            per_node = hwinfo.gpus_per_node if hwinfo.nodes > 1 else max(hwinfo.gpus_per_node,
                                                                          min(total, _system_gpus(gpu.name)))
            nodes = -(-total // per_node)
            return [lever("more-gpus", {"gpus_per_node": per_node, "nodes": nodes}, gpus=total, gpu=gpu.name,
                          nodes=nodes, per_node=per_node, peak=est.peak)]
    return []


def _system_gpus(gpu_name: str) -> int:
    """GPUs in the usual system of a catalog GPU; 1 for a GPU outside the catalog."""
    try:
        return usual_system(gpu_name).gpus
    except KeyError:
        return 1


def _adapter_lever(evaluator, world: int, precision: str, budget: int, gpu, headroom: float,
                   batch: int) -> list[Lever]:
    """Adapters instead of full fine-tuning: LoRA (a 16-bit frozen base), else QLoRA (a 4-bit one), with peft's
    defaults here (`planner.models.adapters`), at micro-batch 1 with full checkpointing on one GPU or DDP; where
    neither fits this GPU, the one that fits the smaller of them on the GPU of the user's kind that holds it."""
    base = evaluator.evaluation
    if base.resolved.adapter is not None or base.resolved.config is None:
        return []
    tried: dict = {}
    for method in ("lora", "qlora"):
        try:
            resolved = trained_as(base.resolved, adapter=Adapter(method))
        except InputError:  # peft missing, or no linear layers to adapt
            return []
        least = _least_memory_config(world, precision, 0, NO_OFFLOAD, batch)
        est = _variant(evaluator, resolved=resolved).estimate(least)
        tried.update({f"{method}_label": Adapter(method).label(), f"{method}_peak": est.peak,
                      f"{method}_trainable": resolved.spec.trainable_parameters})
        if est.peak <= budget:
            return [lever("adapters", {"peft": method}, fits=method, **tried)]
    method = min(("lora", "qlora"), key=lambda m: tried[f"{m}_peak"])
    larger = _larger_gpus(gpu, tried[f"{method}_peak"] / (1 - headroom), precision)
    if larger:
        return [lever("adapters", {"peft": method, "gpu": larger[0].name}, fits=method, gpu=larger[0].name,
                      **tried)]
    return [lever("adapters-short", fits=None, **tried)]


def _offload_lever(plan, off, budget: int, offload: str) -> Lever:
    """Full offload (ZeRO-3, optimizer and parameters in host memory): its numbers, fitting or not."""
    host = plan.hardware.host_memory_bytes
    if off.peak > budget:
        return lever("offload-short", peak=off.peak, over=off.peak - budget)
    allow = {"offload": AUTO} if offload == NO_OFFLOAD else {}
    if host and off.cpu_offload_bytes > host:
        host_gb = math.ceil(off.cpu_offload_bytes / 1e9 / HOST_STEP_GB) * HOST_STEP_GB  # the --host-memory to give
        return lever("offload-host", {"host_memory": host_gb * 10**9, **allow}, peak=off.peak,
                     host_bytes=off.cpu_offload_bytes, host_budget=host)
    return lever("offload", allow, peak=off.peak, host_bytes=off.cpu_offload_bytes, was_off=bool(allow))


def _shorter_sequence(plan, evaluator, best, budget: int, world: int, precision: str, offload: str,
                     zero3: bool = False) -> int | None:
    """The longest multiple of 64 below the planned length at which the least-memory configuration with `offload`
    fits: found from a quadratic fit of three traced lengths (analytic when the model cannot be traced), then
    checked by estimating it at that length, refitting nearer it while it does not fit (a fit from far longer
    sequences can miss by tens of percent)."""
    cfg = _least_memory_config(world, precision, 3 if offload != NO_OFFLOAD or zero3 else 0, offload,
                               plan.choice.config.global_batch)
    below, at = plan.seq_len, best
    for _ in range(SEQUENCE_TRIES):
        candidate = _fitted_length(evaluator.evaluation, cfg, at, below, budget)
        if candidate is None:
            return None
        at = _at_length(evaluator, candidate).estimate(cfg)
        if at.peak <= budget:
            return candidate
        below = candidate
    return None


#: Fits (each checked by an estimate at its answer) before the shorter-sequence search gives up.
SEQUENCE_TRIES = 3


def _fitted_length(evaluation, cfg, best, below: int, budget: int) -> int | None:
    """The longest multiple of 64 under `below` whose activations, fitted from traces at below/4, below/2 and
    below, fit next to the model states of `best` (an estimate at `below`)."""
    # states and fixed overheads do not depend on the sequence; the error margin and the allocator's slack grow
    # with the activations they are taken on
    variable = best.activations + best.terms.error_margin + best.terms.allocator_slack
    fixed, scale = best.peak - variable, variable / best.activations if best.activations else 1.0
    if fixed >= budget or below < 128:
        return None
    lens = (max(64, below // 4 // 64 * 64), max(128, below // 2 // 64 * 64), below)
    if len(set(lens)) < 3:
        return None
    try:
        act_at = sequence_fit(evaluation, cfg, lens).activations
    except Exception:  # noqa: BLE001 - untraceable model: activations roughly proportional to length
        act_at = lambda n: best.activations * n / below  # noqa: E731
    candidate = (below - 1) // 64 * 64
    while candidate >= 64 and fixed + scale * act_at(candidate) > budget:
        candidate -= 64
    return candidate if candidate >= 64 else None


def _at_length(evaluator, seq_len: int) -> MemoryEvaluator:
    """The plan's evaluation at another sequence length, everything else the same."""
    base = evaluator.evaluation
    return MemoryEvaluator(Evaluation(base.resolved, seq_len=seq_len, optimizer=base.optimizer,
                                      attention=base.attention, gpus_per_node=base.gpus_per_node, gpu=base.gpu),
                           evaluator.method)


def _with_optimizer(evaluator, optimizer, world, precision, zero3: bool, batch: int):
    """The least-memory configuration with another optimizer (a second evaluation; traces are shared)."""
    return _variant(evaluator, optimizer=optimizer).estimate(
        _least_memory_config(world, precision, 3 if zero3 else 0, NO_OFFLOAD, batch))


def _variant(evaluator, *, resolved=None, optimizer: str | None = None) -> MemoryEvaluator:
    """The plan's evaluation with another model (its adapters) or optimizer, everything else the same."""
    base = evaluator.evaluation
    return MemoryEvaluator(Evaluation(resolved or base.resolved, seq_len=base.seq_len,
                                      optimizer=optimizer or base.optimizer, attention=base.attention,
                                      gpus_per_node=base.gpus_per_node, gpu=base.gpu), evaluator.method)
