"""Probe results on disk (JSON), keyed by what makes a measurement valid elsewhere: the model's config hash,
the GPU, torch and CUDA versions, and every setting of the candidate."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("TRAINPLAN_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "trainplan")
    return Path(root).expanduser() / "probes"


def probe_key(request: dict, gpu_name: str) -> str:
    import torch

    fields = {k: v for k, v in request.items() if k not in ("config", "model_dir", "inject", "timeout_s")}
    fields.update(gpu=gpu_name, torch=torch.__version__, cuda=torch.version.cuda, version=1)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def load(key: str) -> dict | None:
    try:
        return json.loads((cache_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None


def store(key: str, result: dict) -> None:
    if result.get("status") not in ("ok", "oom"):  # timeouts and crashes are worth retrying
        return
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(result, sort_keys=True))
        tmp.replace(folder / f"{key}.json")
    except OSError:
        pass
