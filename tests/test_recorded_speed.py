"""benchmarks/recorded_speed.py: the recorded GPU steps as it plans them, and Kendall's tau of their order."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import recorded_speed  # noqa: E402


@pytest.mark.parametrize("predicted, measured, tau", [
    ([1, 2, 3, 4], [10, 20, 30, 40], 1.0),
    ([1, 2, 3, 4], [40, 30, 20, 10], -1.0),
    ([1, 2, 3], [1, 3, 2], 1 / 3),              # one pair of three swapped: (2 - 1) / 3
    ([1, 2, 3, 4], [1, 2, 4, 3], 4 / 6),
    ([1, 1, 2], [1, 2, 3], 2 / 6 ** 0.5),      # tau-b: a tie in one order, (2 - 0) / sqrt(2 x 3)
])
def test_kendalls_tau_counts_concordant_and_discordant_pairs(predicted, measured, tau):
    assert recorded_speed.kendall_tau(predicted, measured) == pytest.approx(tau)


def test_kendalls_tau_of_fewer_than_two_items_or_all_tied_is_undefined():
    assert recorded_speed.kendall_tau([1.0], [2.0]) is None
    assert recorded_speed.kendall_tau([1, 1, 1], [1, 2, 3]) is None


def test_every_recorded_step_is_read_with_the_program_that_ran_it():
    """The H100 steps ran without Liger-Kernel (the probes of 2026-11-22/23); the H200 runs with it exactly where their
    plan's label says so; each measured step is its micro-steps at its accumulation plus its optimizer step."""
    h100, h200 = recorded_speed.h100_rows(), recorded_speed.h200_rows()
    assert len(h100) == len(json.loads(recorded_speed.H100_DATA.read_text())["rows"]) == 39
    assert all(dict(r.fields)["liger"] == "off" for r in h100)
    data = {r["id"]: r for r in json.loads(recorded_speed.H200_DATA.read_text())["rows"]}
    assert len(h200) == len(data) == 17
    source = json.loads((ROOT / "benchmarks" / "results" / "gpu_validation-H200-141GB-2026-11-27.json").read_text())
    labels = {c["id"]: c["predicted"]["config"] for c in source["configs"] if c.get("status") == "ok"}
    for row in h200:
        assert (dict(row.fields)["liger"] == "on") == ("Liger" in labels[row.id])
        r = data[row.id]
        assert row.measured_s == pytest.approx(r["grad_accum"] * r["micro_step_s"] + r["optimizer_step_s"])
        assert row.measured_s == pytest.approx(r["step_time_s"], rel=0.05)  # what the run's own clock says


def test_the_ranking_groups_a_models_rows_on_one_gpu():
    rows = recorded_speed.h200_rows()[:3]
    scored = [recorded_speed.Scored(row=r, predicted_s=r.measured_s * (1 + i / 10), micro_gpu_s=0, micro_cpu_s=0)
              for i, r in enumerate(rows)]
    found = recorded_speed.ranking(scored)
    assert sum(v["rows"] for v in found.values()) == 3
    assert all(key.endswith("on H200-141GB") for key in found)
