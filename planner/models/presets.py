"""Bundled model presets: official `config.json` contents with their source and published size.

One JSON file per model in `catalog/`, named after the hub id (`org--name.json`). Looked up by hub id
or alias, case-insensitively.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

from pydantic import BaseModel, ConfigDict


class Preset(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str
    aliases: tuple[str, ...] = ()
    source: str
    published_parameters: int
    published_parameters_exact: bool = True
    parameters_source: str
    config: dict


@lru_cache(maxsize=1)
def presets() -> tuple[Preset, ...]:
    folder = resources.files("planner.models").joinpath("catalog")
    found = [
        Preset.model_validate(json.loads(f.read_text()))
        for f in sorted(folder.iterdir(), key=lambda p: p.name)
        if f.name.endswith(".json")
    ]
    return tuple(found)


def find_preset(name: str) -> Preset | None:
    key = name.strip().lower()
    for p in presets():
        if key == p.id.lower() or key in (a.lower() for a in p.aliases):
            return p
    # "bloom-560m" also matches "bigscience/bloom-560m" through the part after the org
    tail = [p for p in presets() if key == p.id.lower().split("/")[-1]]
    return tail[0] if len(tail) == 1 else None
