"""Candidate enumeration and choice.

Every (micro_batch, N) with micro_batch x N x world_size == global batch, x precision x checkpointing x
ZeRO stage x offload. Speed is modelled for all of them (cheap). Memory is evaluated walking from the
fastest: a candidate that could still be chosen is either rejected by a bound that cannot wrongly reject
or traced exactly at its own micro-batch; each trace also calibrates the analytic formulas of its family.
Slower candidates get calibrated (or plain) analytic estimates, and their `method` says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner import throughput as tp
from planner.hardware import GPU
from planner.memory import states
from planner.memory.estimate import MemoryEstimate, activations, combine
from planner.types import Candidate, Config, ThroughputInfo


@dataclass(frozen=True)
class SearchSpace:
    global_batch: int
    world_size: int
    gpus_per_node: int
    precisions: tuple[str, ...]
    checkpointing: tuple[str, ...]
    zero_stages: tuple[int, ...]
    allow_offload: bool
    micro_batch: int | None = None


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def nearest_valid_batches(batch: int, world: int) -> tuple[int, int]:
    low = (batch // world) * world
    return (low if low > 0 else world), low + world


def offloads_for(zero_stage: int, world_size: int, allow_offload: bool) -> list[str]:
    if zero_stage == 0:
        return ["none"]
    options = ["none"] if world_size > 1 else []  # ZeRO without offload buys nothing on one GPU
    if allow_offload:
        options.append("optimizer")
        if zero_stage == 3:
            options.append("optimizer+params")
    return options


def enumerate_configs(space: SearchSpace) -> list[Config]:
    per_gpu = space.global_batch // space.world_size
    mbs = [space.micro_batch] if space.micro_batch else divisors(per_gpu)
    out = []
    for mb in mbs:
        for precision in space.precisions:
            for ckpt in space.checkpointing:
                for zero in space.zero_stages:
                    if precision == "bf16-true" and zero > 0:
                        continue
                    for off in offloads_for(zero, space.world_size, space.allow_offload):
                        out.append(Config(micro_batch=mb, grad_accum=per_gpu // mb, world_size=space.world_size,
                                          precision=precision, checkpointing=ckpt, zero_stage=zero, offload=off))
    return out


def model_speed(resolved, gpu: GPU, cfg: Config, seq_len: int, gpus_per_node: int, attention: str) -> ThroughputInfo:
    kernel = "eager" if attention == "eager" or not _supports_sdpa(resolved) else "sdpa"
    t = tp.step_time(resolved.spec, gpu, micro_batch=cfg.micro_batch, grad_accum=cfg.grad_accum, seq_len=seq_len,
                     precision=cfg.precision, checkpointing=cfg.checkpointing, zero_stage=cfg.zero_stage,
                     offload=cfg.offload, world_size=cfg.world_size, gpus_per_node=gpus_per_node, attention=kernel)
    return ThroughputInfo(tokens_per_s=t.tokens_per_s, samples_per_s=t.samples_per_s, mfu=t.mfu,
                          step_time_s=t.step_time_s, parts=t.parts)


def _supports_sdpa(resolved) -> bool:
    from planner.models.build import effective_attention

    return effective_attention(resolved.config, "sdpa", resolved.trust_remote_code) == "sdpa"


#: The analytic activations can overestimate the traced ones by up to this factor (worst seen: BERT-large at
#: micro-batch 1, whose autocast weight copies die before its small activations peak). Dividing by it gives
#: a lower bound: a candidate over budget even then is rejected without tracing.
ANALYTIC_MAX_OVERESTIMATE = 3.5
#: An uncalibrated analytic estimate this far over the budget rejects without tracing. Traced/analytic
#: ratios of decoder LLMs fall within 0.85-1.2 (e.g. Llama-3.1-70B: 0.89 selective, 1.08 none, 1.16 full; an
#: analytic estimate 12% high is still traced),
#: so this only costs a faster candidate where the formulas are far off, never a wrong "fits".
UNCALIBRATED_MARGIN = 1.15
#: A calibrated estimate (analytic x the family's traced ratio) this far over the budget rejects without
#: tracing. Anything that would be chosen is always traced exactly first.
CALIBRATED_MARGIN = 1.05


class MemoryEvaluator:
    """Memory of candidates: model states exact; activations traced exactly at a candidate's micro-batch, or
    analytic scaled by the traced/analytic ratio of the same activation family (calibration)."""

    def __init__(self, resolved, *, seq_len, optimizer, attention, gpus_per_node, method, adafactor_elements=0):
        self.resolved, self.seq_len, self.optimizer = resolved, seq_len, optimizer
        self.attention, self.gpus_per_node, self.method = attention, gpus_per_node, method
        self.adafactor_elements = adafactor_elements
        self.calibration: dict[tuple, float] = {}

    def states(self, cfg: Config) -> states.ModelStates:
        spec = self.resolved.spec
        return states.model_states(
            spec.parameters, spec.trainable_parameters, precision=cfg.precision, optimizer=self.optimizer,
            zero_stage=cfg.zero_stage, offload=cfg.offload, world_size=cfg.world_size,
            gpus_per_node=self.gpus_per_node, largest_layer=spec.largest_layer_parameters,
            adafactor_elements=self.adafactor_elements)

    def _activations(self, cfg: Config, method: str) -> tuple[int, str]:
        return activations(self.resolved, micro_batch=cfg.micro_batch, seq_len=self.seq_len, precision=cfg.precision,
                           checkpointing=cfg.checkpointing, zero_stage=cfg.zero_stage, attention=self.attention,
                           device="cuda", method=method)

    def _combine(self, cfg: Config, act: int, method: str) -> MemoryEstimate:
        return combine(self.resolved.spec, self.states(cfg), act, method, precision=cfg.precision,
                       optimizer=self.optimizer, zero_stage=cfg.zero_stage, offload=cfg.offload,
                       world_size=cfg.world_size, device="cuda", grad_accum=cfg.grad_accum)

    def estimate(self, cfg: Config, method: str | None = None) -> MemoryEstimate:
        """Exact for this candidate (traced at its micro-batch unless the method is analytic)."""
        act, used = self._activations(cfg, method or self.method)
        if used == "trace":
            analytic_act, _ = self._activations(cfg, "analytic")
            self.calibration[activation_family(cfg)] = act / max(analytic_act, 1)
        return self._combine(cfg, act, used)

    def screen(self, cfg: Config) -> tuple[MemoryEstimate, bool]:
        """A cheap estimate and whether it is calibrated by a trace of the same family."""
        act, _ = self._activations(cfg, "analytic")
        ratio = self.calibration.get(activation_family(cfg))
        if ratio is None:
            return self._combine(cfg, act, "analytic"), False
        return self._combine(cfg, int(act * ratio), "analytic-calibrated"), True

    def states_only(self, cfg: Config) -> MemoryEstimate:
        """Model states and device overheads with no activations: a floor, for candidates rejected early."""
        return self._combine(cfg, 0, "states-only")

    def lower_bound(self, cfg: Config) -> MemoryEstimate:
        act, _ = self._activations(cfg, "analytic")
        return self._combine(cfg, int(act / ANALYTIC_MAX_OVERESTIMATE), "analytic-lower-bound")


def activation_family(cfg: Config) -> tuple:
    """Candidates whose activations come from the same traced program."""
    from planner.memory.estimate import activation_precision

    return activation_precision(cfg.precision, cfg.zero_stage), cfg.checkpointing


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def judge(cfg: Config, mem: MemoryEstimate, budget: int) -> tuple[bool, str]:
    if mem.peak <= budget:
        return True, f"fits: peak {_gib(mem.peak)} of {_gib(budget)} budget"
    if mem.method == "analytic-lower-bound":
        return False, f"OOM: needs at least {_gib(mem.peak)} > budget {_gib(budget)}"
    return False, f"OOM by {_gib(mem.peak - budget)}: peak {_gib(mem.peak)} > budget {_gib(budget)}"


def rank_key(c: Candidate):
    """Fastest first; within 1% of each other, fewer moving parts, then more headroom."""
    speed = c.throughput.tokens_per_s if c.throughput else 0.0
    bucket = math.floor(math.log(speed) / math.log(1.01)) if speed > 0 else -math.inf
    return (-bucket, c.config.complexity(), c.memory.peak if c.memory else math.inf)


def search(resolved, gpu: GPU, space: SearchSpace, evaluator: MemoryEvaluator, budget: int,
           attention: str, host_budget: int | None = None) -> list[Candidate]:
    """All candidates, ranked: fitting ones by speed, then the rest; the first is the choice if it fits.

    Walks candidates from the fastest. Until one fits, each is pruned by a bound that cannot under-reject
    (model states alone; analytic lower bound; a calibrated estimate well over the budget) or traced
    exactly. After that, the slower ones get calibrated (or plain) analytic estimates, marked so.
    """
    configs = enumerate_configs(space)
    speeds = {c: model_speed(resolved, gpu, c, evaluator.seq_len, space.gpus_per_node, attention) for c in configs}
    order = sorted(configs, key=lambda c: (-speeds[c].tokens_per_s, c.complexity()))
    results: list[Candidate] = []
    best_speed = None
    for cfg in order:
        speed = speeds[cfg]
        model_states = evaluator.states(cfg)
        if host_budget and model_states.cpu_bytes > host_budget:
            results.append(Candidate(config=cfg, memory=evaluator.states_only(cfg), throughput=speed, fits=False,
                                     reason=f"offload needs {_gib(model_states.cpu_bytes)} of host memory per node > "
                                            f"{_gib(host_budget)}"))
            continue
        model_states_only = model_states.total
        if model_states_only > budget:
            results.append(Candidate(config=cfg, memory=evaluator.states_only(cfg), throughput=speed, fits=False,
                                     reason=f"model states alone {_gib(model_states_only)} > budget {_gib(budget)}"))
            continue
        contender = best_speed is None or speed.tokens_per_s >= best_speed * 0.99
        mem = _evaluate(cfg, evaluator, budget, contender)
        fits, reason = judge(cfg, mem, budget)
        if fits and best_speed is None:
            best_speed = speed.tokens_per_s
        results.append(Candidate(config=cfg, memory=mem, throughput=speed, fits=fits, reason=reason))
    fitting = sorted((c for c in results if c.fits), key=rank_key)
    rest = [c for c in results if not c.fits]
    return fitting + rest


def _evaluate(cfg: Config, evaluator: MemoryEvaluator, budget: int, contender: bool) -> MemoryEstimate:
    if contender and evaluator.method == "trace":
        return evaluator.estimate(cfg)
    screened, calibrated = evaluator.screen(cfg)
    if not contender or evaluator.method == "analytic":
        return screened
    if calibrated and screened.peak > budget * CALIBRATED_MARGIN:
        return screened
    if not calibrated:
        bound = evaluator.lower_bound(cfg)
        if bound.peak > budget:
            return bound
        if screened.peak > budget * UNCALIBRATED_MARGIN:
            return screened
    return evaluator.estimate(cfg)
