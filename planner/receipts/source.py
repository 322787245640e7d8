"""Which planner made a prediction: the git tree hash of the planner/ folder that ran, computed from its files as
`git write-tree` would (git's object format: a blob is sha1("blob <size>\\0" + content), a tree sha1 of its entries
"<mode> <name>\\0<20-byte id>" sorted by name, a folder's name sorted as if it ended in "/"). A machine without git
(a lent GPU's copy of the repository, an installed package) computes it alike; `git rev-parse <commit>:planner` is the
same hash exactly when that commit's planner/ holds the same files, so a receipt names the commit that predicted it
(benchmarks/evidence.py) and a tree with uncommitted changes names none."""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from importlib import metadata
from pathlib import Path

PLANNER = Path(__file__).resolve().parents[1]
#: what git never stores of a planner/ folder here (.gitignore): bytecode
IGNORED_DIRS = frozenset({"__pycache__"})
IGNORED_SUFFIXES = (".pyc", ".pyo")


def _object(kind: bytes, body: bytes) -> bytes:
    return hashlib.sha1(kind + b" " + str(len(body)).encode() + b"\0" + body).digest()  # noqa: S324 - git's id


def tree_hash(folder: Path, leave_out: frozenset[str] = frozenset()) -> str | None:
    """The git tree id of `folder`'s files, less those at the paths `leave_out` names relative to it (None: an empty
    folder, which git does not store)."""
    found = _tree(Path(folder), Path(folder), leave_out)
    return found.hex() if found else None


def _tree(folder: Path, top: Path, leave_out: frozenset[str]) -> bytes | None:
    entries = []
    for entry in os.scandir(folder):
        if Path(entry.path).relative_to(top).as_posix() in leave_out:
            continue
        if entry.is_dir(follow_symlinks=False):
            if entry.name in IGNORED_DIRS:
                continue
            child = _tree(Path(entry.path), top, leave_out)
            if child:
                entries.append((entry.name + "/", b"40000 " + entry.name.encode() + b"\0" + child))
        elif entry.is_file(follow_symlinks=False) and not entry.name.endswith(IGNORED_SUFFIXES):
            mode = b"100755" if os.access(entry.path, os.X_OK) else b"100644"
            blob = _object(b"blob", Path(entry.path).read_bytes())
            entries.append((entry.name, mode + b" " + entry.name.encode() + b"\0" + blob))
    if not entries:
        return None
    return _object(b"tree", b"".join(body for _, body in sorted(entries, key=lambda e: e[0].encode())))


@lru_cache(maxsize=1)
def planner_version() -> str | None:
    """The installed trainplan's version (None: run from a copy that is not installed)."""
    try:
        return metadata.version("trainplan")
    except metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=1)
def planner_tree() -> str | None:
    """The tree hash of the planner that is running (read once per process)."""
    return tree_hash(PLANNER)


__all__ = ["planner_tree", "planner_version", "tree_hash"]
