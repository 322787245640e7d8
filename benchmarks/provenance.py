"""Evidence labels, computed from git alone: a receipt is **first-look** when the commit that predicted it precedes
the commit that added its measurement, and no fact's `fitted_to` names it; every other receipt is **development**.

A fact fitted to a run after its prediction was made does not unmake the first look (the planner that predicted it
did not have it): the facts read are those of the predicting commit. The commit that predicted a receipt is the
earliest commit whose planner/ folder is the tree its prediction records
(planner/receipts/source.py: the git tree hash of the planner that ran, which a machine without git computes alike);
a prediction made with uncommitted changes names no commit and is development. The commit that added its measurement
is the first commit in which the file it was first written to (`Receipt.data_file`: a benchmarks/data table, a
results file; else its receipts file) holds its id. A receipt not committed yet counts as added by the next commit.
The labels a report computed are kept in benchmarks/results/labels.json: where the history is not whole (a shallow
clone, a copy without git) they are read from there, a receipt it does not name being development.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from planner import facts
from planner.receipts import Receipt

ROOT = Path(__file__).resolve().parents[1]
LABELS = ROOT / "benchmarks" / "results" / "labels.json"
#: Where a planner keeps the facts whose `fitted_to` name what they were fitted to.
FACTS, EFFICIENCY = "planner/facts", "planner/hardware/efficiency.json"
FIRST_LOOK, DEVELOPMENT = "first-look", "development"
PENDING = "not committed yet"


def git(*args: str, stdin: str | None = None, root: Path = ROOT) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=60, check=False,
                              input=stdin)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


@dataclass(frozen=True)
class Label:
    """A receipt's evidence label and why: the commit that predicted it, the commit that added its measurement
    (PENDING: not committed yet) and the facts fitted to it."""

    evidence: str
    predicted_at: str | None
    measured_at: str | None
    fitted_by: tuple[str, ...] = ()

    @property
    def first_look(self) -> bool:
        return self.evidence == FIRST_LOOK


class History:
    """What git knows of the repository at `root`, read once: each commit's planner tree, and when each file first
    held each id."""

    def __init__(self, root: Path = ROOT):
        self.root = root
        self._added: dict[str, list[tuple[str, str]]] = {}
        self._fitted: dict[str, frozenset[str]] = {}

    def git(self, *args: str, stdin: str | None = None) -> str | None:
        return git(*args, stdin=stdin, root=self.root)

    @cached_property
    def complete(self) -> bool:
        """Whether the whole history is here (a git repository, not a shallow clone)."""
        return bool(self.commits) and (self.git("rev-parse", "--is-shallow-repository") or "").strip() == "false"

    @cached_property
    def commits(self) -> list[str]:
        """Every commit of HEAD's history, oldest first (empty without git)."""
        return (self.git("rev-list", "--reverse", "HEAD") or "").split()

    @cached_property
    def trees(self) -> dict[str, str]:
        """Planner tree -> the earliest commit whose planner/ is it."""
        found = self.git("cat-file", "--batch-check", stdin="".join(f"{c}:planner\n" for c in self.commits)) or ""
        earliest: dict[str, str] = {}
        for commit, line in zip(self.commits, found.splitlines()):
            tree = line.split()[0]
            if line.endswith("missing"):
                continue
            earliest.setdefault(tree, commit)
        return earliest

    @cached_property
    def order(self) -> dict[str, int]:
        return {commit: i for i, commit in enumerate(self.commits)}

    def file_versions(self, path: str) -> list[tuple[str, str]]:
        """(commit, the file's text) for every commit that changed `path`, oldest first."""
        if path not in self._added:
            commits = (self.git("log", "--reverse", "--format=%H", "--", path) or "").split()
            self._added[path] = [(c, self.git("show", f"{c}:{path}") or "") for c in commits]
        return self._added[path]

    def first_holding(self, path: str, row_id: str) -> str | None:
        """The first commit in which `path` held `row_id` (as a JSON string; a file of rows without ids: the commit
        that added the file), None where no commit did."""
        needle = json.dumps(row_id)
        for commit, text in self.file_versions(path):
            if needle in text or ('"id":' not in text and text):
                return commit
        return None

    def fitted_to(self, commit: str) -> frozenset[str]:
        """Everything the facts of `commit`'s planner were fitted to: every `fitted_to` in its facts files and its
        efficiency.json."""
        if commit not in self._fitted:
            listed = (self.git("ls-tree", "--name-only", commit, f"{FACTS}/") or "").split()
            paths = [p for p in listed if p.endswith(".json")] + [EFFICIENCY]
            found: set[str] = set()
            for path in paths:
                text = self.git("show", f"{commit}:{path}")
                if text:
                    found |= _fitted_to(json.loads(text))
            self._fitted[commit] = frozenset(found)
        return self._fitted[commit]

    def precedes(self, earlier: str, later: str | None) -> bool:
        """`earlier` is an ancestor of `later` and not `later` itself (None: the next commit, which HEAD's whole
        history precedes)."""
        if later is None:
            return earlier in self.order
        return earlier != later and self.git("merge-base", "--is-ancestor", earlier, later) is not None


def _fitted_to(node) -> set[str]:
    """Every name listed under a "fitted_to" key anywhere in a JSON value."""
    found: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            found |= set(value) if key == "fitted_to" and isinstance(value, list) else _fitted_to(value)
    elif isinstance(node, list):
        for value in node:
            found |= _fitted_to(value)
    return found


def names_of(receipt: Receipt) -> set[str]:
    """How a fact's `fitted_to` would name the receipt: its row, every row of its data file, or its source."""
    file_name = Path(receipt.data_file).name if receipt.data_file else ""
    rows = {facts.row_name(file_name, "*"), facts.row_name(file_name, receipt.id)} if file_name else set()
    return {facts.source_key(receipt.source)} | rows


def label(receipt: Receipt, receipts_file: str, history: History) -> Label:
    """The receipt's label: first-look iff its predicting commit precedes the commit that added its measurement and
    no fact of the planner that predicted it was fitted to it. `receipts_file`: the repository path of the file that
    holds it."""
    predicted_at = history.trees.get(receipt.predicted.tree or "")
    fitted = tuple(sorted(names_of(receipt) & history.fitted_to(predicted_at))) if predicted_at else ()
    first_file = receipt.data_file or receipts_file
    measured_at = history.first_holding(first_file, receipt.id)
    if measured_at is None and receipt.data_file:  # its table is not committed yet: the receipts file decides
        measured_at = history.first_holding(receipts_file, receipt.id)
    first = bool(predicted_at) and not fitted and history.precedes(predicted_at, measured_at)
    return Label(evidence=FIRST_LOOK if first else DEVELOPMENT, predicted_at=predicted_at,
                 measured_at=measured_at or PENDING, fitted_by=fitted)


def labels(found: dict[str, tuple], history: History, kept: Path = LABELS) -> dict[str, Label]:
    """The label of each receipt of `found` (key -> (receipt, the path of its receipts file)): computed from git where
    the history is whole, else as the report last computed them (`kept`)."""
    if history.complete:
        return {key: label(receipt, path, history) for key, (receipt, path) in found.items()}
    recorded = json.loads(kept.read_text()) if kept.exists() else {}
    development = Label(evidence=DEVELOPMENT, predicted_at=None, measured_at=None)
    return {key: Label(**{**recorded[key], "fitted_by": tuple(recorded[key]["fitted_by"])}) if key in recorded
            else development for key in found}


def labels_json(found: dict[str, Label]) -> str:
    return json.dumps({key: vars(value) for key, value in sorted(found.items())}, indent=1, sort_keys=True) + "\n"


__all__ = ["DEVELOPMENT", "FIRST_LOOK", "History", "LABELS", "Label", "PENDING", "git", "label", "labels",
           "labels_json"]
