"""What every accuracy benchmark records per row, so that its labels are computed, never typed.

A row is a prediction beside the measurement it is judged against. `predicted_row` runs the prediction inside
`planner.facts.recording()`, so the row carries every fact the prediction used, and asks `planner.facts.in_sample_by`
which of them were fitted to the row or to its source ("fitted"). Its evidence label says whether anyone could have
looked at the measurement before the code scored it: a row is **first-look** when it was scored while its
measurement was not yet in the repository's last commit (a newly added published table, a lent GPU's new results),
and that first score is kept whenever the benchmark runs again; every other row is **development**
(`write_results`). Results files record the commit and date each row was scored at, in the one shape
`benchmarks/report.py` reads (benchmarks/results/<name>.json).
"""

from __future__ import annotations

import datetime
import json
import statistics
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from planner import facts
from planner.config import Config
from planner.uncertainty import ERROR_PREFIX, MARGIN_FACTS, Stratum

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DATA = ROOT / "benchmarks" / "data"
FORMAT = "trainplan-evidence-1"
FIRST_LOOK, DEVELOPMENT = "first-look", "development"


@dataclass(frozen=True)
class Row:
    """One judged prediction. `group` is the stratum a plan's error bars are drawn from (planner/uncertainty.py
    `Stratum`: program, GPU family, scale, engine, adapter, Liger, compile; `run_group` builds it) and the run's
    precision family. `program` says how the measured run trained: "trainer" for the HF Trainer's program on HF model
    code, as trainplan's files run it; "hf-loop" for HF model code in a loop of its own; "hf-forward-backward" for
    such a loop timed without its optimizer step; "optimised" for another stack's own model code; "other" for a
    program trainplan does not plan (peft's fp32 upcast of a 4-bit model). `evidence` and `scored`: the row's label
    and the commit and date of the score kept (`write_results`)."""

    id: str
    data_file: str              # the benchmarks/data file the measurement is from ("" for a results file)
    source: str                 # the measurement's source, as its data row says it
    predicted: float
    measured: float
    group: dict = field(default_factory=dict)
    facts_used: tuple[str, ...] = ()
    in_sample_by: tuple[str, ...] = ()   # the facts fitted to this row or its source (empty: none)
    note: str = ""
    evidence: str = DEVELOPMENT
    scored: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """Measured over predicted: what a prediction is multiplied by to give the measurement."""
        return self.measured / self.predicted

    @property
    def error(self) -> float:
        """Signed relative error: positive where the prediction is above the measurement."""
        return self.predicted / self.measured - 1

    @property
    def in_sample(self) -> bool:
        return bool(self.in_sample_by)

    def to_json(self) -> dict:
        return {**asdict(self), "error": self.error, "in_sample": self.in_sample,
                "source_key": facts.source_key(self.source)}


def run_group(program: str, gpu: str, cfg=None, *, gpus_per_node: int | None = None, adapter: str = "none") -> dict:
    """A row's `group`: the stratum of the measured run (a planner.config.Config `cfg` for its engine, scale, Liger and
    compile; None for one GPU without them) and its precision family (None where no configuration says)."""
    one_gpu = Config(micro_batch=1, grad_accum=1, world_size=1, precision="bf16-mixed", checkpointing="none",
                     zero_stage=0, offload="none")
    stratum = Stratum.of_config(cfg or one_gpu, gpu, gpus_per_node or (cfg.world_size if cfg else 1), adapter,
                                program)
    return {**stratum.to_json(), "precision": cfg.precision_family() if cfg else None}


def predicted_row(*, id: str, data_file: str, source: str, measured: float, predict: Callable[[], float],
                  group: dict | None = None, note: str = "", includes_margin: bool = False) -> Row:
    """The row of `predict()` against `measured`, with the facts it used and which of them were fitted to it. The
    facts that size the plan's error margin count only where the predicted quantity `includes_margin` (a plan's
    `peak`; not its peak_allocated, peak_reserved or peak_process)."""
    with facts.recording() as used:
        value = predict()
    judged = used if includes_margin else {k for k in used if k not in MARGIN_FACTS and not k.startswith(ERROR_PREFIX)}
    return Row(id=id, data_file=data_file, source=source, predicted=float(value), measured=float(measured),
               group=dict(group or {}), facts_used=tuple(sorted(judged)),
               in_sample_by=tuple(sorted(facts.in_sample_by(judged, data_file, id, source))), note=note)


def pinned_choice(model, batch: int, **fields):
    """The candidate `planner.plan` gives a configuration pinned by `fields`, or the rejected one with its estimate
    where the plan says it does not fit: what a benchmark judges against a published or measured run."""
    from planner import plan
    from planner.errors import NoFitError

    try:
        return plan(model, batch, **fields).choice
    except NoFitError as err:
        return err.plan.choice


def summary(rows: Iterable[Row]) -> dict:
    """Rows, median and worst absolute error, signed bias (median signed error), share under-predicted and the 90th
    percentile absolute error, over the rows given (None where there are none)."""
    rows = list(rows)
    if not rows:
        return {"rows": 0, "median_abs": None, "p90_abs": None, "worst_abs": None, "bias": None, "under": None}
    errors = sorted(abs(r.error) for r in rows)
    return {"rows": len(rows), "median_abs": statistics.median(errors), "p90_abs": percentile(errors, 0.9),
            "worst_abs": errors[-1], "bias": statistics.median(r.error for r in rows),
            "under": sum(r.error < 0 for r in rows) / len(rows)}


def percentile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank percentile of values already sorted."""
    rank = max(1, -(-int(q * 1000) * len(sorted_values) // 1000))
    return sorted_values[min(rank, len(sorted_values)) - 1]


#: What a benchmark's rows predict: `memory` and `throughput` rows give plans their error bars; `other` checks a part.
KINDS = ("memory", "throughput", "other")


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def committed(row: Row) -> bool:
    """Whether the row's measurement may have been seen before this scoring: it is new only where the last commit
    shows it was not there (its data file absent, or a file that names its rows by id without this one or the data
    row it is part of, "<id>/<quantity>"; or the
    results file of a GPU run not yet committed). Anything else counts as committed, and without git (a copy of the
    repository) everything does: nothing is shown first-look that might not be."""
    if _git("rev-parse", "HEAD") is None:
        return True
    if row.data_file:
        text = _git("show", f"HEAD:benchmarks/data/{row.data_file}")
        if text is None:
            return False
        if json.dumps(row.id) in text or json.dumps(row.id.split("/")[0]) in text:  # "<data row>/<what>" rows
            return True
        if '"id":' in text:
            return False
    path = row.source.split()[0].removeprefix("trainplan:") if row.source else ""
    if path.startswith("benchmarks/results/"):
        return _git("cat-file", "-e", f"HEAD:{path}") is not None
    return True


def labelled(rows: list[Row], previous: dict[str, dict]) -> list[Row]:
    """The rows with their evidence labels: a first-look row recorded before keeps its first score; a row scored now
    is first-look when its measurement is not yet committed, else development."""
    head = (_git("rev-parse", "HEAD") or "").strip() or None
    scored = {"commit": head, "date": datetime.date.today().isoformat()}
    out = []
    fields = Row.__dataclass_fields__
    for row in rows:
        before = previous.get(row.id)
        if before is not None and before.get("evidence") == FIRST_LOOK:
            out.append(Row(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in before.items() if k in fields}))
            continue
        if row.evidence == FIRST_LOOK:  # measured by the run that scored it (`run_rows`)
            out.append(Row(**{**asdict(row), "scored": row.scored or scored}))
            continue
        label = DEVELOPMENT if before is not None or committed(row) else FIRST_LOOK
        out.append(Row(**{**asdict(row), "evidence": label, "scored": scored}))
    return out


def run_rows(rows: list[Row], commit: str | None, date: str) -> list[Row]:
    """Rows a run scored before it measured them (a lent GPU's validation: the plan is made, then the step runs):
    first-look by construction, scored at `commit` (the tree the run was sent from) on `date`."""
    return [Row(**{**asdict(r), "evidence": FIRST_LOOK, "scored": {"commit": commit, "date": date}}) for r in rows]


def write_results(name: str, rows: list[Row], *, kind: str, metric: str, stack: str, cannot_show: str, command: str,
                  out: Path | None = None) -> Path:
    """benchmarks/results/<name>.json: the rows, labelled (`labelled`, against the file's previous rows), their
    summaries (all, first-look, development, fitted) and what the numbers mean. `kind` is one of KINDS."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}")
    path = out or RESULTS / f"{name}.json"
    previous = {}
    if path.exists():
        previous = {r["id"]: r for r in json.loads(path.read_text()).get("rows", [])}
    rows = labelled(rows, previous)
    record = {
        "format": FORMAT, "benchmark": name, "kind": kind, "metric": metric, "stack": stack,
        "cannot_show": cannot_show, "command": command,
        "summary": {"all": summary(rows), "first_look": summary(r for r in rows if r.evidence == FIRST_LOOK),
                    "development": summary(r for r in rows if r.evidence == DEVELOPMENT),
                    "fitted": summary(r for r in rows if r.in_sample)},
        "rows": [r.to_json() for r in rows],
    }
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return path
