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
from planner.memory.estimate import Evaluation, sequence_fit
from planner.models import trained_as
from planner.models.adapters import Adapter
from planner.search import MemoryEvaluator
from planner.vocab import ADAMW_8BIT, FULL, NO_OFFLOAD, OFFLOAD, OFFLOAD_ALL, PRECISION

_GIB = 2**30


def _least_memory_config(world: int, precision: str, zero: int, offload: str) -> Config:
    return Config(micro_batch=1, grad_accum=1, world_size=world, precision=precision,
                  checkpointing=FULL, zero_stage=zero, offload=offload)


def _mixed_precision(gpu) -> str:
    """The GPU's 16-bit autocast precision (bf16 where it has it)."""
    usable = [p for p, info in PRECISION.items() if info.autocast and not gpu.cannot_run(p)]
    return max(usable, key=lambda p: PRECISION[p].needs_bf16)


def suggestions(plan, evaluator, gpu) -> list[str]:
    hwinfo = plan.hardware
    budget = hwinfo.budget_bytes
    precision = _mixed_precision(gpu)
    world = hwinfo.gpus_per_node * hwinfo.nodes
    out: list[str] = []
    best = evaluator.estimate(_least_memory_config(world, precision, 3 if world > 1 else 0, NO_OFFLOAD))
    smallest = (f"The smallest configuration (micro-batch 1, full checkpointing, {precision}"
                f"{', ZeRO-3' if world > 1 else ''}) needs {best.peak / _GIB:.1f} GiB per GPU")
    if best.peak <= budget:  # the search ruled it out: the user's pinned choices exclude every fitting one
        return [f"{smallest} and fits the {budget / _GIB:.1f} GiB budget: the choices you pinned (micro-batch, "
                f"precision, checkpointing, ZeRO stage, offload, engine) rule it out. Pin fewer of them."]
    out.append(f"{smallest}; the budget is {budget / _GIB:.1f} GiB.")
    for n in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        total = world * n
        if total > 4096:
            break
        est = evaluator.estimate(_least_memory_config(total, precision, 3, NO_OFFLOAD))
        if est.peak <= budget:
            nodes = max(1, total // max(hwinfo.gpus_per_node, 1))
            out.append(f"More GPUs: {total} x {gpu.name} ({nodes} node(s) of {hwinfo.gpus_per_node}) with ZeRO-3 "
                       f"need {est.peak / _GIB:.1f} GiB per GPU (the global batch must divide by {total}).")
            break
    need = best.peak / (1 - hwinfo.headroom)
    bigger = sorted((g for g in hw.catalog() if g.memory_bytes >= need and not g.cannot_run(precision)),
                    key=lambda g: g.memory_bytes)
    if bigger:
        out.append(f"A larger GPU: {bigger[0].name} ({bigger[0].memory_gib:.0f} GiB) holds the smallest "
                   f"configuration ({best.peak / _GIB:.1f} GiB).")
    off = evaluator.estimate(_least_memory_config(world, precision, 3, OFFLOAD_ALL))
    out.append(_offload_lever(plan, off, budget))
    eight = _with_optimizer(evaluator, ADAMW_8BIT, world, precision)
    if plan.optimizer != ADAMW_8BIT and eight.peak <= budget:
        out.append(f"8-bit AdamW (bitsandbytes): optimizer states shrink from 8 to 2 bytes per parameter; "
                   f"peak {eight.peak / _GIB:.1f} GiB fits (--optimizer {ADAMW_8BIT}).")
    out.append(_adapter_lever(evaluator, world, precision, budget))
    shorter = _shorter_sequence(plan, evaluator, best, budget, world, precision, NO_OFFLOAD)
    if shorter:
        out.append(f"A shorter sequence: {shorter} tokens fit at micro-batch 1 with full checkpointing "
                   f"(--seq-len {shorter}).")
    elif off.peak > budget:  # the states alone overflow the card: the shorter sequence with everything offloaded
        shorter = _shorter_sequence(plan, evaluator, off, budget, world, precision, OFFLOAD_ALL)
        if shorter:
            out.append(f"Offload and a shorter sequence: with optimizer and parameters in CPU memory, {shorter} "
                       f"tokens fit at micro-batch 1 with full checkpointing (--seq-len {shorter}).")
    return [line for line in out if line]


def _adapter_lever(evaluator, world: int, precision: str, budget: int) -> str:
    """Adapters instead of full fine-tuning: LoRA (a 16-bit frozen base), else QLoRA (a 4-bit one), with peft's
    defaults here (`planner.models.adapters`), at micro-batch 1 with full checkpointing on one GPU or DDP."""

    base = evaluator.evaluation
    if base.resolved.adapter is not None or base.resolved.config is None:
        return ""
    tried = []
    for method in ("lora", "qlora"):
        try:
            resolved = trained_as(base.resolved, adapter=Adapter(method))
        except InputError:  # peft missing, or no linear layers to adapt
            return ""
        est = _variant(evaluator, resolved=resolved).estimate(_least_memory_config(world, precision, 0, NO_OFFLOAD))
        trainable = resolved.spec.trainable_parameters / 1e6
        what = (f"{Adapter(method).label()} (--peft {method}; {trainable:.0f}M trainable) needs "
                f"{est.peak / _GIB:.1f} GiB per GPU")
        if est.peak <= budget:
            return "Adapters instead of full fine-tuning: " + "; ".join(tried + [what + ", which fits."])
        tried.append(what)
    return "Adapters do not fit either: " + "; ".join(tried) + "."


def _offload_lever(plan, off, budget: int) -> str:
    """Full offload (ZeRO-3, optimizer and parameters in host memory): its numbers, fitting or not."""
    host = plan.hardware.host_memory_bytes
    ram = f"{off.cpu_offload_bytes / _GIB:.0f} GiB of host memory"
    if off.peak > budget:
        return (f"Offload alone is not enough: ZeRO-3 with optimizer and parameters in CPU memory still needs "
                f"{off.peak / _GIB:.1f} GiB per GPU, {(off.peak - budget) / _GIB:.1f} GiB over the budget.")
    if host and off.cpu_offload_bytes > host:
        return (f"Offload fits the GPU ({off.peak / _GIB:.1f} GiB) but needs {ram}, more than the "
                f"{host / _GIB:.0f} GiB per node planned for (--host-memory).")
    return (f"Offload: ZeRO-3 with optimizer and parameters in CPU memory needs {off.peak / _GIB:.1f} GiB per GPU "
            f"and {ram}{' (drop --no-offload)' if not _offloads(plan) else ''}.")


def _shorter_sequence(plan, evaluator, best, budget: int, world: int, precision: str, offload: str) -> int | None:
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
    cfg = _least_memory_config(world, precision, 3 if world > 1 or offload != NO_OFFLOAD else 0, offload)
    try:
        act_at = sequence_fit(evaluator.evaluation, cfg, lens).activations
    except Exception:  # noqa: BLE001 - untraceable model: activations roughly proportional to length
        act_at = lambda n: best.activations * n / s  # noqa: E731
    candidate = (s - 1) // 64 * 64
    while candidate >= 64 and fixed + scale * act_at(candidate) > budget:
        candidate -= 64
    return candidate if candidate >= 64 else None


def _offloads(plan) -> set[str]:
    """The offloads the plan searched (empty with --no-offload)."""
    return {c.config.offload for c in plan.candidates if OFFLOAD[c.config.offload].optimizer_on_cpu}


def _with_optimizer(evaluator, optimizer, world, precision):
    """The least-memory configuration with another optimizer (a second evaluation; traces are shared)."""
    return _variant(evaluator, optimizer=optimizer).estimate(
        _least_memory_config(world, precision, 3 if world > 1 else 0, NO_OFFLOAD))


def _variant(evaluator, *, resolved=None, optimizer: str | None = None) -> MemoryEvaluator:
    """The plan's evaluation with another model (its adapters) or optimizer, everything else the same."""
    base = evaluator.evaluation
    return MemoryEvaluator(Evaluation(resolved or base.resolved, seq_len=base.seq_len,
                                      optimizer=optimizer or base.optimizer, attention=base.attention,
                                      gpus_per_node=base.gpus_per_node, gpu=base.gpu), evaluator.method)
