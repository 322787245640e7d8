"""How sure a plan is (planner/uncertainty.py): bars from the rows like the plan, ranges of measured / predicted the
right way round, pooling said and widened, "not measured" where nothing like it ran, a margin sized to 95 % of rows
like it, and bars that cover about what they claim on the committed rows."""

from __future__ import annotations

import math

import pytest

from benchmarks import report
from planner import facts, plan
from planner.config import Config
from planner.facts import Fact
from planner.types import ErrorBar
from planner.uncertainty import (
    MIN_ROWS, P90_ROWS, POOLED, Spread, Stratum, bar_for, fact_key, margin_for, quantile,
)

def stratum(gpu: str, gpus_per_node: int = 1, **fields) -> Stratum:
    cfg = Config(**{"micro_batch": 1, "grad_accum": 1, "world_size": 1, "precision": "bf16-mixed",
                    "checkpointing": "none", "zero_stage": 0, "offload": "none", **fields})
    return Stratum.of_config(cfg, gpu, gpus_per_node)


ONE_A100 = stratum("A100-80GB")


@pytest.fixture
def rows_of(monkeypatch):
    """Error facts of a kind "test" the test gives: {stratum: ratios}."""
    table: dict[str, Fact] = {}

    def give(kind_rows: dict[Stratum, list[float]]):
        for stratum, ratios in kind_rows.items():
            spread = Spread.of(ratios)
            key = fact_key("test", stratum)
            table[key] = Fact(key=key, value=vars(spread), unit="measured / predicted", source="a test",
                              measured_on=None, fitted_to=())

    monkeypatch.setitem(facts._PROVIDERS, "error.test:", lambda: table)
    return give


def test_a_range_is_measured_over_predicted_applied_the_right_way(rows_of):
    ratios = [0.8 + 0.01 * i for i in range(P90_ROWS + 5)]  # measured 0.8-1.04 of predicted: predictions run high
    rows_of({ONE_A100: ratios})
    bar = bar_for("test", ONE_A100)
    assert bar.measured and bar.pooled == () and bar.spread.n == len(ratios)
    low, high = bar.range
    assert (low, high) == (quantile(ratios, 0.1), quantile(ratios, 0.9))
    error = ErrorBar.of(bar)
    assert error.bounds(100.0) == pytest.approx((100 * low, 100 * high))       # a peak: times the ratio
    assert error.bounds(100.0, rate=True) == pytest.approx((100 / high, 100 / low))  # tokens/s of a timed step
    assert error.bounds(100.0, rate=True)[1] > 100  # the bias shows: predicted too slow, so faster is likely


def test_too_few_rows_show_the_extremes_and_pooling_widens_and_says_so(rows_of):
    ratios = [0.9, 1.0, 1.1, 1.2, 1.3]
    rows_of({ONE_A100.pooled(2): ratios})  # only compile and GPU pooled hold rows
    bar = bar_for("test", ONE_A100)
    assert bar.pooled == ("compiled", "gpu") and bar.stratum.gpu == POOLED and bar.covers == 1.0
    median = quantile(sorted(ratios), 0.5)
    assert bar.range == pytest.approx((median * (0.9 / median) ** 2, median * (1.3 / median) ** 2))


def test_what_no_row_measured_is_not_measured_never_borrowed(rows_of):
    rows_of({ONE_A100: [1.0] * MIN_ROWS})
    nodes = stratum("A100-80GB", 8, world_size=64, engine="fsdp", zero_stage=3)
    liger = stratum("A100-80GB", liger=True)
    assert not bar_for("test", nodes).measured and not bar_for("test", liger).measured
    assert ErrorBar.of(bar_for("test", nodes)).status == "not measured"


def test_the_margin_covers_95_percent_of_rows_like_it_or_says_why_not(rows_of):
    many = [0.9 + 0.01 * i for i in range(P90_ROWS)]
    rows_of({ONE_A100: many})
    margin = margin_for(bar_for("test", ONE_A100), predicted_peak=10_000, activations=4_000)
    assert margin.basis == "rows" and margin.n == P90_ROWS
    assert margin.bytes == int(10_000 * (quantile(many, 0.95) - 1))
    assert sum(r * 10_000 <= 10_000 + margin.bytes for r in many) >= 0.95 * len(many)
    unlike = stratum("H100-80GB")
    few = margin_for(bar_for("test", unlike), predicted_peak=10_000, activations=4_000)
    assert few.basis == "activations" and few.n == 0  # nothing like it: the activation margin, and it says n = 0
    assert few.bytes == int(facts.get("memory.activation_margin") * 4_000)


@pytest.mark.slow
def test_three_unlike_plans_carry_their_own_bars():
    """bloom-560m on one A100, Llama-3.1-70B on 64 H100s and Llama-3.1-8B QLoRA on a 4090 do not share one bar:
    each is drawn from its own stratum, pooled and saying so, or not measured."""
    plans = [plan("bigscience/bloom-560m", 256, gpu="A100-80GB", detect=False),
             plan("meta-llama/Llama-3.1-70B", 512, seq_len=4096, gpu="H100-80GB", gpus_per_node=8, nodes=8,
                  detect=False),
             plan("meta-llama/Llama-3.1-8B", 16, peft="qlora", gpu="RTX4090-24GB", detect=False)]
    bars = [(p.memory_error, p.throughput_error) for p in plans]
    assert len({(m.stratum, m.pooled, t.stratum, t.pooled) for m, t in bars}) == 3
    for p, (memory, speed) in zip(plans, bars):
        for error, key in ((memory, "memory"), (speed, "throughput")):
            data = p.to_json()[key]["error"]
            assert {"n", "stratum", "pooled", "p10", "median", "p90", "status"} <= set(data)
            assert error.measured or error.n == 0
    assert not bars[1][0].measured and not bars[1][1].measured  # 64 GPUs: no row ran on several nodes
    text = plans[1].explain()
    assert "not measured" in text and "nothing like it measured" in text


def test_a_bar_covers_about_what_it_claims_on_rows_it_did_not_see():
    """Leave one row out of each stratum with enough rows, draw the 10th-90th percentile from the rest: about 80 %
    of the held-out rows fall within (within three binomial standard deviations, a stated sampling tolerance)."""
    results = report.load_results()
    checked = 0
    for kind in report.KINDS:
        rows = [row for _, row in report.kind_rows(results, kind)]
        for stratum, members in report.strata(rows).items():
            if len(members) <= P90_ROWS or POOLED in (stratum.program, stratum.gpu):
                continue
            ratios = [r.ratio for r in members]
            inside = 0
            for i, held in enumerate(ratios):
                rest = sorted(ratios[:i] + ratios[i + 1:])
                inside += quantile(rest, 0.1) <= held <= quantile(rest, 0.9)
            n = len(ratios)
            assert abs(inside / n - 0.8) <= 3 * math.sqrt(0.16 / n) + 2 / n, (kind, stratum.key, inside, n)
            checked += 1
    assert checked
