"""Writing a file so that a reader never sees half of it: a temporary file in the same folder, then a rename; and
YAML as the cluster jobs are written (emit/kubernetes.py, emit/skypilot.py)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import yaml


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (a node's script, the run folder's files) as YAML literal blocks, readable as they run."""


_BlockDumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def yaml_text(document: dict) -> str:
    """A document as YAML: sorted keys, literal blocks; yaml.safe_load reads back the same values."""
    return yaml.dump(document, Dumper=_BlockDumper, sort_keys=True, default_flow_style=False, width=120)


def atomic_write(path: Path, text: str, executable: bool = False) -> None:
    """Write `text` to `path` atomically (mode 755 where `executable`)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o755 if executable else 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
