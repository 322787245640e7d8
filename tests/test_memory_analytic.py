"""The analytic activation formulas against traces: the one property the search's screen relies on (fact
`search.analytic_max_overestimate`); benchmarks/fit_analytic.py prints the whole table."""

from __future__ import annotations

import pytest

from planner.config import Config
from planner.memory.estimate import Evaluation
from planner.models import resolve_model
from planner import facts
from planner.vocab import ANALYTIC, TRACE


@pytest.mark.parametrize("name,seq,micro_batch", [("gpt2", 512, 2), ("meta-llama/Llama-3.2-1B", 512, 1),
                                                  ("google-bert/bert-large-uncased", 512, 1)])
@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
def test_the_screens_bound_never_exceeds_the_traced_activations(name, seq, micro_batch, checkpointing):
    """The screen rejects a candidate without tracing when the formulas divided by their largest over-estimate are
    over the budget: that is safe only while that quotient is at most the traced activations."""
    evaluation = Evaluation(resolve_model(name), seq_len=seq, optimizer="adamw")
    cfg = Config(micro_batch=micro_batch, grad_accum=2, world_size=1, precision="bf16-mixed",
                 checkpointing=checkpointing, zero_stage=0, offload="none")
    traced, used = evaluation.activations(cfg, TRACE)
    analytic, _ = evaluation.activations(cfg, ANALYTIC)
    assert used == TRACE
    assert analytic / facts.get("search.analytic_max_overestimate") <= traced, traced / analytic
