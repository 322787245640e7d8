"""A benchmark's rows traced with the transformers release they were measured with.

Published measurements ran older transformers releases, whose model code can keep different tensors from the
installed one's (GPT-NeoX 4.42.4 caches fp32 keys; the causal-LM loss of 4.4x copies the shifted fp32 logits). A
benchmark that knows a row's release predicts it twice: with the installed code, and with that release, installed once
from the package index into trainplan's cache ($TRAINPLAN_CACHE/transformers-releases) and imported first by a
subprocess that runs the same benchmark in its worker mode (`--worker ROW_ID ...`), so the planner traces the very
model code the row measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from planner.cache import cache_dir

REPO = Path(__file__).resolve().parents[1]
#: where the measured transformers releases are installed: trainplan's cache (planner/cache.py), not the repository
RELEASES_DIR = cache_dir("transformers-releases")


def install_release(release: str) -> Path:
    """transformers `release` and the dependencies it pins, installed once under RELEASES_DIR (pip, no shell)."""
    target = RELEASES_DIR / f"transformers-{release}"
    done = target / ".complete"
    if not done.exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        "--no-compile", "--target", str(target), "--upgrade", f"transformers=={release}"],
                       check=True, capture_output=True, text=True, timeout=900)
        done.write_text(release + "\n")
    return target


def run_worker(script: Path, ids: list[str], release: str) -> dict:
    """`script --worker ids...` in a subprocess that imports transformers `release` first: the JSON object its last
    line of output holds."""
    target = install_release(release)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(REPO)]), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run([sys.executable, str(script), "--worker", *ids], check=True, capture_output=True,
                          text=True, env=env, cwd=str(REPO), timeout=3600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def traced_with_releases(script: Path, ids_by_release: dict[str, list[str]]) -> tuple[dict[str, dict], list[str]]:
    """Each row's worker result (`script --worker`) with its release, for the rows that release traced; and one line
    for each release or row it could not (a row the formulas predicted is no test of the release's code)."""
    found, failed = {}, []
    for release, ids in sorted(ids_by_release.items()):
        try:
            got = run_worker(script, ids, release)
        except (subprocess.SubprocessError, OSError, ValueError) as err:
            detail = (getattr(err, "stderr", "") or str(err)).strip()
            failed.append(f"transformers {release}: {detail.splitlines()[-1] if detail else err}")
            continue
        for row_id in ids:
            if got[row_id]["method"] == "trace":
                found[row_id] = got[row_id]
            else:
                failed.append(f"transformers {release}: {row_id} could not be traced with it "
                              f"({got[row_id].get('why', 'formulas instead')})")
    return found, failed
