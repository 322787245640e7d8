"""Candidate enumeration and choice.

Every (micro_batch, N) with micro_batch x N x world_size == global batch, x precision x checkpointing x
sharding stage x offload that the engine can run. Speed is modelled for all of them (cheap). Memory is evaluated
walking from the fastest: a candidate that could still be chosen is rejected by its exact model states, screened
out by formulas (its reason then says "estimated"), or traced exactly at its own micro-batch; each trace also
calibrates the formulas of its trace family. Slower candidates get calibrated (or plain) analytic estimates, and
their `method` says so.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from planner import facts
from planner.config import Config
from planner.errors import InputError
from planner.hardware import GPU
from planner.invariants import Physics, guarded
from planner.memory import states
from planner.memory.analytic import tensor_parallel_activations
from planner.memory.estimate import Evaluation, MemoryEstimate
from planner.notes import Verdict
from planner.program.sequence import sequence_split_share
from planner.request import PlanRequest, flag_of
from planner.speed.model import SpeedModel
from planner.types import Candidate
from planner.vocab import (
    ANALYTIC, DEEPSPEED, DEFAULT_OPTIMIZER, DEFAULT_PRECISION, DEFAULT_SHARDING_ENGINE, FSDP, NO_ADAPTER, NO_OFFLOAD,
    PACKING, PRECISION, TRACE, UNSHARDED_ENGINE,
)


@dataclass(frozen=True)
class SearchSpace:
    global_batch: int
    world_size: int
    gpus_per_node: int
    precisions: tuple[str, ...]
    checkpointing: tuple[str, ...]
    zero_stages: tuple[int, ...]
    offloads: tuple[str, ...]                 # the offloads the search may use
    micro_batch: int | None = None
    engine: str = DEFAULT_SHARDING_ENGINE
    optimizer: str = DEFAULT_OPTIMIZER
    adapter: str = NO_ADAPTER                 # what trains (`vocab.ADAPTER`)
    tensor_parallel: tuple[int, ...] = ()     # tensor-parallel sizes > 1 to plan beside data parallelism
    whole_layers: bool = True                 # plan configurations that keep each layer on one GPU
    context_parallel: tuple[int, ...] = ()    # ring-attention sizes > 1 (FSDP2), beside unsplit sequences
    sequence_parallel: tuple[int, ...] = ()   # Ulysses sizes > 1 (DeepSpeed), beside unsplit sequences
    whole_sequences: bool = True              # plan configurations that keep each sequence on one GPU
    compiled: tuple[bool, ...] = (False,)     # eager, compiled (torch.compile), or both (`vocab.COMPILE`)
    liger: tuple[bool, ...] = (False,)        # without, with Liger-Kernel's patches, or both
    paddings: tuple[str | None, ...] = (None,)  # how a dataset's samples are batched (`vocab.PADDING`); None: no data
    train_steps: int | None = None            # the run's optimizer steps, over which compile time is spread
    packed_rows: int | None = None            # packed rows per step (a multiple of the GPUs), for packing candidates

    def batch_of(self, padding: str | None) -> int:
        """Rows per optimizer step: packed rows for packing, else the global batch (a sample per row)."""
        return self.packed_rows if padding == PACKING and self.packed_rows else self.global_batch


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def nearest_valid_batches(batch: int, world: int) -> tuple[int, int]:
    low = (batch // world) * world
    return (low if low > 0 else world), low + world


def engine_for(zero_stage: int, sharding_engine: str, precision: str | None = None) -> str:
    """The engine of a stage; float8 shards through FSDP2 whatever --engine says, as tensor parallelism does
    (accelerate's AO backend with torchao's float8 all-gather; under DeepSpeed accelerate trains in bf16)."""
    if zero_stage == 0:
        return UNSHARDED_ENGINE
    return FSDP if precision is not None and PRECISION[precision].float8 else sharding_engine


def enumerate_configs(space: SearchSpace) -> list[Config]:
    """Every split of the step's rows with every combination of the space's choices that can run (`Config.problem`)
    and is worth running (`Config.redundant`)."""
    out = []
    for padding in space.paddings:
        rows = space.batch_of(padding)
        out += [c.model_copy(update={"compiled": compiled, "liger": liger, "padding": padding})
                for c in _splits(space, rows) for compiled in space.compiled for liger in space.liger]
    return out


def _splits(space: SearchSpace, rows: int) -> list[Config]:
    """The configurations of `rows` rows per step, before compile, Liger and batching are chosen."""
    whole = (_whole_sequence_configs(space, rows) if space.whole_layers else []) + \
        _tensor_parallel_configs(space, rows) if space.whole_sequences else []
    return whole + _sequence_split_configs(space, rows)


def _whole_sequence_configs(space: SearchSpace, rows: int) -> list[Config]:
    """Data parallelism (DDP, ZeRO, FSDP) over every GPU, each holding whole sequences."""
    if rows % space.world_size:
        return []
    per_gpu = rows // space.world_size
    mbs = [mb for mb in ([space.micro_batch] if space.micro_batch else divisors(per_gpu)) if per_gpu % mb == 0]
    out = []
    for zero in space.zero_stages:
        for precision in space.precisions:
            engine = engine_for(zero, space.engine, precision)
            for off in space.offloads:
                fields = dict(world_size=space.world_size, precision=precision, zero_stage=zero, offload=off,
                              engine=engine)
                if Config.problem_of(**fields) or Config.sharding_redundant(space.world_size, zero, off):
                    continue
                configs = [Config(micro_batch=mb, grad_accum=per_gpu // mb, checkpointing=ckpt, **fields)
                           for mb in mbs for ckpt in space.checkpointing]
                out += _runnable(configs, space)
    return out


def _runnable(configs: list[Config], space: SearchSpace) -> list[Config]:
    """The configurations that can train the space's optimizer and adapter."""
    return [c for c in configs if not c.optimizer_problem(space.optimizer) and not c.adapter_problem(space.adapter)]


def _tensor_parallel_configs(space: SearchSpace, rows: int) -> list[Config]:
    """Tensor parallel x FSDP2 data parallel (accelerate's ParallelismConfig): each layer split across `tp` GPUs of
    a node, FULL_SHARD over the `world / tp` data-parallel ranks, no offload."""
    out = []
    for size in space.tensor_parallel:
        dp = space.world_size // size
        if rows % dp or 3 not in space.zero_stages or NO_OFFLOAD not in space.offloads:
            continue
        per_dp = rows // dp
        mbs = [space.micro_batch] if space.micro_batch else divisors(per_dp)
        for precision in (p for p in space.precisions if not Config.problem_of(
                world_size=space.world_size, precision=p, zero_stage=3, offload=NO_OFFLOAD, engine=FSDP,
                tensor_parallel=size)):
            configs = [Config(micro_batch=mb, grad_accum=per_dp // mb, world_size=space.world_size, precision=precision,
                              checkpointing=ckpt, zero_stage=3, offload=NO_OFFLOAD, engine=FSDP, tensor_parallel=size)
                       for mb in mbs if per_dp % mb == 0 for ckpt in space.checkpointing]
            out += _runnable(configs, space)
    return out


def _sequence_split_configs(space: SearchSpace, rows: int) -> list[Config]:
    """Each sequence split across `n` GPUs, by ring attention under FSDP2 or by Ulysses under DeepSpeed, with the
    world / n data-parallel ranks of each split taking the step's rows."""
    out = []
    splits = [("context_parallel", n, FSDP) for n in space.context_parallel] + [
        ("sequence_parallel", n, DEEPSPEED) for n in space.sequence_parallel]
    for name, size, engine in splits:
        dp = space.world_size // size
        if rows % dp:
            continue
        per_dp = rows // dp
        mbs = [space.micro_batch] if space.micro_batch else divisors(per_dp)
        for zero, precision, off in itertools.product(space.zero_stages, space.precisions, space.offloads):
            fields = dict(world_size=space.world_size, precision=precision, zero_stage=zero, offload=off,
                          engine=engine, **{name: size})
            if not zero or Config.problem_of(**fields):
                continue
            out += _runnable([Config(micro_batch=mb, grad_accum=per_dp // mb, checkpointing=ckpt, **fields)
                              for mb in mbs if per_dp % mb == 0 for ckpt in space.checkpointing], space)
    return out


def why_empty(space: SearchSpace) -> tuple[str, str]:
    """Why the pins leave no candidate: the first problem a pinned combination has (at the default precision first,
    where the precision is the search's), and the flag to change."""
    for zero in space.zero_stages:
        for precision in sorted(space.precisions, key=lambda p: p != DEFAULT_PRECISION):
            engine = engine_for(zero, space.engine, precision)
            for off in space.offloads:
                try:
                    cfg = Config.of(micro_batch=1, grad_accum=1, world_size=space.world_size, precision=precision,
                                    checkpointing=space.checkpointing[0], zero_stage=zero, offload=off, engine=engine)
                except ValueError as err:
                    return str(err), _pinned_flag(space)
                problems = {"optimizer": cfg.optimizer_problem(space.optimizer),  # PlanRequest field: its problem
                            "peft": cfg.adapter_problem(space.adapter)}
                for field, problem in problems.items():
                    if problem:
                        return problem, flag_of(PlanRequest, field)
    return "the pinned options leave no configuration to plan", _pinned_flag(space)


def _pinned_flag(space: SearchSpace) -> str:
    """The pinned option a conflict of pins is reported on: offload, precision or stage, whichever is pinned first in
    that order (each conflicts with the others), else the engine."""
    for field, values in (("offload", space.offloads), ("precision", space.precisions),
                          ("zero_stage", space.zero_stages)):
        if len(values) == 1:
            return flag_of(PlanRequest, field)
    return flag_of(PlanRequest, "engine")


class MemoryEvaluator:
    """Memory of candidates: model states exact; activations traced exactly at a candidate's micro-batch, or
    analytic scaled by the traced/analytic ratio of the same trace family (calibration). `packed`: the evaluation
    of packed rows, where they are longer than the rows of the main one (a dataset packed to --max-length)."""

    def __init__(self, evaluation: Evaluation, method: str, packed: Evaluation | None = None):
        self.evaluation, self.method, self.packed = evaluation, method, packed
        #: trace family -> {micro-batch: (traced, analytic) activations} of the family's traces so far
        self.calibration: dict[tuple, dict[int, tuple[int, int]]] = {}
        #: (candidate, its family's traces, facts overridden) -> its screen and the facts that read
        self._screened: dict[tuple, tuple] = {}

    @property
    def resolved(self):
        return self.evaluation.resolved

    @property
    def seq_len(self) -> int:
        return self.evaluation.seq_len

    def of(self, cfg: Config) -> Evaluation:
        """The evaluation of `cfg`'s rows."""
        return self.packed if self.packed is not None and cfg.padding == PACKING else self.evaluation

    def _family(self, cfg: Config) -> tuple:
        """Candidates whose unsplit model's activations come from one traced program (a tensor-parallel rank, or a
        rank of a split sequence, keeps its share of them)."""
        return cfg.trace_family() + (self.of(cfg).seq_len,)


    def states(self, cfg: Config) -> states.ModelStates:
        return self.evaluation.states(cfg)

    def estimate(self, cfg: Config, method: str | None = None) -> MemoryEstimate:
        """Exact for this candidate (traced at its micro-batch unless the method is analytic)."""
        evaluation = self.of(cfg)
        act, used = evaluation.activations(cfg, method or self.method)
        if used == TRACE:  # the unsplit model's traced and formula activations (the trace is cached)
            whole = _one_gpu_program(cfg)
            point = tuple(evaluation.activations(whole, m)[0] for m in (TRACE, ANALYTIC))
            self.calibration.setdefault(self._family(cfg), {})[cfg.micro_batch] = point
        return evaluation.combine(cfg, act, used)

    def screen(self, cfg: Config) -> tuple[MemoryEstimate, bool]:
        """A cheap estimate and whether it is calibrated by traces of the same family (the same once per state of
        that family's traces: the search screens a candidate again after it traced more)."""
        traced = self.calibration.get(self._family(cfg))
        key = (cfg, tuple(sorted(traced.items())) if traced else (), facts.overridden())
        return facts.cached(self._screened, key, lambda: self._screen(cfg, traced))

    def _screen(self, cfg: Config, traced: dict | None) -> tuple[MemoryEstimate, bool]:
        evaluation = self.of(cfg)
        if not traced:
            act, _ = evaluation.activations(cfg, ANALYTIC)
            return evaluation.combine(cfg, act, ANALYTIC), False
        whole, _ = evaluation.activations(_one_gpu_program(cfg), ANALYTIC)
        act = calibrated(traced, cfg.micro_batch, whole)
        if cfg.tensor_parallel > 1:
            act = int(tensor_parallel_activations(evaluation.workload, cfg, act))
        if cfg.sequence_split > 1:
            act = int(act * sequence_split_share(cfg))
        return evaluation.combine(cfg, act, "analytic-calibrated"), True

    def states_only(self, cfg: Config) -> MemoryEstimate:
        """Model states and device overheads with no activations: a lower bound, for candidates rejected early."""
        return self.evaluation.combine(cfg, 0, "states-only")

    def screen_bound(self, cfg: Config) -> MemoryEstimate:
        evaluation = self.of(cfg)
        act, _ = evaluation.activations(cfg, ANALYTIC)
        return evaluation.combine(cfg, int(act / facts.get("search.analytic_max_overestimate")), "analytic-screen")


def _one_gpu_program(cfg: Config) -> Config:
    """`cfg` with the whole model and each whole sequence on one GPU: the traced program whose activations a
    tensor-parallel rank, or a rank of a split sequence, keeps a share of."""
    return cfg.unsplit().model_copy(update={"tensor_parallel": 1})


def calibrated(traced: dict[int, tuple[int, int]], micro_batch: int, analytic: int) -> int:
    """Activations at `micro_batch` from a family's traces (micro-batch -> (traced, analytic)): affine in the
    micro-batch between the traced points around it (a step keeps a fixed part and a part per sample, the trace's own
    fit, planner/program/trace.py `TraceFit`); below the smallest traced point, that point scaled by the formulas'
    ratio; above the largest, that point grown by the slope of the two largest (the formulas' growth at their ratio
    where only one was traced). Never below the traced point under it, nor above the one over it."""
    below = [b for b in traced if b <= micro_batch]
    above = [b for b in traced if b >= micro_batch]
    if below and above:
        lo, hi = max(below), min(above)
        (t_lo, _), (t_hi, _) = traced[lo], traced[hi]
        return t_lo if hi == lo else int(t_lo + (t_hi - t_lo) * (micro_batch - lo) / (hi - lo))
    if above:
        hi = min(above)
        t_hi, a_hi = traced[hi]
        return int(t_hi * min(1.0, analytic / a_hi)) if a_hi > 0 else t_hi
    top = sorted(traced)[-2:]
    t_lo, a_lo = traced[top[-1]]
    if len(top) == 2:  # the traced slope
        growth = (t_lo - traced[top[0]][0]) / (top[-1] - top[0]) * (micro_batch - top[-1])
    else:
        growth = (analytic - a_lo) * (t_lo / a_lo if a_lo > 0 else 1.0)
    return int(t_lo + max(0.0, growth))


def judge(mem: MemoryEstimate, budget: int) -> Verdict:
    """Fits or not: the estimate's peak against the budget (`Verdict.of_peak`)."""
    return Verdict.of_peak(mem.peak, budget, mem.method)


def speed_of(c: Candidate) -> float:
    """What candidates are ranked by: tokens of data per second (0 where not timed)."""
    return c.throughput.useful_tokens_per_s if c.throughput else 0.0


def rank(fitting: list[Candidate]) -> list[Candidate]:
    """Fastest first (in tokens of data per second), but simplicity wins where the speed model cannot tell: among the
    candidates within `search.structure_tie` of the fastest, the leaders are those of the least structure
    (`Config.structure`: sharding, offload, tensor parallelism); those within `search.speed_tie` of the fastest leader
    go first by fewer moving parts (then speed); everything else follows by speed."""
    ordered = sorted(fitting, key=lambda c: (-speed_of(c), c.memory.peak if c.memory else math.inf))
    if not ordered:
        return []
    contenders = [c for c in ordered if speed_of(c) * facts.get("search.structure_tie") >= speed_of(ordered[0])]
    least = min(c.config.structure() for c in contenders)
    lead = next(c for c in contenders if c.config.structure() == least)
    tie = facts.get("search.speed_tie")
    head = sorted((c for c in ordered if c.config.structure() == least and speed_of(c) * tie >= speed_of(lead)),
                  key=lambda c: (c.config.complexity(), -speed_of(c)))
    return head + [c for c in ordered if c not in head]


def search(gpu: GPU, space: SearchSpace, evaluator: MemoryEvaluator, budget: int,
           host_budget: int | None = None, speed: SpeedModel | None = None,
           progress: Callable[[str], None] | None = None) -> list[Candidate]:
    """All candidates, ranked: fitting ones by speed, then the rest; the first is the choice if it fits.

    Walks candidates from the fastest. Until one fits, each is rejected by model states alone (exact), screened
    by formulas (an estimate, said so), or traced exactly. After that, the slower ones get calibrated (or plain)
    analytic estimates, marked so. `progress(label)` hears what is being weighed.
    """
    configs = enumerate_configs(space)
    if not configs:
        peft = ", --peft" if space.adapter != NO_ADAPTER else ""
        problem, flag = why_empty(space)
        raise InputError(problem, flag=flag, hint="Drop or change the pinned options (--zero-stage, --offload, "
                                                  f"--precision, --engine, --optimizer{peft}).")
    tell = progress or (lambda label: None)
    tell(f"timing {len(configs):,} configurations")
    model_speed = speed or SpeedModel(evaluator.evaluation.workload, gpu, space.gpus_per_node, space.train_steps)
    model_speed.prefetch(configs)
    speeds = {c: model_speed(c) for c in configs}
    order = sorted(configs, key=lambda c: (-speeds[c].useful_tokens_per_s, c.complexity()))
    results: list[Candidate] = []
    fastest: dict[int, float] = {}  # structure -> the fastest fitting candidate's speed
    for cfg in order:
        speed = speeds[cfg]
        model_states = evaluator.states(cfg)
        if host_budget and model_states.cpu_bytes > host_budget:
            verdict = Verdict(kind="host-over", peak=model_states.cpu_bytes, budget=host_budget)
            results.append(Candidate(config=cfg, memory=evaluator.states_only(cfg), throughput=speed, verdict=verdict))
            continue
        if model_states.total > budget:
            verdict = Verdict(kind="states-over", peak=model_states.total, budget=budget)
            results.append(Candidate(config=cfg, memory=evaluator.states_only(cfg), throughput=speed, verdict=verdict))
            continue
        tell(f"memory of {cfg.label()}")
        mem = _evaluate(cfg, evaluator, budget, _contender(cfg, speed.useful_tokens_per_s, fastest))
        verdict = judge(mem, budget)
        if verdict.fits:
            fastest.setdefault(cfg.structure(), speed.useful_tokens_per_s)
        results.append(Candidate(config=cfg, memory=mem, throughput=speed, verdict=verdict))
    results = [_rescreened(c, evaluator, budget) for c in results]
    results = guarded(results, Physics(gpu, evaluator.resolved.spec, model_speed))
    fitting = rank([c for c in results if c.fits])
    rest = [c for c in results if not c.fits]
    return fitting + rest


def _contender(cfg: Config, speed: float, fastest: dict[int, float]) -> bool:
    """Whether `cfg` could still lead `rank` (so its memory is traced exactly): nothing fits yet, or it is within
    `search.speed_tie` of the fastest fit, or of the fastest of its structure where that is the least yet, or it is
    simpler than every fit so far and within `search.structure_tie` of the fastest."""
    if not fastest:
        return True
    best, least = max(fastest.values()), min(fastest)
    if speed * facts.get("search.speed_tie") >= best:
        return True
    if speed * facts.get("search.structure_tie") < best or cfg.structure() > least:
        return False
    return cfg.structure() < least or speed * facts.get("search.speed_tie") >= fastest[least]


def _rescreened(cand: Candidate, evaluator: MemoryEvaluator, budget: int) -> Candidate:
    """A formula estimate redone with every trace of its family (the search traced more after it): a candidate it
    would turn into a fit is traced exactly instead, as anything that could be chosen is."""
    if cand.memory is None or cand.memory.method not in (ANALYTIC, "analytic-calibrated"):
        return cand
    mem, _ = evaluator.screen(cand.config)
    verdict = judge(mem, budget)
    if verdict.fits and not cand.fits:
        mem = evaluator.estimate(cand.config)
        verdict = judge(mem, budget)
    return cand.model_copy(update={"memory": mem, "verdict": verdict})


def _evaluate(cfg: Config, evaluator: MemoryEvaluator, budget: int, contender: bool) -> MemoryEstimate:
    if contender and evaluator.method == TRACE:
        return evaluator.estimate(cfg)
    screened, calibrated = evaluator.screen(cfg)
    if not contender or evaluator.method == ANALYTIC:
        return screened
    if calibrated and screened.peak > budget * facts.get("search.calibrated_margin"):
        return screened
    if not calibrated:
        bound = evaluator.screen_bound(cfg)
        if bound.peak > budget:
            return bound
        if screened.peak > budget * facts.get("search.uncalibrated_margin"):
            return screened
    return evaluator.estimate(cfg)
