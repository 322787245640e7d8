"""What would fit when nothing does: more GPUs, a larger GPU, offload, 8-bit Adam, LoRA / QLoRA adapters, a shorter
sequence.

Each suggestion is computed with the same memory model as the plan (traced where it can be), at the
smallest micro-batch, with full checkpointing (the least memory any candidate can have), and says its
numbers. The shorter-sequence figure comes from a quadratic fit of three traced sequence lengths.
"""

from __future__ import annotations

from planner import hardware as hw
from planner.config import Config
from planner.errors import InputError
from planner.hardware.systems import usual_system
from planner.memory.estimate import Evaluation, sequence_fit
from planner.models import trained_as
from planner.models.adapters import Adapter
from planner.notes import Lever, lever
from planner.search import MemoryEvaluator
from planner.vocab import ADAMW_8BIT, FULL, NO_OFFLOAD, OFFLOAD_ALL, PRECISION

def _least_memory_config(world: int, precision: str, zero: int, offload: str) -> Config:
    return Config(micro_batch=1, grad_accum=1, world_size=world, precision=precision,
                  checkpointing=FULL, zero_stage=zero, offload=offload)


def _mixed_precision(gpu) -> str:
    """The GPU's 16-bit autocast precision (bf16 where it has it)."""
    usable = [p for p, info in PRECISION.items() if info.autocast and not gpu.cannot_run(p)]
    return max(usable, key=lambda p: PRECISION[p].needs_bf16)


def suggestions(plan, evaluator, gpu, offload: str) -> list[Lever]:
    """The levers that would fit, each a configuration trainplan plans (QLoRA: no ZeRO-3, no offload); `offload` is
    the request's (`none` pinned means offload was ruled out by the user)."""
    hwinfo = plan.hardware
    budget = hwinfo.budget_bytes
    precision = _mixed_precision(gpu)
    world = hwinfo.gpus_per_node * hwinfo.nodes
    adapter = evaluator.evaluation.resolved.spec.adapter
    shards = _least_memory_config(2, precision, 3, NO_OFFLOAD).adapter_problem(adapter) is None
    best = evaluator.estimate(_least_memory_config(world, precision, 3 if world > 1 and shards else 0, NO_OFFLOAD))
    smallest = dict(precision=precision, zero3=world > 1 and shards, peak=best.peak, budget=budget)
    if best.peak <= budget:  # the search ruled it out: the user's pinned choices exclude every fitting one
        return [lever("pinned", **smallest)]
    out = [lever("smallest", **smallest)]
    for n in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if shards else ():
        total = world * n
        if total > 4096:
            break
        est = evaluator.estimate(_least_memory_config(total, precision, 3, NO_OFFLOAD))
        if est.peak <= budget:
            # a single node grows to its usual system's GPU count before more nodes are added
            per_node = hwinfo.gpus_per_node if hwinfo.nodes > 1 else max(hwinfo.gpus_per_node,
                                                                          min(total, _system_gpus(gpu.name)))
            out.append(lever("more-gpus", gpus=total, gpu=gpu.name, nodes=-(-total // per_node), per_node=per_node,
                             peak=est.peak))
            break
    need = best.peak / (1 - hwinfo.headroom)
    bigger = sorted((g for g in hw.catalog() if g.memory_bytes >= need and not g.cannot_run(precision)),
                    key=lambda g: g.memory_bytes)
    if bigger:
        out.append(lever("larger-gpu", gpu=bigger[0].name, gpu_gib=bigger[0].memory_gib, peak=best.peak))
    off = evaluator.estimate(_least_memory_config(world, precision, 3, OFFLOAD_ALL)) if shards else None
    if off is not None:
        out.append(_offload_lever(plan, off, budget, offload))
    eight = _with_optimizer(evaluator, ADAMW_8BIT, world, precision, smallest["zero3"])
    if plan.optimizer != ADAMW_8BIT and eight.peak <= budget:
        out.append(lever("adamw-8bit", peak=eight.peak))
    out += _adapter_lever(evaluator, world, precision, budget)
    shorter = _shorter_sequence(plan, evaluator, best, budget, world, precision, NO_OFFLOAD, smallest["zero3"])
    if shorter:
        out.append(lever("shorter-sequence", seq_len=shorter))
    elif off is not None and off.peak > budget:  # the states alone overflow: a shorter sequence, all offloaded
        shorter = _shorter_sequence(plan, evaluator, off, budget, world, precision, OFFLOAD_ALL)
        if shorter:
            out.append(lever("offload-shorter-sequence", seq_len=shorter))
    return out


def _system_gpus(gpu_name: str) -> int:
    """GPUs in the usual system of a catalog GPU; 1 for a GPU outside the catalog."""
    try:
        return usual_system(gpu_name).gpus
    except KeyError:
        return 1


def _adapter_lever(evaluator, world: int, precision: str, budget: int) -> list[Lever]:
    """Adapters instead of full fine-tuning: LoRA (a 16-bit frozen base), else QLoRA (a 4-bit one), with peft's
    defaults here (`planner.models.adapters`), at micro-batch 1 with full checkpointing on one GPU or DDP."""
    base = evaluator.evaluation
    if base.resolved.adapter is not None or base.resolved.config is None:
        return []
    tried: dict = {}
    for method in ("lora", "qlora"):
        try:
            resolved = trained_as(base.resolved, adapter=Adapter(method))
        except InputError:  # peft missing, or no linear layers to adapt
            return []
        est = _variant(evaluator, resolved=resolved).estimate(_least_memory_config(world, precision, 0, NO_OFFLOAD))
        tried.update({f"{method}_label": Adapter(method).label(), f"{method}_peak": est.peak,
                      f"{method}_trainable": resolved.spec.trainable_parameters})
        if est.peak <= budget:
            return [lever("adapters", fits=method, **tried)]
    return [lever("adapters-short", fits=None, **tried)]


def _offload_lever(plan, off, budget: int, offload: str) -> Lever:
    """Full offload (ZeRO-3, optimizer and parameters in host memory): its numbers, fitting or not."""
    host = plan.hardware.host_memory_bytes
    if off.peak > budget:
        return lever("offload-short", peak=off.peak, over=off.peak - budget)
    if host and off.cpu_offload_bytes > host:
        return lever("offload-host", peak=off.peak, host_bytes=off.cpu_offload_bytes, host_budget=host)
    return lever("offload", peak=off.peak, host_bytes=off.cpu_offload_bytes, was_off=offload == NO_OFFLOAD)


def _shorter_sequence(plan, evaluator, best, budget: int, world: int, precision: str, offload: str,
                     zero3: bool = False) -> int | None:
    """The longest multiple of 64 below the planned length whose activations fit next to the model states of
    `best` (the least-memory configuration with `offload`), from a quadratic fit of three traced lengths
    (analytic when the model cannot be traced)."""

    # states and fixed overheads do not depend on the sequence; the error margin and the allocator's slack grow
    # with the activations they are taken on
    variable = best.activations + best.terms.error_margin + best.terms.allocator_slack
    fixed, scale = best.peak - variable, variable / best.activations if best.activations else 1.0
    if fixed >= budget or plan.seq_len < 128:
        return None
    s = plan.seq_len
    lens = (max(64, s // 4 // 64 * 64), max(128, s // 2 // 64 * 64), s)
    if len(set(lens)) < 3:
        return None
    cfg = _least_memory_config(world, precision, 3 if offload != NO_OFFLOAD or zero3 else 0, offload)
    try:
        act_at = sequence_fit(evaluator.evaluation, cfg, lens).activations
    except Exception:  # noqa: BLE001 - untraceable model: activations roughly proportional to length
        act_at = lambda n: best.activations * n / s  # noqa: E731
    candidate = (s - 1) // 64 * 64
    while candidate >= 64 and fixed + scale * act_at(candidate) > budget:
        candidate -= 64
    return candidate if candidate >= 64 else None


def _with_optimizer(evaluator, optimizer, world, precision, zero3: bool):
    """The least-memory configuration with another optimizer (a second evaluation; traces are shared)."""
    return _variant(evaluator, optimizer=optimizer).estimate(
        _least_memory_config(world, precision, 3 if zero3 else 0, NO_OFFLOAD))


def _variant(evaluator, *, resolved=None, optimizer: str | None = None) -> MemoryEvaluator:
    """The plan's evaluation with another model (its adapters) or optimizer, everything else the same."""
    base = evaluator.evaluation
    return MemoryEvaluator(Evaluation(resolved or base.resolved, seq_len=base.seq_len,
                                      optimizer=optimizer or base.optimizer, attention=base.attention,
                                      gpus_per_node=base.gpus_per_node, gpu=base.gpu), evaluator.method)
