"""trainplan's on-disk caches (traces, probe results): JSON files under one root, written atomically.

The root is $TRAINPLAN_CACHE, else $XDG_CACHE_HOME/trainplan, else ~/.cache/trainplan. A cache that cannot be
read or written is never an error: the caller simply computes again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def cache_dir(kind: str) -> Path:
    root = os.environ.get("TRAINPLAN_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "trainplan")
    return Path(root).expanduser() / kind


def load_json(kind: str, key: str) -> dict | None:
    try:
        data = json.loads((cache_dir(kind) / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def store_json(kind: str, key: str, data: dict) -> None:
    folder = cache_dir(kind)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(data, sort_keys=True))
        tmp.replace(folder / f"{key}.json")
    except OSError:  # a read-only home is no reason to fail
        pass
