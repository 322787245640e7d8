"""Reading receipts back: the cache's (where runs write them) and those under `--receipts PATH` (a team's runs). Each
file is parsed by the receipt's pydantic model (planner/receipts/schema.py); one that is not a believable receipt
(malformed JSON, a wrong type, NaN, infinity, zero or a negative figure, a measurement off its prediction by more
than RATIO_RANGE, a run that failed) is skipped and named, never raised. JSON only: nothing is executed."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from planner.cache import cache_dir
from planner.errors import InputError
from planner.receipts.meter import CACHE_KIND
from planner.receipts.schema import Receipt, parse


@dataclass(frozen=True)
class Skipped:
    """A file that was not read as a receipt, and why."""

    file: str
    why: str


def receipt_files(paths: list[str | os.PathLike] | None = None, cache: bool = True) -> list[Path]:
    """The files to read: each of `paths` (a receipt.json, or a folder searched for *.json), then the cache's."""
    files: list[Path] = []
    for path in paths or []:
        path = Path(path).expanduser()
        if not path.exists():
            raise InputError(f"{path} does not exist", flag="--receipts",
                             hint="Name a receipt.json or a folder of them (a team's runs).")
        files += sorted(path.rglob("*.json")) if path.is_dir() else [path]
    if cache and cache_dir(CACHE_KIND).is_dir():
        files += sorted(cache_dir(CACHE_KIND).glob("*.json"))
    return files


def read_receipts(paths: list[str | os.PathLike] | None = None, cache: bool = True
                  ) -> tuple[list[Receipt], list[Skipped]]:
    """The receipts in the cache (where `cache`) and under each of `paths`, each read once (a copy of one receipt in
    two places counts once); and each file skipped, with why."""
    receipts: dict[str, Receipt] = {}
    skipped = []
    for file in receipt_files(paths, cache):
        try:
            receipt = parse(json.loads(file.read_text()))
        except (OSError, ValueError, RecursionError) as err:
            skipped.append(Skipped(file.name, _short(err)))
            continue
        key = json.dumps(receipt.to_json(), sort_keys=True) if receipt.id.startswith("schema-1") else receipt.id
        receipts.setdefault(key, receipt)
    return list(receipts.values()), skipped


def _short(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    return text if len(text) <= 120 else text[:117] + "..."


__all__ = ["Skipped", "read_receipts", "receipt_files"]
