"""Probe results on disk (JSON), keyed by what makes a measurement valid elsewhere: the candidate's emitted files
(engine, precision, checkpointing, split, optimizer, model), the GPU, and the torch, CUDA and library versions.
A timeout is kept with the time it was given: a later probe with no more time reuses it, one with more runs again."""

from __future__ import annotations

import hashlib
import json

from pydantic import ValidationError

from planner.cache import load_json, store_json
from planner.types import Measurement
from planner.vocab import OK, OOM, TIMEOUT

#: Results worth keeping (an error is retried next time).
CACHED_STATUSES = (OK, OOM, TIMEOUT)
VERSION = 3
#: What plan.json says of the plan around a candidate (notes, earlier runs, calibrations): not what the run trains.
AROUND_THE_RUN = ("notes", "advice", "receipt_checks", "speed_calibration", "speed_calibrations", "calibration", "probes")


def probe_key(files: dict[str, str], gpu_name: str, run: tuple) -> str:
    import accelerate
    import torch
    import transformers

    trained = dict(files)
    if "plan.json" in files:
        plan = json.loads(files["plan.json"])
        trained["plan.json"] = json.dumps({k: v for k, v in plan.items() if k not in AROUND_THE_RUN}, sort_keys=True)
    data = {"files": trained, "gpu": gpu_name, "run": list(run), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "accelerate": accelerate.__version__, "version": VERSION}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:24]


def load(key: str, budget_s: float) -> Measurement | None:
    data = load_json("probes", key)
    if data is None:
        return None
    try:
        result = Measurement.model_validate(data)
    except ValidationError:  # written by another version: measure again
        return None
    if result.status == TIMEOUT and budget_s > result.budget_s:
        return None
    return result


def store(key: str, result: Measurement) -> None:
    if result.status in CACHED_STATUSES:
        store_json("probes", key, result.model_dump(exclude={"cached", "seconds"}))
