"""The planner offline against what a real GPU measured: every single-GPU step our probes ran on a lent H100.

Rows come from benchmarks/data/gpu_measured_h100.json (copied from the committed gpu_validation results, each with
its source file and command). Each row's configuration is planned pinned, exactly as gpu_validation.py planned it on
the GPU, and the prediction is compared with the measurement: peak allocated, peak reserved, process memory (NVML)
and tokens/s. Nothing in the planner is fitted to these rows: they are out-of-sample for every constant except
where a results file is cited as a constant's source (efficiency.json names those).

Run:  HF_HUB_OFFLINE=1 python benchmarks/gpu_measured.py [--out benchmarks/results/gpu_measured.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from planner.errors import NoFitError

DATA = Path(__file__).resolve().parent / "data" / "gpu_measured_h100.json"
MEMORY = (("peak_allocated", "peak_allocated"), ("peak_reserved", "peak_reserved"),
          ("peak_process", "process_memory"))


def measured_tokens_per_s(row: dict) -> float:
    """The row's measured micro-step and optimizer-step times at the planned accumulation."""
    steps = row["batch"] // row["micro_batch"]
    return row["batch"] * row["seq_len"] / (steps * row["micro_step_s"] + row["optimizer_step_s"])


def predict(row: dict, gpu: str) -> dict:
    from gpu_validation import pinned_plan

    draft = pinned_plan(row["model"], row["seq_len"], row["precision"], row["checkpointing"], row["micro_batch"],
                        gpu, batch=row["batch"])
    est, speed = draft.choice.memory, draft.choice.throughput
    out = {"method": est.method, "tokens_per_s": speed.tokens_per_s}
    for ours, _ in MEMORY:
        out[ours] = getattr(est, ours)
    return out


def summary(errors: list[float]) -> dict:
    if not errors:
        return {}
    return {"median_abs": statistics.median(abs(e) for e in errors), "worst": max(errors, key=abs),
            "under_predicted": sum(e < 0 for e in errors), "rows": len(errors)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the rows and the summary as JSON")
    args = parser.parse_args()
    data = json.loads(DATA.read_text())
    rows, errors = [], {name: [] for name in [m for m, _ in MEMORY] + ["tokens_per_s"]}
    for row in data["rows"]:
        result = {k: row[k] for k in ("model", "seq_len", "precision", "checkpointing", "micro_batch", "batch")}
        label = f"{row['model']:<32} {row['precision']:<10} {row['checkpointing']:<9} mb {row['micro_batch']:>2}"
        try:
            got = predict(row, data["gpu"])
        except NoFitError as err:  # predicted not to fit although it ran: the worst kind of over-prediction
            rows.append({**result, "predicted": "no fit", "reason": str(err).splitlines()[0]})
            print(f"{label}  predicted not to fit", flush=True)
            continue
        result["method"] = got["method"]
        for ours, theirs in MEMORY:
            error = got[ours] / row[theirs] - 1
            errors[ours].append(error)
            result[f"{ours}_error"] = error
        measured = measured_tokens_per_s(row)
        result.update(predicted_tokens_per_s=got["tokens_per_s"], measured_tokens_per_s=measured,
                      tokens_per_s_error=got["tokens_per_s"] / measured - 1)
        errors["tokens_per_s"].append(result["tokens_per_s_error"])
        rows.append(result)
        print(f"{label}  alloc {result['peak_allocated_error']:+7.1%}  reserved {result['peak_reserved_error']:+7.1%}  "
              f"process {result['peak_process_error']:+7.1%}  tok/s {result['tokens_per_s_error']:+7.1%}",
              flush=True)
    report = {"gpu": data["gpu"], "summary": {k: summary(v) for k, v in errors.items()}, "rows": rows}
    for name, s in report["summary"].items():
        print(f"{name:<15} median |error| {s['median_abs']:.1%}  worst {s['worst']:+.1%}  "
              f"under-predicted {s['under_predicted']}/{s['rows']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
