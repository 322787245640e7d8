"""Candidate enumeration and choice.

Every (micro_batch, N) with micro_batch x N x world_size == global batch, x precision x checkpointing x
sharding stage x offload that the engine can run. Speed is modelled for all of them (cheap). Memory is evaluated
walking from the fastest: a candidate that could still be chosen is rejected by its exact model states, screened
out by formulas (its reason then says "estimated"), or traced exactly at its own micro-batch; each trace also
calibrates the formulas of its trace family. Slower candidates get calibrated (or plain) analytic estimates, and
their `method` says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner import facts
from planner.config import Config
from planner.errors import InputError
from planner.hardware import GPU
from planner.memory import states
from planner.memory.estimate import Evaluation, MemoryEstimate
from planner.notes import Verdict
from planner.speed.model import SpeedModel
from planner.types import Candidate
from planner.vocab import (
    ANALYTIC, DEFAULT_OPTIMIZER, DEFAULT_SHARDING_ENGINE, FSDP, NO_ADAPTER, NO_OFFLOAD, PACKING, PRECISION, TRACE,
    UNSHARDED_ENGINE,
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
    compiled: tuple[bool, ...] = (False,)     # eager, compiled (torch.compile), or both (`vocab.COMPILE`)
    liger: tuple[bool, ...] = (False,)        # without, with Liger-Kernel's patches, or both
    paddings: tuple[str | None, ...] = (None,)  # how a dataset's samples are batched (`vocab.PADDING`); None: no data
    train_steps: int | None = None            # the run's optimizer steps, over which compile time is spread


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def nearest_valid_batches(batch: int, world: int) -> tuple[int, int]:
    low = (batch // world) * world
    return (low if low > 0 else world), low + world


def engine_for(zero_stage: int, sharding_engine: str) -> str:
    return UNSHARDED_ENGINE if zero_stage == 0 else sharding_engine


def enumerate_configs(space: SearchSpace) -> list[Config]:
    """Every split of the batch with every combination of the space's choices that can run (`Config.problem`) and
    is worth running (`Config.redundant`)."""
    per_gpu = space.global_batch // space.world_size
    mbs = [space.micro_batch] if space.micro_batch else divisors(per_gpu)
    out = []
    for zero in space.zero_stages:
        engine = engine_for(zero, space.engine)
        for precision in space.precisions:
            for off in space.offloads:
                fields = dict(world_size=space.world_size, precision=precision, zero_stage=zero, offload=off,
                              engine=engine)
                if Config.problem_of(**fields) or Config.sharding_redundant(space.world_size, zero, off):
                    continue
                configs = [Config(micro_batch=mb, grad_accum=per_gpu // mb, checkpointing=ckpt, **fields)
                           for mb in mbs for ckpt in space.checkpointing]
                out += _runnable(configs, space)
    out += _tensor_parallel_configs(space)
    return [c.model_copy(update={"compiled": compiled, "liger": liger, "padding": padding}) for c in out
            for compiled in space.compiled for liger in space.liger for padding in space.paddings]


def _runnable(configs: list[Config], space: SearchSpace) -> list[Config]:
    """The configurations that can train the space's optimizer and adapter."""
    return [c for c in configs if not c.optimizer_problem(space.optimizer) and not c.adapter_problem(space.adapter)]


def _tensor_parallel_configs(space: SearchSpace) -> list[Config]:
    """Tensor parallel x FSDP2 data parallel (accelerate's ParallelismConfig): each layer split across `tp` GPUs of
    a node, FULL_SHARD over the `world / tp` data-parallel ranks, no offload."""
    out = []
    for size in space.tensor_parallel:
        dp = space.world_size // size
        if space.global_batch % dp or 3 not in space.zero_stages or NO_OFFLOAD not in space.offloads:
            continue
        per_dp = space.global_batch // dp
        mbs = [space.micro_batch] if space.micro_batch else divisors(per_dp)
        for precision in (p for p in space.precisions if PRECISION[p].zero_engines):
            configs = [Config(micro_batch=mb, grad_accum=per_dp // mb, world_size=space.world_size, precision=precision,
                              checkpointing=ckpt, zero_stage=3, offload=NO_OFFLOAD, engine=FSDP, tensor_parallel=size)
                       for mb in mbs if per_dp % mb == 0 for ckpt in space.checkpointing]
            out += _runnable(configs, space)
    return out


def why_empty(space: SearchSpace) -> str:
    """Why the pins leave no candidate: the first problem a pinned combination has."""
    for zero in space.zero_stages:
        engine = engine_for(zero, space.engine)
        for precision in space.precisions:
            for off in space.offloads:
                try:
                    cfg = Config.of(micro_batch=1, grad_accum=1, world_size=space.world_size, precision=precision,
                                    checkpointing=space.checkpointing[0], zero_stage=zero, offload=off, engine=engine)
                except ValueError as err:
                    return str(err)
                problem = cfg.optimizer_problem(space.optimizer) or cfg.adapter_problem(space.adapter)
                if problem:
                    return problem
    return "the pinned options leave no configuration to plan"


class MemoryEvaluator:
    """Memory of candidates: model states exact; activations traced exactly at a candidate's micro-batch, or
    analytic scaled by the traced/analytic ratio of the same trace family (calibration). `packed`: the evaluation
    of packed rows, where they are longer than the rows of the main one (a dataset packed to --max-length)."""

    def __init__(self, evaluation: Evaluation, method: str, packed: Evaluation | None = None):
        self.evaluation, self.method, self.packed = evaluation, method, packed
        self.calibration: dict[tuple, float] = {}

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
        return cfg.trace_family() + (self.of(cfg).seq_len,)

    def states(self, cfg: Config) -> states.ModelStates:
        return self.evaluation.states(cfg)

    def estimate(self, cfg: Config, method: str | None = None) -> MemoryEstimate:
        """Exact for this candidate (traced at its micro-batch unless the method is analytic)."""
        evaluation = self.of(cfg)
        act, used = evaluation.activations(cfg, method or self.method)
        if used == TRACE:
            analytic_act, _ = evaluation.activations(cfg, ANALYTIC)
            self.calibration[self._family(cfg)] = act / max(analytic_act, 1)
        return evaluation.combine(cfg, act, used)

    def screen(self, cfg: Config) -> tuple[MemoryEstimate, bool]:
        """A cheap estimate and whether it is calibrated by a trace of the same family."""
        evaluation = self.of(cfg)
        act, _ = evaluation.activations(cfg, ANALYTIC)
        ratio = self.calibration.get(self._family(cfg))
        if ratio is None:
            return evaluation.combine(cfg, act, ANALYTIC), False
        return evaluation.combine(cfg, int(act * ratio), "analytic-calibrated"), True

    def states_only(self, cfg: Config) -> MemoryEstimate:
        """Model states and device overheads with no activations: a lower bound, for candidates rejected early."""
        return self.evaluation.combine(cfg, 0, "states-only")

    def screen_bound(self, cfg: Config) -> MemoryEstimate:
        evaluation = self.of(cfg)
        act, _ = evaluation.activations(cfg, ANALYTIC)
        return evaluation.combine(cfg, int(act / facts.get("search.analytic_max_overestimate")), "analytic-screen")


def judge(mem: MemoryEstimate, budget: int) -> Verdict:
    """Fits or not: the estimate's peak against the budget (`Verdict.of_peak`)."""
    return Verdict.of_peak(mem.peak, budget, mem.method)


def rank(fitting: list[Candidate]) -> list[Candidate]:
    """Fastest first (in tokens of data per second), except that the candidates within the fact `search.speed_tie` of
    the fastest go first by fewer moving parts (then speed, then headroom)."""
    def speed(c: Candidate) -> float:
        return c.throughput.useful_tokens_per_s if c.throughput else 0.0

    ordered = sorted(fitting, key=lambda c: (-speed(c), c.memory.peak if c.memory else math.inf))
    if not ordered:
        return []
    tie = facts.get("search.speed_tie")
    tied = [c for c in ordered if speed(c) * tie >= speed(ordered[0])]
    return sorted(tied, key=lambda c: (c.config.complexity(), -speed(c))) + ordered[len(tied):]


def search(gpu: GPU, space: SearchSpace, evaluator: MemoryEvaluator, budget: int,
           host_budget: int | None = None, speed: SpeedModel | None = None) -> list[Candidate]:
    """All candidates, ranked: fitting ones by speed, then the rest; the first is the choice if it fits.

    Walks candidates from the fastest. Until one fits, each is rejected by model states alone (exact), screened
    by formulas (an estimate, said so), or traced exactly. After that, the slower ones get calibrated (or plain)
    analytic estimates, marked so.
    """
    configs = enumerate_configs(space)
    if not configs:
        raise InputError(why_empty(space), hint="Drop or change the pinned options (--zero-stage, --offload, "
                                                "--precision, --engine, --optimizer).")
    model_speed = speed or SpeedModel(evaluator.evaluation.workload, gpu, space.gpus_per_node, space.train_steps)
    model_speed.prefetch(configs)
    speeds = {c: model_speed(c) for c in configs}
    order = sorted(configs, key=lambda c: (-speeds[c].useful_tokens_per_s, c.complexity()))
    results: list[Candidate] = []
    best_speed = None
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
        contender = best_speed is None or speed.useful_tokens_per_s * facts.get("search.speed_tie") >= best_speed
        mem = _evaluate(cfg, evaluator, budget, contender)
        verdict = judge(mem, budget)
        if verdict.fits and best_speed is None:
            best_speed = speed.useful_tokens_per_s
        results.append(Candidate(config=cfg, memory=mem, throughput=speed, verdict=verdict))
    fitting = rank([c for c in results if c.fits])
    rest = [c for c in results if not c.fits]
    return fitting + rest


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
