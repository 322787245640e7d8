"""What would fit when nothing does: a wider sequence split, more GPUs, a larger GPU, offload, 8-bit Adam, LoRA / QLoRA
adapters, a shorter sequence.

Each suggestion is computed with the same memory model as the plan (traced where it can be), at the smallest
micro-batch, with full checkpointing (the least memory any candidate can have) unless the request pinned otherwise
(a re-plan with the suggestion's flags keeps its pins), with each sequence whole or split as the plan would split it
(the split pinned, else the widest each library runs within a node, from AUTO_SPLIT_FROM tokens), and says its
numbers. The shorter-sequence figure comes from a quadratic fit of three traced sequence lengths.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from planner import hardware as hw
from planner.config import Config
from planner.errors import InputError
from planner.hardware.systems import node_gpus
from planner.memory.estimate import Evaluation, MemoryEstimate, sequence_fit
from planner.models import trained_as
from planner.models.adapters import Adapter
from planner.notes import Lever, lever
from planner.program.sequence import sequence_split_share
from planner.search import MemoryEvaluator, engine_for
from planner.vocab import (
    ADAMW_8BIT, AUTO, AUTO_SPLIT_FROM, CONTEXT_PARALLEL, DEFAULT_SHARDING_ENGINE, FULL, NO_OFFLOAD, OFFLOAD_ALL,
    OFFLOAD_OPTIMIZER, PRECISION, SEQUENCE_SPLIT, SPLIT_FIELDS, SPLIT_OFF,
)

#: --host-memory is suggested in steps of this many GB (a machine's RAM comes in such sizes).
HOST_STEP_GB = 64

#: A split: the request's field that splits each sequence (`vocab.SPLIT_FIELDS`) and over how many GPUs
Split = tuple[str, int]


@dataclass(frozen=True)
class Splits:
    """The sequence splits advice may use: the one the user pinned, else (from AUTO_SPLIT_FROM tokens) the widest of
    each kind the request leaves on auto; `problem(field, size, world, seq_len)` says why one cannot run
    (planning.split_problem)."""

    seq_len: int
    pinned: Split | None
    modes: dict[str, str]            # the request's --context-parallel / --sequence-parallel values
    problem: Callable[[str, int, int, int], str | None]

    def options(self, world: int, per_node: int, across_nodes: bool = False) -> list[Split]:
        """The splits to weigh on `world` GPUs, `per_node` to a node: the pinned one, else the widest of each kind
        within a node (and, `across_nodes`, the widest over all the GPUs), narrowest first."""
        seq = self.seq_len
        if self.pinned:
            return [self.pinned] if not self.problem(*self.pinned, world, seq) else []
        if seq < AUTO_SPLIT_FROM:
            return []
        out = []
        for field in (f for f in SPLIT_FIELDS if self.modes[f] == AUTO):
            sizes = [n for n in range(2, world + 1) if world % n == 0 and not self.problem(field, n, world, seq)]
            within = [n for n in sizes if n <= per_node]
            out += [(field, n) for n in {*within[-1:], *(sizes[-1:] if across_nodes else ())}]
        return sorted(out, key=lambda split: split[1])

    def unpinned(self) -> Splits:
        """Every split a library runs, whatever the request pinned or turned off."""
        return replace(self, pinned=None, modes=dict.fromkeys(SPLIT_FIELDS, AUTO))

    def changes(self, split: Split | None, per_node: int, seq_len: int) -> dict:
        """The request's split fields that make a re-plan weigh `split` (none where it would anyway)."""
        if split is None or split == self.pinned:
            return {}
        field, size = split
        if not self.pinned and self.modes[field] == AUTO and seq_len >= AUTO_SPLIT_FROM and size <= per_node:
            return {}
        unpin = {f: AUTO for f in SPLIT_FIELDS if self.modes[f] not in (AUTO, SPLIT_OFF)}
        return {**unpin, field: str(size)}


@dataclass(frozen=True)
class Least:
    """The least-memory configuration of a kind: its estimate and the sequence split it runs with."""

    estimate: MemoryEstimate
    config: Config
    split: Split | None

    @property
    def peak(self) -> int:
        return self.estimate.peak

    def split_values(self) -> dict:
        """The split as a suggestion's values: ways (1: whole sequences) and by (context | sequence), with the ZeRO
        stage and what is offloaded."""
        field, size = self.split or (CONTEXT_PARALLEL, 1)
        return {"ways": size, "by": "context" if field == CONTEXT_PARALLEL else "sequence",
                "zero": self.config.zero_stage, "offloaded": self.config.offload}

    def values(self, budget: int, pinned: bool) -> dict:
        """What the smallest configuration's sentence says: its settings, its peak against the budget."""
        cfg = self.config
        return dict(precision=cfg.precision, zero3=cfg.zero_stage == 3, peak=self.peak, budget=budget,
                    micro_batch=cfg.micro_batch, checkpointing=cfg.checkpointing, pinned=pinned,
                    **self.split_values())


@dataclass(frozen=True)
class Pins:
    """The request's pinned choices, which a re-plan with a suggestion's flags keeps: levers are computed under them
    (None: the planner's choice, so the least-memory one)."""

    precision: str | None = None
    checkpointing: str | None = None
    micro_batch: int | None = None
    zero_stage: int | None = None
    engine: str = DEFAULT_SHARDING_ENGINE

    @property
    def any(self) -> bool:
        return self != Pins(engine=self.engine)


@dataclass(frozen=True)
class Advice:
    """A request that fits nowhere, as the levers need it."""

    plan: object                  # the rejected Plan
    evaluator: MemoryEvaluator
    gpu: hw.GPU
    offload: str                  # the request's (`none` pinned: the user ruled offload out)
    sequence: str                 # the field a shorter sequence is asked with (max_length for a dataset's rows)
    splits: Splits
    pins: Pins

    @property
    def hardware(self):
        return self.plan.hardware

    @property
    def world(self) -> int:
        return self.hardware.gpus_per_node * self.hardware.nodes

    @property
    def batch(self) -> int:
        return self.plan.choice.config.global_batch

    @property
    def budget(self) -> int:
        return self.hardware.budget_bytes

    @property
    def precision(self) -> str:
        """The GPU's 16-bit autocast precision (bf16 where it has it)."""
        usable = [p for p, info in PRECISION.items()
                  if info.autocast and not info.float8 and not self.gpu.cannot_run(p)]
        return max(usable, key=lambda p: PRECISION[p].needs_bf16)

    @property
    def shards(self) -> bool:
        """Whether the trained model can be sharded (QLoRA's 4-bit base cannot)."""
        cfg = Config(micro_batch=1, grad_accum=1, world_size=2, precision=self.precision, checkpointing=FULL,
                     zero_stage=3, offload=NO_OFFLOAD)
        return cfg.adapter_problem(self.evaluator.resolved.spec.adapter) is None

    @property
    def offload_all(self) -> str:
        """The fullest offload the pinned ZeRO stage allows (optimizer and parameters at stage 3)."""
        return OFFLOAD_ALL if self.pins.zero_stage in (None, 3) else OFFLOAD_OPTIMIZER


def _config(a: Advice, evaluator: MemoryEvaluator, world: int, zero: int, offload: str, split: Split | None,
            pinned: bool) -> Config | None:
    """The least memory a candidate of the step's batch can have on `world` GPUs (`pinned`: keeping what the request
    pinned, else micro-batch 1, full checkpointing, 16-bit), each sequence split as `split` says under the engine
    that split runs on; None where that cannot run (or train the evaluator's optimizer and adapter). Accumulation
    holds a gradient buffer of its own where there is accumulation."""
    pins = a.pins if pinned else Pins()
    precision = pins.precision or a.precision
    zero = zero if pins.zero_stage is None else pins.zero_stage
    field, size = split or (None, 1)
    ranks, micro_batch = world // size, pins.micro_batch or 1
    if a.batch % ranks or (a.batch // ranks) % micro_batch:
        return None
    fields = dict(world_size=world, precision=precision, zero_stage=zero, offload=offload,
                  engine=SEQUENCE_SPLIT[field] if field else engine_for(zero, pins.engine, precision),
                  **({field: size} if field else {}))
    if Config.problem_of(**fields):
        return None
    cfg = Config(micro_batch=micro_batch, grad_accum=a.batch // ranks // micro_batch,
                 checkpointing=pins.checkpointing or FULL, **fields)
    spec = evaluator.resolved.spec
    return None if cfg.optimizer_problem(evaluator.evaluation.optimizer) or cfg.adapter_problem(spec.adapter) else cfg


def _least(advice: Advice, *, evaluator: MemoryEvaluator | None = None, world: int | None = None,
           per_node: int | None = None, offload: str = NO_OFFLOAD, zero_whole: int | None = None,
           across_nodes: bool = False, pinned: bool = True) -> list[Least]:
    """The least-memory configurations of a kind on `world` GPUs that can run, simplest first: whole sequences
    (unless a split is pinned; ZeRO-3 where sharding helps, else `zero_whole`), then each split the plan would weigh
    (ZeRO-3)."""
    evaluator, world = evaluator or advice.evaluator, world or advice.world
    per_node, splits = per_node or advice.hardware.gpus_per_node, advice.splits
    whole_zero = 3 if offload != NO_OFFLOAD or (world > 1 and advice.shards) else 0
    tried: list[tuple[Split | None, int]] = []
    if not (splits.pinned and advice.shards):
        tried.append((None, whole_zero if zero_whole is None else zero_whole))
    if advice.shards:
        tried += [(split, 3) for split in splits.options(world, per_node, across_nodes=across_nodes)]
    configs = [(split, _config(advice, evaluator, world, zero, offload, split, pinned)) for split, zero in tried]
    return [Least(evaluator.estimate(cfg), cfg, split) for split, cfg in configs if cfg is not None]


def _pick(options: list[Least], budget: int) -> Least | None:
    """The simplest that fits, else the one that needs least (None where nothing can run)."""
    return next((o for o in options if o.peak <= budget), None) or min(options, key=lambda o: o.peak, default=None)


def suggestions(plan, evaluator, gpu, offload: str, sequence: str = "seq_len", splits: Splits | None = None,
                pins: Pins | None = None) -> list[Lever]:
    """The levers that would fit, each a configuration trainplan plans (QLoRA: no ZeRO-3, no offload) under the
    request's `pins`, with the request's fields that make it fit; `offload` is the request's (`none` pinned means
    offload was ruled out by the user); `sequence` the field a shorter sequence is asked with (max_length for a
    dataset's rows); `splits` the sequence splits the plan weighs (None: sequences stay whole)."""
    splits = splits or Splits(plan.seq_len, None, dict.fromkeys(SPLIT_FIELDS, SPLIT_OFF), lambda *_: "whole")
    a = Advice(plan=plan, evaluator=evaluator, gpu=gpu, offload=offload, sequence=sequence, splits=splits,
               pins=pins or Pins())
    free = min(_least(a, pinned=False), key=lambda o: o.peak)
    if free.peak <= a.budget:  # the search ruled it out: the user's pinned choices exclude every fitting one
        changes = splits.changes(free.split, a.hardware.gpus_per_node, plan.seq_len)
        kind = "split" if changes and not a.pins.any else "pinned"
        return [lever(kind, changes if kind == "split" else None, **free.values(a.budget, False))]
    best = min(_least(a), key=lambda o: o.peak, default=None) if a.pins.any else free
    best = best or free
    out = [lever("smallest", **best.values(a.budget, best is not free))] + _wider_split(a, best)
    more = _more_gpus(a) if a.shards else []
    larger = _larger_gpus(gpu, best.peak / (1 - a.hardware.headroom), best.config.precision)
    if larger:
        out.append(lever("larger-gpu", {"gpu": larger[0].name}, gpu=larger[0].name, gpu_gib=larger[0].memory_gib,
                         peak=best.peak))
    adapters = _adapter_lever(a)
    # adapters before a suggestion of many more GPUs (tens of nodes), after one of a few
    out += adapters + more if more and more[0]["gpus"] >= MANY_GPUS else more + adapters
    off = _pick(_least(a, offload=a.offload_all), a.budget) if a.shards else None
    if off is not None:
        out.append(_offload_lever(a, off))
    eight = _pick(_least(a, evaluator=_variant(evaluator, optimizer=ADAMW_8BIT)), a.budget)
    if plan.optimizer != ADAMW_8BIT and eight is not None and eight.peak <= a.budget:
        out.append(lever(ADAMW_8BIT, {"optimizer": ADAMW_8BIT, **_split_changes(a, eight)}, peak=eight.peak,
                         **eight.split_values()))
    return out + _shorter_levers(a, best, off)


def _split_changes(a: Advice, least: Least, per_node: int | None = None, seq_len: int | None = None) -> dict:
    return a.splits.changes(least.split, per_node or a.hardware.gpus_per_node, seq_len or a.plan.seq_len)


def _wider_split(a: Advice, best: Least) -> list[Lever]:
    """Where the user pinned a split (or turned splitting off), the split on these GPUs that fits instead."""
    if not (a.splits.pinned or any(a.splits.modes[f] != AUTO for f in SPLIT_FIELDS)) or not a.shards:
        return []
    options = [o for o in _least(replace(a, splits=a.splits.unpinned())) if o.split not in (None, best.split)]
    fits = next((o for o in options if o.peak <= a.budget), None)
    if fits is None:
        return []
    return [lever("split", _split_changes(a, fits), **fits.values(a.budget, a.pins.any))]


def _shorter_levers(a: Advice, best: Least, off: Least | None) -> list[Lever]:
    """A shorter sequence at which the least-memory configuration fits; where the states alone overflow, a shorter
    sequence with everything offloaded."""
    shorter = _shorter_sequence(a, best)
    if shorter:
        return [lever("shorter-sequence", {a.sequence: shorter, **_split_changes(a, best, seq_len=shorter)},
                      seq_len=shorter, **best.split_values())]
    if off is not None and off.peak > a.budget:
        shorter = _shorter_sequence(a, off)
        if shorter:
            return [lever("offload-shorter-sequence", {a.sequence: shorter, **_allow_offload(a, off),
                                                        **_split_changes(a, off, seq_len=shorter)},
                          seq_len=shorter, **off.split_values())]
    return []


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


def _more_gpus(a: Advice) -> list[Lever]:
    """The fewest GPUs (the current count times a power of two) on which ZeRO-3 fits, each sequence whole or split
    (within a node, else across the GPUs), as one lever: a node grows to the GPU's largest usual system before
    nodes are added."""
    hwinfo = a.hardware
    for n in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        total = a.world * n
        if total > MAX_SUGGESTED_GPUS:
            break
        per_node = _node_size(total, hwinfo, a.gpu.name)
        options = _least(a, evaluator=_variant(a.evaluator, gpus_per_node=per_node), world=total, per_node=per_node,
                         across_nodes=True)
        fits = next((o for o in options if o.peak <= a.budget), None)
        if fits is not None:
            nodes = total // per_node
            changes = {"gpus_per_node": per_node, **({"nodes": nodes} if nodes != hwinfo.nodes else {}),
                       **_split_changes(a, fits, per_node)}
            return [lever("more-gpus", changes, gpus=total, gpu=a.gpu.name, nodes=nodes, per_node=per_node,
                          peak=fits.peak, **fits.split_values())]
    return []


#: The most GPUs a suggestion names.
MAX_SUGGESTED_GPUS = 4096


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _node_size(total: int, hwinfo, gpu_name: str) -> int:
    """GPUs per node for `total` GPUs: as many as fit in one of the GPU's usual systems (grown from the user's node,
    a divisor of `total`); the user's own node size where the plan already spans nodes."""
    if hwinfo.nodes > 1:
        return hwinfo.gpus_per_node
    largest = max(hwinfo.gpus_per_node, node_gpus(gpu_name))
    return max(d for d in _divisors(total) if d <= largest and d % hwinfo.gpus_per_node == 0)


def _adapter_lever(a: Advice) -> list[Lever]:
    """Adapters instead of full fine-tuning: LoRA (a 16-bit frozen base), else QLoRA (a 4-bit one), with peft's
    defaults here (`planner.models.adapters`), at micro-batch 1 with full checkpointing on one GPU or DDP (or ZeRO-3
    with the split the plan weighs, for LoRA); where neither fits this GPU, the one that fits the smaller of them on
    the GPU of the user's kind that holds it."""
    base = a.evaluator.evaluation
    if base.resolved.adapter is not None or base.resolved.config is None:
        return []
    tried: dict = {}
    for method in ("lora", "qlora"):
        try:
            resolved = trained_as(base.resolved, adapter=Adapter(method))
        except InputError:  # peft missing, or no linear layers to adapt
            return []
        variant = _variant(a.evaluator, resolved=resolved)
        least = _pick(_least(replace(a, evaluator=variant), zero_whole=0), a.budget)
        if least is None:  # the pinned precision cannot train it (fp8 with adapters, QLoRA in fp32)
            continue
        tried.update({f"{method}_label": Adapter(method).label(), f"{method}_peak": least.peak,
                      f"{method}_trainable": resolved.spec.trainable_parameters, f"{method}_precision": least.config
                      .precision})
        if least.peak <= a.budget:
            return [lever("adapters", {"peft": method, **_split_changes(a, least)}, fits=method, **tried)]
    methods = [m for m in ("lora", "qlora") if f"{m}_peak" in tried]
    if not methods:
        return []
    method = min(methods, key=lambda m: tried[f"{m}_peak"])
    larger = _larger_gpus(a.gpu, tried[f"{method}_peak"] / (1 - a.hardware.headroom), tried[f"{method}_precision"])
    if larger:
        return [lever("adapters", {"peft": method, "gpu": larger[0].name}, fits=method, gpu=larger[0].name,
                      **tried)]
    return [lever("adapters-short", fits=None, **tried)]


def _offload_lever(a: Advice, off: Least) -> Lever:
    """Full offload (ZeRO-3, optimizer and parameters in host memory): its numbers, fitting or not."""
    host, est = a.hardware.host_memory_bytes, off.estimate
    if off.peak > a.budget:
        return lever("offload-short", peak=off.peak, over=off.peak - a.budget, **off.split_values())
    allow = {**_allow_offload(a, off), **_split_changes(a, off)}
    if host and est.cpu_offload_bytes > host:
        host_gb = math.ceil(est.cpu_offload_bytes / 1e9 / HOST_STEP_GB) * HOST_STEP_GB  # the --host-memory to give
        return lever("offload-host", {"host_memory": host_gb * 10**9, **allow}, peak=off.peak,
                     host_bytes=est.cpu_offload_bytes, host_budget=host, **off.split_values())
    return lever("offload", allow, peak=off.peak, host_bytes=est.cpu_offload_bytes, was_off="offload" in allow,
                 **off.split_values())


def _allow_offload(a: Advice, off: Least) -> dict:
    """--offload auto where the request pinned another offload than `off`'s (none: the user ruled it out)."""
    return {} if a.offload in (AUTO, off.config.offload) else {"offload": AUTO}


def _shorter_sequence(a: Advice, least: Least) -> int | None:
    """The longest multiple of 64 (of twice the split, for ring attention's load balance) below the planned length
    at which `least` fits: found from a quadratic fit of three traced lengths (analytic when the model cannot be
    traced), then checked by estimating it at that length, refitting nearer it while it does not fit (a fit from far
    longer sequences can miss by tens of percent)."""
    below, at = a.plan.seq_len, least.estimate
    step = math.lcm(64, 2 * least.config.sequence_split) if least.split else 64
    for _ in range(SEQUENCE_TRIES):
        candidate = _fitted_length(a.evaluator.evaluation, least.config, at, below, a.budget, step)
        if candidate is None:
            return None
        at = _variant(a.evaluator, seq_len=candidate).estimate(least.config)
        if at.peak <= a.budget:
            return candidate
        below = candidate
    return None


#: Fits (each checked by an estimate at its answer) before the shorter-sequence search gives up.
SEQUENCE_TRIES = 3


def _fitted_length(evaluation, cfg, best, below: int, budget: int, step: int = 64) -> int | None:
    """The longest multiple of `step` under `below` whose activations, fitted from traces at below/4, below/2 and
    below (and shared out over the split), fit next to the model states of `best` (an estimate at `below`)."""
    # states and fixed overheads do not depend on the sequence; the error margin and the allocator's slack grow
    # with the activations they are taken on
    variable = best.activations + best.terms.error_margin + best.terms.allocator_slack
    fixed, scale = best.peak - variable, variable / best.activations if best.activations else 1.0
    if fixed >= budget or below < 128:
        return None
    lens = (max(64, below // 4 // 64 * 64), max(128, below // 2 // 64 * 64), below)
    if len(set(lens)) < 3:
        return None
    share = sequence_split_share(cfg)
    try:
        fit = sequence_fit(evaluation, cfg, lens).activations
        act_at = lambda n: fit(n) * share  # noqa: E731 - the fit is of the unsplit step
    except Exception:  # noqa: BLE001 - untraceable model: activations roughly proportional to length
        act_at = lambda n: best.activations * n / below  # noqa: E731
    candidate = (below - 1) // step * step
    while candidate >= step and fixed + scale * act_at(candidate) > budget:
        candidate -= step
    return candidate if candidate >= step else None


def _variant(evaluator, *, resolved=None, optimizer: str | None = None, seq_len: int | None = None,
             gpus_per_node: int | None = None) -> MemoryEvaluator:
    """The plan's evaluation with another model (its adapters), optimizer, sequence length or node size, everything
    else the same (traces are shared); the plan's own evaluator where nothing differs."""
    base = evaluator.evaluation
    if (resolved, optimizer, seq_len) == (None, None, None) and gpus_per_node in (None, base.gpus_per_node):
        return evaluator
    return MemoryEvaluator(Evaluation(resolved or base.resolved, seq_len=seq_len or base.seq_len,
                                      optimizer=optimizer or base.optimizer, attention=base.attention,
                                      gpus_per_node=gpus_per_node or base.gpus_per_node, gpu=base.gpu),
                           evaluator.method)
