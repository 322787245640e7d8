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

#: Scale factors above this get a warmup suggestion (Goyal et al. used 5 epochs of warmup at k = 32).
WARMUP_SUGGESTION_FACTOR = 4.0
#: Warmup steps suggested: a fraction of a typical run, at least this many optimizer steps.
WARMUP_STEPS_PER_FACTOR = 100
#: At most this share of the run warms up when its length is known (--train-steps / --train-tokens): Goyal et al.
#: warm up 5 of 90 epochs (5.6%); the Trainer's `warmup_ratio` is commonly 0.03-0.1.
WARMUP_MAX_FRACTION = 0.05


@dataclass(frozen=True)
class LRDecision:
    learning_rate: float | None
    base_lr: float | None
    reference_batch: int
    scaling: str          # the rule applied: sqrt | linear | none
    factor: float
    warmup_steps: int
    notes: tuple[str, ...]
    run_steps: int | None = None   # optimizer steps of the whole run, when its length was given


def resolve_rule(scaling: str, optimizer: str) -> str:
    """The rule `scaling` names; `auto` is the optimizer's own (`OptimizerInfo.lr_rule`)."""
    if scaling not in LR_SCALING:
        raise InputError(f"unknown LR scaling {scaling!r}", flag="--lr-scaling",
                         hint=f"Use one of {', '.join(LR_SCALING)}.")
    return OPTIMIZER[optimizer].lr_rule if scaling == AUTO else scaling


def scale_lr(base_lr: float | None, global_batch: int, reference_batch: int, scaling: str, optimizer: str,
             has_batchnorm: bool = False, micro_batch: int | None = None, run_steps: int | None = None) -> LRDecision:
    """The LR for `global_batch` from a base tuned at `reference_batch`, and the warmup a large factor asks for,
    at most `WARMUP_MAX_FRACTION` of a run of `run_steps` optimizer steps when its length is known."""
    if base_lr is not None and (not math.isfinite(base_lr) or base_lr <= 0):
        raise InputError("the learning rate must be a positive number", flag="--lr")
    if reference_batch < 1:
        raise InputError("the reference batch must be a positive integer", flag="--lr-batch")
    rule = resolve_rule(scaling, optimizer)
    k = global_batch / reference_batch
    factor = LR_SCALING[rule].factor(k)
    notes = []
    warmup = 0
    wants_warmup = factor >= WARMUP_SUGGESTION_FACTOR or (OPTIMIZER[optimizer].warmup and factor > 1)
    if base_lr is not None and wants_warmup:  # no LR asked for: none written, no warmup
        warmup = int(WARMUP_STEPS_PER_FACTOR * factor)
        if run_steps is not None and warmup > WARMUP_MAX_FRACTION * run_steps:
            warmup = max(1, int(WARMUP_MAX_FRACTION * run_steps))
            notes.append(f"LR scaled x{factor:.1f}: warm up over {warmup} optimizer steps, "
                         f"{WARMUP_MAX_FRACTION:.0%} of the run's {run_steps} (Goyal et al. 2017 warm up 5 of 90 "
                         f"epochs).")
        elif run_steps is not None:
            notes.append(f"LR scaled x{factor:.1f}: warm up over ~{warmup} optimizer steps of the run's {run_steps} "
                         f"(Goyal et al. 2017).")
        else:
            notes.append(f"LR scaled x{factor:.1f}: warm up over ~{warmup} optimizer steps (Goyal et al. 2017); give "
                         f"--train-steps or --train-tokens to size it to the run.")
    if has_batchnorm and micro_batch is not None:
        notes.append(f"The model has BatchNorm: accumulation does not enlarge its batch, its statistics see only the "
                     f"micro-batch ({micro_batch} samples per GPU), not the global batch. Replace it with LayerNorm "
                     "or GroupNorm, synchronise it across GPUs (torch.nn.SyncBatchNorm.convert_sync_batchnorm), or "
                     "pin a larger --micro-batch.")
    lr = base_lr * factor if base_lr is not None else None
    return LRDecision(lr, base_lr, reference_batch, rule, factor, warmup, tuple(notes), run_steps)
