"""Every receipt predicted again by today's planner: what `python -m benchmarks.report` scores "today" and draws the
error bars from (benchmarks/results/rescored.json).

A receipt is predicted again the way it was first predicted: `planner.plan` pinned to the configuration that ran
(`plan.request`, benchmarks/runs.py `plan_prediction`), or, for a published run of a program no plan runs, by the
benchmark that predicts it (`Receipt.predictor` names the module; its `predict_again(receipt)` returns a Prediction).
A receipt that names neither (a run of a local model folder or a dataset, which it cannot name) has no today's
prediction. The file records the planner tree it was made with: the report refuses figures made by another planner
than the one checked out (`is_current`; the error bars it generates into planner/ left out of that comparison).
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from datetime import date
from pathlib import Path

from benchmarks import runs
from planner.receipts import Prediction, Receipt, tree_hash, versions

ROOT = Path(__file__).resolve().parents[1]
RESCORED = ROOT / "benchmarks" / "results" / "rescored.json"
FORMAT = "trainplan-rescored-1"
#: What the report writes into planner/ from the rescoring (the error bars): no prediction's raw figure reads it.
GENERATED = frozenset({"facts/errors.json"})


def planner_model() -> str | None:
    """The planner that predicts, as a tree hash of planner/ less what the report generates from its predictions."""
    return tree_hash(ROOT / "planner", GENERATED)


def key(bench: runs.Benchmark, receipt: Receipt) -> str:
    return f"{bench.name}/{receipt.id}"


def predict_again(receipt: Receipt) -> Prediction | None:
    """Today's prediction of the run `receipt` records (None where it cannot be made again)."""
    if receipt.predictor != "plan":
        module = importlib.import_module(f"benchmarks.{receipt.predictor}")
        return module.predict_again(receipt)
    if receipt.plan.request is None:
        return None
    return runs.plan_prediction(receipt.plan.request)[0]


def rescore(benchmarks: list[runs.Benchmark], progress=print) -> dict:
    """Today's predictions of every receipt, by `key`, with the planner tree and stack that made them."""
    found, failed, start = {}, {}, time.monotonic()
    todo = [(bench, r) for bench in benchmarks for r in bench.receipts]
    for i, (bench, receipt) in enumerate(todo, start=1):
        progress(f"[{i}/{len(todo)} {time.monotonic() - start:4.0f} s] {key(bench, receipt)}")
        try:
            prediction = predict_again(receipt)
        except Exception as err:  # noqa: BLE001 - one receipt that no longer plans is recorded, not fatal
            failed[key(bench, receipt)] = f"{type(err).__name__}: {str(err)[:200]}"
            continue
        if prediction is not None:
            found[key(bench, receipt)] = prediction.model_dump(mode="json")
    stack = versions()
    return {"format": FORMAT, "tree": planner_model(), "date": date.today().isoformat(),
            "stack": {k: stack.get(k) for k in ("python", "torch", "transformers", "accelerate", "peft", "deepspeed",
                                                 "liger-kernel", "torchao")},
            "predictions": found, "failed": failed}


def load(path: Path = RESCORED) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"tree": None, "predictions": {}, "failed": {}}


def today(rescored: dict, bench: runs.Benchmark, receipt: Receipt) -> Prediction | None:
    found = rescored["predictions"].get(key(bench, receipt))
    return Prediction.model_validate(found, strict=False) if found else None


def is_current(rescored: dict) -> bool:
    """Whether the rescoring was made with the planner checked out here."""
    return rescored.get("tree") == planner_model()


def main() -> int:
    data = rescore(runs.load(), progress=lambda line: print(line, file=sys.stderr, flush=True))
    RESCORED.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"{len(data['predictions'])} receipts predicted again, {len(data['failed'])} failed -> {RESCORED}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
