"""Receipts as accuracy rows: a GPU run's receipt (planner/receipts.py) holds a prediction made before the run
beside what the run measured, so each becomes a peak-memory row (peak_reserved) and a step-time row, labelled as every
row is (benchmarks/evidence.py: first-look where the receipt was not in the last commit).

Receipts are read from benchmarks/data/receipts/ (copy a team's runs there, or gpu_validation's --out receipts/):

    python -m benchmarks.receipt_rows
"""

from __future__ import annotations

import argparse
import json

from benchmarks.evidence import DATA, Row, run_group, write_results
from planner.config import Config

FOLDER = DATA / "receipts"
#: receipt quantity -> (results name, the kind of rows it gives, what it is)
QUANTITIES = {"peak_reserved": ("receipts-memory", "memory", "peak reserved bytes per GPU"),
              "step_time_s": ("receipts-throughput", "throughput", "optimizer step time (s)")}


def rows_of(receipt: dict, name: str) -> dict[str, list[Row]]:
    """The receipt's rows by quantity: those it predicted and measured on a GPU."""
    plan, out = receipt["plan"], {}
    if (receipt.get("device") or {}).get("kind") != "cuda":
        return out
    cfg = Config.model_validate(plan["choice"])
    hardware = plan["hardware"]
    group = run_group("trainer", hardware["gpu"], cfg, gpus_per_node=hardware["gpus_per_node"],
                      adapter=plan.get("adapter", "none"))
    for quantity in QUANTITIES:
        predicted, measured = receipt["predicted"].get(quantity), receipt["measured"].get(quantity)
        if predicted and measured:
            out[quantity] = [Row(id=f"{name}:{quantity}", data_file=f"receipts/{name}",
                                 source=f"receipt of {plan['model']} on {hardware['gpu']}, {plan['label']}",
                                 predicted=float(predicted), measured=float(measured), group=group)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    rows: dict[str, list[Row]] = {q: [] for q in QUANTITIES}
    for file in sorted(FOLDER.glob("*.json")) if FOLDER.is_dir() else []:
        for quantity, found in rows_of(json.loads(file.read_text()), file.name).items():
            rows[quantity] += found
    if not any(rows.values()):
        print(f"no GPU receipts in {FOLDER}: nothing written")
        return
    for quantity, (name, kind, metric) in QUANTITIES.items():
        if rows[quantity]:
            path = write_results(name, rows[quantity], kind=kind, metric=metric,
                                 stack="the user's own runs, through plan.callback() or probes.train",
                                 cannot_show="what the runs did not measure; receipts of one configuration each",
                                 command="python -m benchmarks.receipt_rows")
            print(f"{len(rows[quantity])} rows -> {path}")


if __name__ == "__main__":
    main()
