"""Advice that works: every suggestion of a request that fits nowhere carries the flags that make it fit, and the
request re-planned with them fits. Another GPU is sought among the user's kind first; adapters come before a
suggestion of hundreds of GPUs; a dataset's rows are shortened with --max-length, which combines with --dataset."""

from __future__ import annotations

import json

import pytest

from planner import NoFitError, PlanRequest
from planner.hardware import lookup_gpu
from planner.planning import plan_request
from planner.render import suggestion_text

pytestmark = pytest.mark.slow

REQUESTS = {
    "8b-on-l40s": dict(model="meta-llama/Llama-3.1-8B", global_batch=256, gpu="L40S-48GB"),
    "70b-on-a-4090": dict(model="meta-llama/Llama-3.1-70B", global_batch=64, gpu="RTX4090-24GB"),
}


def _levers(fields: dict):
    request = PlanRequest.of(**fields)
    with pytest.raises(NoFitError) as info:
        plan_request(request, detect=False)
    return request, info.value.levers


@pytest.mark.parametrize("name", REQUESTS)
@pytest.mark.long
def test_every_suggestion_re_planned_fits(name):
    request, levers = _levers(REQUESTS[name])
    actionable = [lv for lv in levers if lv.changes]
    assert actionable, [lv.kind for lv in levers]
    for lv in actionable:
        replanned = plan_request(request.model_copy(update=lv.changes), detect=False)
        assert replanned.choice.fits, (lv.kind, lv.changes)
        assert suggestion_text(lv).endswith(")."), suggestion_text(lv)


def test_a_consumer_card_is_offered_consumer_cards_first_and_adapters_before_hundreds_of_gpus():
    _, levers = _levers(REQUESTS["70b-on-a-4090"])
    kinds = [lv.kind for lv in levers]
    assert "adapters" in kinds
    adapters = levers[kinds.index("adapters")]
    assert adapters.changes["peft"] == "qlora" and lookup_gpu(adapters.changes["gpu"]).vendor == "nvidia"
    more = [lv for lv in levers if lv.kind == "more-gpus"]
    if more and more[0]["gpus"] >= 64:
        assert kinds.index("adapters") < kinds.index("more-gpus")
    assert all(lookup_gpu(lv.changes["gpu"]).vendor == "nvidia" for lv in levers if "gpu" in lv.changes)


@pytest.mark.long
def test_a_dataset_plan_is_told_a_max_length_not_a_seq_len(tmp_path):
    pytest.importorskip("datasets", reason="a dataset plan reads its rows through datasets")
    rows = tmp_path / "long.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": [1] * n}) + "\n" for n in (2000, 8000, 32000, 30000)))
    request, levers = _levers(dict(model="meta-llama/Llama-3.1-8B", global_batch=8, gpu="T4-16GB",
                                   dataset=str(rows), peft="qlora"))
    shorter = [lv for lv in levers if "sequence" in lv.kind]
    assert shorter and all("seq_len" not in lv.changes for lv in levers)
    assert "max_length" in shorter[0].changes and "--max-length" in suggestion_text(shorter[0])
    assert plan_request(request.model_copy(update=shorter[0].changes), detect=False).choice.fits
