"""Learning-rate scaling for a global batch other than the one the base LR was tuned at.

Re-splitting a fixed global batch into micro-batch x N changes nothing about the optimum LR; only the
ratio k = B / B_ref matters. Linear scaling for SGD (Goyal et al. 2017, arXiv 1706.02677, with warmup);
square root for Adam-family optimizers (Malladi et al. 2022, arXiv 2205.10287; Hoffer et al. 2017).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.errors import InputError
from planner.vocab import AUTO, LR_SCALING, OPTIMIZER

#: Scale factors from this up get warmup (Goyal et al. 2017 warmed up 5 epochs at k = 32).
WARMUP_SUGGESTION_FACTOR = 4.0
#: Warmup steps per unit of the scale factor, at most `WARMUP_MAX_FRACTION` of the run.
WARMUP_STEPS_PER_FACTOR = 100
#: At most this share of the run warms up: Goyal et al. warm up 5 of 90 epochs (5.6%); the Trainer's `warmup_ratio`
#: is commonly 0.03-0.1.
WARMUP_MAX_FRACTION = 0.05


@dataclass(frozen=True)
class LRDecision:
    learning_rate: float | None
    base_lr: float | None
    reference_batch: int
    scaling: str          # the rule applied: sqrt | linear | none
    factor: float
    warmup_steps: int     # 0 where no LR is given, it is not scaled up, or the run's length is unknown
    run_steps: int | None = None   # optimizer steps of the whole run, when its length was given


def resolve_rule(scaling: str, optimizer: str) -> str:
    """The rule `scaling` names; `auto` is the optimizer's own (`OptimizerInfo.lr_rule`)."""
    if scaling not in LR_SCALING:
        raise InputError(f"unknown LR scaling {scaling!r}", flag="--lr-scaling",
                         hint=f"Use one of {', '.join(LR_SCALING)}.")
    return OPTIMIZER[optimizer].lr_rule if scaling == AUTO else scaling


def scale_lr(base_lr: float | None, global_batch: int, reference_batch: int, scaling: str, optimizer: str,
             run_steps: int | None = None) -> LRDecision:
    """The LR for `global_batch` from a base tuned at `reference_batch`, and its warmup: only where the LR is scaled up
    enough to need it and the run's length (`run_steps`) is known, `WARMUP_STEPS_PER_FACTOR` per unit of the factor
    and at most `WARMUP_MAX_FRACTION` of the run."""
    if base_lr is not None and (not math.isfinite(base_lr) or base_lr <= 0):
        raise InputError("the learning rate must be a positive number", flag="--lr")
    if reference_batch < 1:
        raise InputError("the reference batch must be a positive integer", flag="--lr-batch")
    rule = resolve_rule(scaling, optimizer)
    factor = LR_SCALING[rule].factor(global_batch / reference_batch)
    wants_warmup = factor >= WARMUP_SUGGESTION_FACTOR or (OPTIMIZER[optimizer].warmup and factor > 1)
    warmup = 0
    if base_lr is not None and wants_warmup and run_steps is not None:
        warmup = min(int(WARMUP_STEPS_PER_FACTOR * factor), max(1, int(WARMUP_MAX_FRACTION * run_steps)))
    lr = base_lr * factor if base_lr is not None else None
    return LRDecision(lr, base_lr, reference_batch, rule, factor, warmup, run_steps)
