"""The physics every candidate's numbers obey, checked before candidates are ranked (shared/design.md, "Invariants").

A candidate that breaks one is an internal error: its verdict becomes `invalid` (never a fit, never chosen), the
broken rules are logged with its configuration, and the property test over the model zoo fails
(tests/test_invariants.py). The rules compare numbers the models produce with what physics allows:

* every memory part and term >= 0, and the peaks in order: model states <= allocated <= reserved <= process <= peak;
* the FLOPs a step executes (`flops_per_token` with recomputation, causal attention at half) at the predicted
  speed stay under the GPU's dense peak for the precision;
* tokens/s and samples/s times the step time are the tokens and samples of a step (`StepSize`);
* for one configuration, activation memory does not fall as the micro-batch grows, nor the peak among micro-batch
  splits that hold the gradients alike; no checkpointing keeps at least what full checkpointing keeps, and selective
  at least what full keeps but for the one block full checkpointing recomputes whole (`_recompute_allowance`, which
  also says why selective against none is no rule).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import defaultdict
from dataclasses import dataclass

from planner.config import Config
from planner.hardware import GPU
from planner.models.spec import ModelSpec
from planner.notes import Verdict, Violation, violation
from planner.speed.step import StepSize, flops_per_token
from planner.types import Candidate
from planner.vocab import ANALYTIC, CHECKPOINTING, ESTIMATE, TRACE

log = logging.getLogger("planner")

#: Relative slack for identities computed in floating point (tokens/s x seconds against a step's tokens).
FLOAT_TOLERANCE = 1e-6
#: Checkpointing modes from most recomputation to least: activations may only grow along this order.
RECOMPUTE_ORDER = tuple(sorted(CHECKPOINTING, key=lambda mode: (not CHECKPOINTING[mode].enabled,
                                                                 CHECKPOINTING[mode].per_op_policy)))


@dataclass(frozen=True)
class Physics:
    """What the rules read beside a candidate: the GPU, the model, and the speed model that sized its steps
    (`step_size`, `attention_length`: planner/speed/model.py, planner/speed/data.py)."""

    gpu: GPU
    spec: ModelSpec
    speed: object

    def violations(self, cand: Candidate) -> list[Violation]:
        return _memory_violations(cand) + self._speed_violations(cand)

    def _speed_violations(self, cand: Candidate) -> list[Violation]:
        tp, cfg = cand.throughput, cand.config
        if tp is None or tp.step_time_s <= 0:
            return []
        size: StepSize = self.speed.step_size(cfg)
        out = []
        for kind, rate, per_step in (("step-tokens", tp.tokens_per_s, size.tokens),
                                     ("step-samples", tp.samples_per_s, size.samples)):
            if not math.isclose(rate * tp.step_time_s, per_step, rel_tol=FLOAT_TOLERANCE):
                out.append(violation(kind, rate=rate, step_s=tp.step_time_s, per_step=per_step))
        dense, attention = flops_per_token(self.spec, self.speed.attention_length(cfg), cfg.checkpointing)
        achieved = (dense + attention) * tp.tokens_per_s / cfg.world_size
        peak = self.gpu.peak_tflops(cfg.precision) * 1e12
        if achieved > peak:
            out.append(violation("flops", tflops=achieved / 1e12, peak_tflops=peak / 1e12, precision=cfg.precision))
        return out


def _memory_violations(cand: Candidate) -> list[Violation]:
    mem = cand.memory
    if mem is None:
        return []
    parts = {"parameters": mem.parameters, "gradients": mem.gradients, "optimizer_states": mem.optimizer_states,
             "activations": mem.activations, "overhead": mem.overhead, "peak_allocated": mem.peak_allocated,
             "peak": mem.peak, "cpu_offload_bytes": mem.cpu_offload_bytes, **mem.terms.model_dump()}
    out = [violation("negative", part=name, bytes=value) for name, value in parts.items() if value < 0]
    if mem.peak_allocated < mem.model_states:
        out.append(violation("below-states", peak=mem.peak_allocated, states=mem.model_states))
    order = (("peak_allocated", mem.peak_allocated), ("peak_reserved", mem.peak_reserved),
             ("peak_process", mem.peak_process), ("peak", mem.peak))
    out += [violation("peak-order", lower=a, lower_bytes=x, upper=b, upper_bytes=y)
            for (a, x), (b, y) in zip(order, order[1:]) if x > y]
    return out


def _comparable(cand: Candidate, across_programs: bool) -> str | None:
    """Which estimates the order rules compare a candidate's memory with: those of the same kind; None for a bound, a
    screen or a measurement. An uncalibrated formula differs from a trace by the formulas' own error (0.59-2.06x,
    benchmarks/results/fit_analytic.txt), so the two are never ordered against each other. Within one traced program
    (across micro-batches) a calibrated estimate interpolates that program's traces and is ordered with them; across
    programs (checkpointing modes) it carries the error of whichever traces it was anchored to, so only traces are."""
    mem = cand.memory
    if mem is None or ESTIMATE[mem.method].understated or ESTIMATE[mem.method].measured:
        return None
    if mem.method == ANALYTIC:
        return "formulas"
    return "traced" if mem.method == TRACE or not across_programs else None


def _holds_gradients(cfg: Config) -> bool:
    """Whether the gradients are allocated through every micro-step (accumulation or sharding): the peak's regime."""
    return cfg.grad_accum > 1 or cfg.sharded


def order_violations(cands: list[Candidate], layers: int) -> dict[Config, list[Violation]]:
    """The rules between candidates of one configuration (of a model of `layers` blocks): memory against the
    micro-batch and against the checkpointing."""
    found: dict[Config, list[Violation]] = defaultdict(list)
    by_split: dict[tuple, list[Candidate]] = defaultdict(list)
    by_mode: dict[tuple, dict[str, Candidate]] = defaultdict(dict)
    for cand in cands:
        cfg = cand.config
        if kind := _comparable(cand, across_programs=False):
            split = cfg.model_copy(update={"micro_batch": 1, "grad_accum": 1})
            by_split[(kind, split, _holds_gradients(cfg))].append(cand)
        if kind := _comparable(cand, across_programs=True):
            by_mode[(kind, cfg.model_copy(update={"checkpointing": RECOMPUTE_ORDER[0]}))][cfg.checkpointing] = cand
    for group in by_split.values():
        group.sort(key=lambda c: c.config.micro_batch)
        for small, large in zip(group, group[1:]):
            for what in ("activations", "peak"):
                if getattr(large.memory, what) < getattr(small.memory, what):
                    found[large.config].append(violation(
                        "micro-batch", what=what, micro_batch=large.config.micro_batch, bytes=getattr(large.memory, what),
                        smaller_micro_batch=small.config.micro_batch, smaller_bytes=getattr(small.memory, what)))
    for modes in by_mode.values():
        for more, less in itertools.combinations([m for m in RECOMPUTE_ORDER if m in modes], 2):
            allowance = _recompute_allowance(more, less, modes, layers)
            if allowance is None:
                continue
            kept, recomputed = modes[less].memory.activations, modes[more].memory.activations
            if kept + allowance < recomputed:  # `less` recomputes less: it keeps at least as much
                found[modes[less].config].append(violation(
                    "checkpointing", mode=less, bytes=kept, other_mode=more, other_bytes=recomputed))
    return found


def _recompute_allowance(more: str, less: str, modes: dict[str, Candidate], layers: int) -> int | None:
    """How far `more`'s activations may exceed `less`'s (None: no rule between the two). Full checkpointing keeps
    each block's input, which no checkpointing keeps too: never more. Against selective it also holds one block's
    whole activations while it recomputes it, which in a shallow model can outweigh what selective saves in every
    block: one block keeps at most what no checkpointing keeps over the blocks. Selective against none has no rule:
    the per-op policy saves every matmul's output, also where autograd would free it (the output of peft's LoRA
    delta for fused experts, added to the weight: Mixtral-8x7B LoRA at micro-batch 2 traces 171.2 GiB with selective
    and 108.4 without), so it can keep more than no checkpointing does."""
    if CHECKPOINTING[more].per_op_policy:
        return None
    if CHECKPOINTING[less].per_op_policy:
        plain = modes.get(RECOMPUTE_ORDER[-1])
        return None if plain is None else plain.memory.activations // max(1, layers)
    return 0


def guarded(cands: list[Candidate], physics: Physics) -> list[Candidate]:
    """`cands` with every candidate that breaks an invariant turned `invalid`, each logged as an internal error."""
    between = order_violations(cands, physics.spec.layers)
    out = []
    for cand in cands:
        broken = physics.violations(cand) + between.get(cand.config, [])
        if broken:
            log.error("internal error: %s breaks %s", cand.config.label(),
                      "; ".join(f"{v.kind} {v.values}" for v in broken))
            cand = cand.model_copy(update={"verdict": Verdict(kind="invalid", violations=tuple(broken),
                                                              peak=cand.verdict.peak, budget=cand.verdict.budget)})
        out.append(cand)
    return out
