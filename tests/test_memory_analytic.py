"""The analytic activation formulas against traces: the bounds the search's screen relies on
(`search.ANALYTIC_MAX_OVERESTIMATE`); benchmarks/fit_analytic.py prints the whole table."""

from __future__ import annotations

import pytest

from planner.config import Config
from planner.memory.estimate import Evaluation
from planner.models import resolve_model
from planner.search import ANALYTIC_MAX_OVERESTIMATE
from planner.vocab import ANALYTIC, TRACE

#: traced / analytic seen over ten model families (benchmarks/fit_analytic.py): 0.59 (Mistral fp32 selective) to
#: 2.06 (Gemma-2 fp32 full). The formulas under-count more often than they over-count.
RATIO_RANGE = (1 / ANALYTIC_MAX_OVERESTIMATE, 2.5)


@pytest.mark.parametrize("name,seq,micro_batch", [("gpt2", 512, 2), ("meta-llama/Llama-3.2-1B", 512, 1),
                                                  ("google-bert/bert-large-uncased", 512, 1)])
@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
def test_analytic_stays_within_the_screens_bounds(name, seq, micro_batch, checkpointing):
    evaluation = Evaluation(resolve_model(name), seq_len=seq, optimizer="adamw")
    cfg = Config(micro_batch=micro_batch, grad_accum=2, world_size=1, precision="bf16-mixed",
                 checkpointing=checkpointing, zero_stage=0, offload="none")
    traced, used = evaluation.activations(cfg, TRACE)
    analytic, _ = evaluation.activations(cfg, ANALYTIC)
    assert used == TRACE
    low, high = RATIO_RANGE
    assert low <= traced / analytic <= high, traced / analytic
