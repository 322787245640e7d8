"""Probe results on disk (JSON), keyed by what makes a measurement valid elsewhere: the model's config hash,
the GPU, torch and CUDA versions, and every setting of the candidate."""

from __future__ import annotations

import hashlib
import json

from planner.cache import load_json, store_json


def probe_key(request: dict, gpu_name: str) -> str:
    import torch

    fields = {k: v for k, v in request.items() if k not in ("config", "model_dir", "inject", "timeout_s")}
    fields.update(gpu=gpu_name, torch=torch.__version__, cuda=torch.version.cuda, version=1)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def load(key: str) -> dict | None:
    return load_json("probes", key)


def store(key: str, result: dict) -> None:
    if result.get("status") in ("ok", "oom"):  # timeouts and crashes are worth retrying
        store_json("probes", key, result)
