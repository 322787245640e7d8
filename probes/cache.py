"""Probe results on disk (JSON), keyed by what makes a measurement valid elsewhere: the model's config hash,
the GPU, torch and CUDA versions, and every setting of the candidate."""

from __future__ import annotations

import hashlib
import json

from pydantic import ValidationError

from planner.cache import load_json, store_json
from planner.types import Measurement
from planner.vocab import OK, OOM

#: Results worth keeping: a timeout or a crash is retried next time.
CACHED_STATUSES = (OK, OOM)
VERSION = 2


def probe_key(request, gpu_name: str) -> str:
    import torch

    fields = request.cache_fields()
    fields.update(gpu=gpu_name, torch=torch.__version__, cuda=torch.version.cuda, version=VERSION)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def load(key: str) -> Measurement | None:
    data = load_json("probes", key)
    if data is None:
        return None
    try:
        return Measurement.model_validate(data)
    except ValidationError:  # written by another version: measure again
        return None


def store(key: str, result: Measurement) -> None:
    if result.status in CACHED_STATUSES:
        store_json("probes", key, result.model_dump(exclude={"cached", "seconds"}))
