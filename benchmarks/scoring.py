"""Every receipt scored: its one memory figure and its step time, against the prediction made before the run and
against today's planner, with its evidence label and stratum; and what the scores give: summaries, the error bars
plans draw (per stratum, counted in runs), the memory margin's coverage (leave one run out) and ranking agreement.
benchmarks/report.py writes them down.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

from benchmarks import rescore, runs
from benchmarks.provenance import FIRST_LOOK, History, Label, labels
from planner import facts
from planner.hardware import efficiency_data  # noqa: F401 - registers efficiency.json's facts, which predictions read
from planner.receipts import STEP_TIME, Prediction, Receipt
from planner.uncertainty import (
    ERROR_PREFIX, MARGIN_COVERAGE, MARGIN_FACTS, MIN_RUNS, P90_RUNS, Spread, Stratum, quantile,
)

KINDS = ("memory", "throughput")
#: A program whose runs never stand for a plan's: peft's fp32 upcast of a 4-bit model, say (`vocab.PROGRAM`).
NOT_PLANNED = "other"


@dataclass(frozen=True)
class Figure:
    """One run's figure of one kind: the quantity, what was measured, what was predicted before the run and what
    today's planner predicts (None: no prediction), and the facts fitted to the run that the prediction read."""

    quantity: str
    measured: float
    then: float | None
    today: float | None
    fitted: tuple[str, ...] = ()

    @property
    def error_then(self) -> float | None:
        return self.then / self.measured - 1 if self.then else None

    @property
    def error_today(self) -> float | None:
        return self.today / self.measured - 1 if self.today else None

    @property
    def ratio_today(self) -> float | None:
        """Measured over today's prediction: what an error bar is made of."""
        return self.measured / self.today if self.today else None


@dataclass(frozen=True)
class Run:
    """A receipt scored: its benchmark, label, stratum and its figures by kind."""

    benchmark: str
    receipt: Receipt
    label: Label
    stratum: Stratum
    figures: dict[str, Figure]
    activations_today: float | None = None

    @property
    def first_look(self) -> bool:
        return self.label.first_look

    @property
    def key(self) -> str:
        """As benchmarks/rescore.py keys it: "<benchmark>/<receipt id>"."""
        return f"{self.benchmark}/{self.receipt.id}"

    def figure(self, kind: str) -> Figure | None:
        return self.figures.get(kind)


def _fitted(prediction: Prediction | None, receipt: Receipt, kind: str) -> tuple[str, ...]:
    """The facts the prediction of the figure of `kind` read that were fitted to the run (all the prediction read
    where it did not record them by figure; the margin's and the error bars' facts count for no figure here: no
    predicted peak holds them)."""
    if prediction is None:
        return ()
    read = prediction.figure_facts.get(kind, prediction.facts)
    used = [k for k in read if k not in MARGIN_FACTS and not k.startswith(ERROR_PREFIX)]
    return tuple(facts.in_sample_by(used, Path(receipt.data_file).name, receipt.id, receipt.source))


def figures_of(receipt: Receipt, today: Prediction | None) -> dict[str, Figure]:
    """The run's memory figure (the first of process, reserved, allocated it measured that a prediction holds: the
    one the budget is checked against first) and its step time."""
    out = {}
    then = receipt.predicted.model
    quantity = receipt.memory_figure(then) or (receipt.memory_figure(today.model) if today else None)
    if quantity:
        out["memory"] = Figure(quantity, receipt.measured.get(quantity), then.get(quantity),
                               today.model.get(quantity) if today else None, _fitted(today, receipt, "memory"))
    if receipt.measured.step_time_s:
        out["throughput"] = Figure(STEP_TIME, receipt.measured.step_time_s, then.step_time_s,
                                   today.model.step_time_s if today else None, _fitted(today, receipt, "throughput"))
    return out


def stratum_of(receipt: Receipt) -> Stratum:
    plan = receipt.plan
    return Stratum.of_config(plan.choice, receipt.device.gpu or plan.hardware.gpu, plan.hardware.gpus_per_node,
                             plan.adapter, plan.program)


def scored(benchmarks: list[runs.Benchmark], rescored: dict, history: History | None = None) -> list[Run]:
    """Every receipt of `benchmarks` scored, with today's predictions from `rescored` and its label
    (benchmarks/provenance.py `labels`)."""
    found = {rescore.key(bench, r): (r, bench.path) for bench in benchmarks for r in bench.receipts}
    labelled = labels(found, history or History())
    out = []
    for bench in benchmarks:
        for receipt in bench.receipts:
            today = rescore.today(rescored, bench, receipt)
            out.append(Run(bench.name, receipt, labelled[rescore.key(bench, receipt)], stratum_of(receipt),
                           figures_of(receipt, today), today.model.activations if today else None))
    return out


# --- summaries ------------------------------------------------------------------------------------------------------
def summary(errors: Iterable[float]) -> dict:
    """Runs, median and 90th-percentile and worst absolute error, the median signed error (bias) and the share
    predicted under the measurement."""
    errors = [e for e in errors if e is not None]
    if not errors:
        return {"runs": 0, "median_abs": None, "p90_abs": None, "worst_abs": None, "bias": None, "under": None}
    absolute = sorted(abs(e) for e in errors)
    return {"runs": len(errors), "median_abs": statistics.median(absolute), "p90_abs": quantile(absolute, 0.9),
            "worst_abs": absolute[-1], "bias": statistics.median(errors), "under": sum(e < 0 for e in errors)
            / len(errors)}


def figures(runs_: Iterable[Run], kind: str) -> list[tuple[Run, Figure]]:
    return [(r, f) for r in runs_ if (f := r.figure(kind)) is not None]


# --- error bars -----------------------------------------------------------------------------------------------------
def bar_runs(runs_: list[Run], kind: str) -> list[tuple[Run, Figure]]:
    """The runs an error bar of `kind` is drawn from: predicted today, no fact read for it fitted to it, and a
    program a plan runs."""
    return [(r, f) for r, f in figures(runs_, kind)
            if f.today and not f.fitted and r.receipt.plan.program != NOT_PLANNED]


def strata(members: list[tuple[Run, Figure]]) -> dict[Stratum, list[tuple[Run, Figure]]]:
    """The runs by every stratum up each run's ladder (planner/uncertainty.py)."""
    found: dict[Stratum, list] = defaultdict(list)
    for run, figure in members:
        for stratum, _ in run.stratum.ladder():
            found[stratum].append((run, figure))
    return found


def spread(members: list[tuple[Run, Figure]]) -> Spread:
    return Spread.of([f.ratio_today for _, f in members], first_look=sum(r.first_look for r, _ in members))


def error_facts(runs_: list[Run]) -> dict:
    """The error bars as planner facts: per kind and stratum with at least MIN_RUNS runs, the spread of measured /
    today's prediction and the benchmarks it comes from."""
    out = {}
    for kind in KINDS:
        for stratum, members in sorted(strata(bar_runs(runs_, kind)).items(), key=lambda kv: kv[0].key):
            if len(members) < MIN_RUNS:
                continue
            value = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in vars(spread(members)).items()}
            sources = sorted({r.benchmark for r, _ in members})
            out[f"{ERROR_PREFIX}{kind}:{stratum.key}"] = {
                "value": value, "unit": "measured / predicted, one per run", "measured_on": None, "fitted_to": [],
                "source": f"benchmarks/report.py over the runs of {', '.join(sources)} no fact was fitted to, each "
                          f"predicted by today's planner (stratum {stratum.key})"}
    return out


# --- the memory margin, leave one run out --------------------------------------------------------------------------
@dataclass(frozen=True)
class Coverage:
    """How the margin a plan of this stratum holds covered its runs, each held out: the runs, those covered, and
    how the margins were sized (by the other runs' 95th percentile, or by the activation margin)."""

    stratum: Stratum
    runs: int
    covered: int
    by_runs: int

    @property
    def share(self) -> float:
        return self.covered / self.runs if self.runs else 0.0


def held_out_margin(others: list[float], activations: float | None, predicted: float) -> tuple[float, bool]:
    """The margin (bytes) a plan would hold without the held-out run: the others' MARGIN_COVERAGE quantile of measured
    / predicted where P90_RUNS say so (planner/uncertainty.py `margin_for`), else the activation margin; and whether
    it was sized by runs."""
    if len(others) >= P90_RUNS:
        return predicted * max(0.0, quantile(sorted(others), MARGIN_COVERAGE) - 1), True
    return facts.get("memory.activation_margin") * (activations or 0.0), False


def coverage(runs_: list[Run]) -> list[Coverage]:
    """Per stratum with MIN_RUNS runs or more (a plan's margin stratum), each run held out in turn (all its figures
    out: a run has one memory figure): whether the margin the other runs give covers its measured peak."""
    out = []
    for stratum, members in strata(bar_runs(runs_, "memory")).items():
        if len(members) < MIN_RUNS:
            continue
        covered = by_runs = 0
        for i, (run, figure) in enumerate(members):
            others = [f.ratio_today for j, (_, f) in enumerate(members) if j != i]
            margin, sized = held_out_margin(others, run.activations_today, figure.today)
            covered += figure.measured <= figure.today + margin
            by_runs += sized
        out.append(Coverage(stratum, len(members), covered, by_runs))
    return sorted(out, key=lambda c: (c.stratum.key.count("*"), -c.runs, c.stratum.key))


# --- ranking --------------------------------------------------------------------------------------------------------
def kendall_tau(predicted: list[float], measured: list[float]) -> float | None:
    """Kendall's tau-b between two orderings of the same items (None for fewer than 2 items or no untied pair)."""
    concordant = discordant = ties_p = ties_m = 0
    for (p1, m1), (p2, m2) in combinations(zip(predicted, measured), 2):
        dp, dm = p1 - p2, m1 - m2
        if dp == 0 and dm == 0:
            continue
        if dp == 0:
            ties_p += 1
        elif dm == 0:
            ties_m += 1
        elif (dp > 0) == (dm > 0):
            concordant += 1
        else:
            discordant += 1
    denominator = math.sqrt((concordant + discordant + ties_p) * (concordant + discordant + ties_m))
    return (concordant - discordant) / denominator if denominator else None


def rankings(runs_: list[Run], benchmarks: Iterable[str], by_job: bool = False) -> list[dict]:
    """Per benchmark of `benchmarks` and model (`by_job`: and sequence and global batch, the configurations one plan
    ranks): Kendall's tau between today's predicted and the measured tokens per second of its runs (the planner's
    order of the configurations against the measured order), for groups of 3 runs or more."""
    groups: dict[tuple, list[Run]] = defaultdict(list)
    for run in runs_:
        if run.benchmark in benchmarks and run.figure("throughput") and run.figure("throughput").today:
            plan = run.receipt.plan
            job = (plan.seq_len, plan.choice.global_batch) if by_job else ()
            groups[(run.benchmark, plan.model, *job)].append(run)
    out = []
    for (bench, model, *job), members in sorted(groups.items()):
        if len(members) < 3:
            continue
        tokens = [r.receipt.plan.choice.global_batch * r.receipt.plan.seq_len for r in members]
        predicted = [t / r.figure("throughput").today for t, r in zip(tokens, members)]
        measured = [t / r.figure("throughput").measured for t, r in zip(tokens, members)]
        out.append({"benchmark": bench, "model": model, "job": tuple(job), "runs": len(members),
                    "tau": kendall_tau(predicted, measured), "first_look": sum(r.first_look for r in members)})
    return out


__all__ = ["Coverage", "FIRST_LOOK", "Figure", "KINDS", "Run", "bar_runs", "coverage", "error_facts", "figures",
           "kendall_tau", "rankings", "scored", "spread", "strata", "summary"]
