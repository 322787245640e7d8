"""What every accuracy benchmark records per row, so that "out-of-sample" is computed, never typed.

A row is a prediction beside the measurement it is judged against. `predicted_row` runs the prediction inside
`planner.facts.recording()`, so the row carries every fact the prediction used, and asks `planner.facts.in_sample_by`
which of them were fitted to the row or to its source: a row is in-sample when any was. `write_results` stores the
rows and their summaries in the one shape `benchmarks/report.py` reads (benchmarks/results/<name>.json).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from planner import facts

RESULTS = Path(__file__).resolve().parent / "results"
FORMAT = "trainplan-evidence-1"


@dataclass(frozen=True)
class Row:
    """One judged prediction. `group` holds the strata a plan's error bars are drawn from: `program` (how the
    measured run trained: "trainer" for the HF Trainer's program on HF model code, as trainplan's files run it;
    "hf-loop" for HF model code in a loop of its own; "optimised" for another stack's own model code), `gpu` (the
    catalog GPU) and `precision` (a `Config.precision_family`)."""

    id: str
    data_file: str              # the benchmarks/data file the measurement is from ("" for a results file)
    source: str                 # the measurement's source, as its data row says it
    predicted: float
    measured: float
    group: dict = field(default_factory=dict)
    facts_used: tuple[str, ...] = ()
    in_sample_by: tuple[str, ...] = ()   # the facts fitted to this row or its source (empty: out-of-sample)
    note: str = ""

    @property
    def error(self) -> float:
        """Signed relative error: positive where the prediction is above the measurement."""
        return self.predicted / self.measured - 1

    @property
    def in_sample(self) -> bool:
        return bool(self.in_sample_by)

    def to_json(self) -> dict:
        return {**asdict(self), "error": self.error, "in_sample": self.in_sample,
                "source_key": facts.source_key(self.source)}


def predicted_row(*, id: str, data_file: str, source: str, measured: float, predict: Callable[[], float],
                  group: dict | None = None, note: str = "") -> Row:
    """The row of `predict()` against `measured`, with the facts it used and which of them make it in-sample."""
    with facts.recording() as used:
        value = predict()
    return Row(id=id, data_file=data_file, source=source, predicted=float(value), measured=float(measured),
               group=dict(group or {}), facts_used=tuple(sorted(used)),
               in_sample_by=tuple(sorted(facts.in_sample_by(used, data_file, id, source))), note=note)


def summary(rows: Iterable[Row]) -> dict:
    """Rows, median and worst absolute error, signed bias (median signed error), share under-predicted and the 90th
    percentile absolute error, over the rows given (None where there are none)."""
    rows = list(rows)
    if not rows:
        return {"rows": 0, "median_abs": None, "p90_abs": None, "worst_abs": None, "bias": None, "under": None}
    errors = sorted(abs(r.error) for r in rows)
    return {"rows": len(rows), "median_abs": statistics.median(errors), "p90_abs": percentile(errors, 0.9),
            "worst_abs": errors[-1], "bias": statistics.median(r.error for r in rows),
            "under": sum(r.error < 0 for r in rows) / len(rows)}


def percentile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank percentile of values already sorted."""
    rank = max(1, -(-int(q * 1000) * len(sorted_values) // 1000))
    return sorted_values[min(rank, len(sorted_values)) - 1]


#: What a benchmark's rows predict: `memory` and `throughput` rows give plans their error bars; `other` checks a part.
KINDS = ("memory", "throughput", "other")


def write_results(name: str, rows: list[Row], *, kind: str, metric: str, stack: str, cannot_show: str, command: str,
                  out: Path | None = None) -> Path:
    """benchmarks/results/<name>.json: the rows, their summaries (all, in-sample, out-of-sample) and what the numbers
    mean. `kind` is one of KINDS."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}")
    path = out or RESULTS / f"{name}.json"
    record = {
        "format": FORMAT, "benchmark": name, "kind": kind, "metric": metric, "stack": stack,
        "cannot_show": cannot_show, "command": command,
        "summary": {"all": summary(rows), "in_sample": summary(r for r in rows if r.in_sample),
                    "out_of_sample": summary(r for r in rows if not r.in_sample)},
        "rows": [r.to_json() for r in rows],
    }
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return path
