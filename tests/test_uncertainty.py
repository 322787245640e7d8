"""How sure a plan is (planner/uncertainty.py): bars from the runs like the plan, ranges of measured / predicted the
right way round, pooling said and widened but never past a measured run, "not measured" where nothing like it ran
(another scale, Liger or precision is never borrowed), a margin sized to 95 % of runs like it, and bars that cover
about what they claim on the committed runs."""

from __future__ import annotations

import math

import pytest

from benchmarks import rescore, runs, scoring
from planner import facts, plan
from planner.config import Config
from planner.facts import Fact
from planner.types import ErrorBar
from planner.uncertainty import (
    MIN_RUNS, P90_RUNS, POOLED, Spread, Stratum, bar_for, fact_key, margin_for, quantile,
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
    ratios = [0.8 + 0.01 * i for i in range(P90_RUNS + 5)]  # measured 0.8-1.04 of predicted: predictions run high
    rows_of({ONE_A100: ratios})
    bar = bar_for("test", ONE_A100)
    assert bar.measured and bar.pooled == () and bar.spread.n == len(ratios)
    low, high = bar.range
    assert (low, high) == (quantile(ratios, 0.1), quantile(ratios, 0.9))
    error = ErrorBar.of(bar)
    assert error.bounds(100.0) == pytest.approx((100 * low, 100 * high))       # a peak: times the ratio
    assert error.bounds(100.0, rate=True) == pytest.approx((100 / high, 100 / low))  # tokens/s of a timed step
    assert error.bounds(100.0, rate=True)[1] > 100  # the bias shows: predicted too slow, so faster is likely


def test_too_few_runs_show_the_extremes_and_pooling_says_so(rows_of):
    ratios = [0.9, 1.0, 1.1, 1.2, 1.3]
    rows_of({ONE_A100.pooled(2): ratios})  # only compile and GPU pooled hold runs
    bar = bar_for("test", ONE_A100)
    assert bar.pooled == ("compiled", "gpu") and bar.stratum.gpu == POOLED and bar.covers == 1.0
    assert bar.range == (0.9, 1.3)  # the median and the worst runs', no wider: no run measured more


def test_pooling_widens_a_percentile_range_but_never_past_the_most_extreme_run(rows_of):
    ratios = [1.0 + 0.01 * i for i in range(P90_RUNS)] + [1.5]
    rows_of({ONE_A100.pooled(4): ratios})  # compile, GPU, engine and adapter pooled
    bar = bar_for("test", ONE_A100)
    spread = bar.spread
    low, high = bar.range
    assert spread.low <= low < spread.p10 and spread.p90 < high <= spread.high  # widened, within what was measured
    assert high == pytest.approx(min(spread.high, spread.median * (spread.p90 / spread.median) ** 3))


def test_what_no_run_measured_is_not_measured_never_borrowed(rows_of):
    rows_of({ONE_A100: [1.0] * MIN_RUNS})
    nodes = stratum("A100-80GB", 8, world_size=64, engine="fsdp", zero_stage=3)
    liger = stratum("A100-80GB", liger=True)
    fp32, fp8 = stratum("A100-80GB", precision="fp32"), stratum("H100-80GB", precision="fp8")
    for other in (nodes, liger, fp32, fp8):  # another scale, Liger, precision: none borrows bf16 runs' bars
        assert not bar_for("test", other).measured
    assert stratum("A100-80GB", precision="fp16-mixed").precision == ONE_A100.precision == "mixed"
    assert ErrorBar.of(bar_for("test", nodes)).status == "not measured"


def test_the_margin_covers_95_percent_of_rows_like_it_or_says_why_not(rows_of):
    many = [0.9 + 0.01 * i for i in range(P90_RUNS)]
    rows_of({ONE_A100: many})
    margin = margin_for(bar_for("test", ONE_A100), predicted_peak=10_000, activations=4_000)
    assert margin.basis == "rows" and margin.n == P90_RUNS
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


def _committed_runs():
    return scoring.scored(runs.load(), rescore.load())


def test_a_bar_covers_about_what_it_claims_on_runs_it_did_not_see():
    """Leave one run out of each stratum with enough runs, draw the 10th-90th percentile from the rest: about 80 %
    of the held-out runs fall within (within three binomial standard deviations, a stated sampling tolerance)."""
    committed = _committed_runs()
    checked = 0
    for kind in scoring.KINDS:
        for stratum, members in scoring.strata(scoring.bar_runs(committed, kind)).items():
            if len(members) <= P90_RUNS or POOLED in (stratum.program, stratum.gpu):
                continue
            ratios = [f.ratio_today for _, f in members]
            inside = 0
            for i, held in enumerate(ratios):
                rest = sorted(ratios[:i] + ratios[i + 1:])
                inside += quantile(rest, 0.1) <= held <= quantile(rest, 0.9)
            n = len(ratios)
            assert abs(inside / n - 0.8) <= 3 * math.sqrt(0.16 / n) + 2 / n, (kind, stratum.key, inside, n)
            checked += 1
    assert checked


def test_every_range_a_plan_shows_lies_within_the_ratios_its_runs_measured():
    """For every stratum a plan can draw a bar from (planner/facts/errors.json), the range it prints is within the
    most extreme measured / predicted of the runs behind it (to the four decimals errors.json keeps), whatever was
    pooled."""
    committed = _committed_runs()
    extremes = {}
    for kind in scoring.KINDS:
        for stratum, members in scoring.strata(scoring.bar_runs(committed, kind)).items():
            ratios = [f.ratio_today for _, f in members]
            extremes[fact_key(kind, stratum)] = (round(min(ratios), 4), round(max(ratios), 4))  # as errors.json keeps
    checked = 0
    for key, value in facts.all_facts().items():
        if not key.startswith("error."):
            continue
        kind, stratum = key.removeprefix("error.").split(":", 1)
        stratum = Stratum.from_json(dict(zip(("program", "gpu", "scale", "engine", "adapter", "liger", "compiled",
                                               "precision"), stratum.split(":"))))
        bar = bar_for(kind, stratum)
        low, high = bar.range
        assert extremes[fact_key(kind, bar.stratum)][0] <= low <= high <= extremes[fact_key(kind, bar.stratum)][1]
        checked += 1
    assert checked
