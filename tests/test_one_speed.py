"""One plan, one speed: the figure the text shows is --json's `tokens_per_s`, the alternatives' basis, the report's
star and a receipt's printed prediction; the model's own figure sits under `throughput.model`, and the error bar says
its unit and what was applied."""

from __future__ import annotations

import pytest

import planner
from emit.report_svg import speed
from planner.receipts import prediction
from planner.render import fmt_tokens


@pytest.fixture(scope="module")
def corrected():
    """A plan whose stratum holds measured runs (bf16-true: published runs no fact was fitted to): its speeds are the
    model's times their median."""
    p = planner.plan("gpt2", 64, gpu="A100-80GB", seq_len=1024, detect=False, liger="off", precision="bf16-true")
    assert p.choice.throughput.source == "corrected" and p.speed_correction is not None
    return p


def test_json_text_alternatives_report_and_receipt_say_one_speed(corrected):
    p, data = corrected, corrected.to_json()
    tp, factor = p.choice.throughput, p.speed_correction.factor
    assert data["throughput"]["tokens_per_s"] == tp.tokens_per_s == data["choice"]["tokens_per_step"] / tp.step_time_s
    assert data["throughput"]["model"]["step_time_s"] * factor == pytest.approx(tp.step_time_s)
    assert f"~{fmt_tokens(tp.useful_tokens_per_s)} tokens/s" in " ".join(p.explain().split())
    for cand in data["candidates"]:  # the alternatives: every modelled candidate times the same factor
        if cand["throughput"] and cand["throughput"]["source"] == "corrected":
            own = cand["throughput"]["model_step_time_s"]
            assert cand["throughput"]["step_time_s"] == pytest.approx(max(factor, cand["throughput"]["hfu"]) * own)
    assert speed(p.choice) == tp.useful_tokens_per_s  # the report's star
    printed = prediction(data)
    assert printed.printed.tokens_per_s == tp.tokens_per_s and printed.printed.step_time_s == tp.step_time_s
    assert printed.model.step_time_s == data["throughput"]["model"]["step_time_s"]


def test_the_error_says_its_unit_and_what_it_was_applied_to(corrected):
    error = corrected.to_json()["throughput"]["error"]
    assert error["unit"] == "measured / predicted step time, one per run"
    assert error["correction"] == corrected.speed_correction.factor == error["median"]
    assert "every candidate's modelled step time" in error["applied_to"]
    assert corrected.to_json()["memory"]["error"]["unit"].startswith("measured / predicted peak memory")


def test_a_plan_no_run_is_like_is_the_models_and_says_so():
    p = planner.plan("gpt2", 64, gpu="A100-80GB", seq_len=1024, detect=False, liger="off", precision="fp32")
    data = p.to_json()
    assert p.choice.throughput.source == "model" and p.speed_correction is None
    assert data["throughput"]["model"]["step_time_s"] == data["throughput"]["step_time_s"]
    assert data["throughput"]["error"]["status"] == "not measured" and data["throughput"]["error"]["correction"] is None
    assert "nothing like it measured" in " ".join(p.explain().split())
