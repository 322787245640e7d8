"""Bundled model presets: official `config.json` contents with their source and published size.

One JSON file per model in `catalog/`, named after the hub id (`org--name.json`). Looked up by hub id
or alias, case-insensitively.
"""

from __future__ import annotations

import difflib
import json
import re
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


#: A fine-tuned variant's suffix (instruction or chat tuning, a version): the variant keeps its base's architecture
#: and sizes (Llama-3.1-8B-Instruct's config.json differs from Llama-3.1-8B's in no field a plan reads).
VARIANT = re.compile(r"[-_](?:instruct|chat|it)(?:[-_]v?\d+(?:\.\d+)*)?(?=(?:-hf)?$)", re.IGNORECASE)


def find_variant(name: str) -> Preset | None:
    """The preset a fine-tuned variant's name stands on (`VARIANT`), or None."""
    base = VARIANT.sub("", name.strip())
    return find_preset(base) if base != name.strip() else None


def close_names(name: str, count: int = 3) -> list[str]:
    """The presets (ids) whose id or an alias is spelled close to `name` (a typo's likely meaning)."""
    names = {n.lower(): p.id for p in presets() for n in (p.id, *p.aliases, p.id.split("/")[-1])}
    found = difflib.get_close_matches(name.strip().lower(), list(names), n=3 * count, cutoff=0.75)
    return list(dict.fromkeys(names[n] for n in found))[:count]

