"""What receipts of earlier runs teach the next plan, and what they may not.

A receipt re-times only candidates like the run it records: the same model, sequence length, adapter, precision
family and number of GPUs, planned for this GPU and measured on it (the device's name is checked against the catalog;
a receipt that names no device is taken as run where it was planned, and the plan says so). Its ratio is the
measured step time over what the speed model predicts today for the very configuration that ran, and a candidate is
re-timed from the model's own step time: two receipts of one truth, the second planned with the first's calibration,
both say that truth, so repeated runs converge on it. Memory is corrected per configuration family the same way
(measured peaks against today's model of the configuration that ran: planner/refine.py `family_calibrations`).
Receipts of other runs on this GPU (other models, sequences, adapters, GPU counts) change nothing and are counted in
a note; so are those made on another device, CPU trials and receipts that are not believable (planner/receipts).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from planner.config import Config
from planner.notes import Note, note
from planner.receipts import Receipt, Skipped
from planner.refine import family_calibrations, recalibrated_memory
from planner.types import Candidate, FamilyCalibration, SpeedCalibration

#: Why a receipt did not re-time this plan (the skipped note counts them by these).
ANOTHER_DEVICE, CPU_TRIAL, ANOTHER_GPU, UNREADABLE, NOTHING = (
    "measured on another GPU than planned", "a CPU trial", "planned for another GPU", "not a believable receipt",
    "measured neither a step nor a peak")


@dataclass(frozen=True)
class Workload:
    """What a plan is of, as receipts are matched to it: the catalog GPU, the model's name, sequence, adapter and the
    GPUs of a run; and today's model of a configuration (its memory estimate and its speed)."""

    gpu: str
    model: str
    seq_len: int
    adapter: str
    world_size: int
    estimate: Callable
    speed: Callable


@dataclass(frozen=True)
class Lessons:
    """What the receipts gave: the speed calibration per precision family and the memory calibration per configuration
    family from the runs like this plan, the receipts of other runs on this GPU (used for nothing), why the others
    were skipped, and the runs whose device was not named."""

    like: tuple[Receipt, ...] = ()
    speeds: dict[str, SpeedCalibration] = field(default_factory=dict)
    memory: dict[tuple, FamilyCalibration] = field(default_factory=dict)
    unlike: int = 0
    skipped: Counter = field(default_factory=Counter)
    unnamed: int = 0

    @property
    def changes_anything(self) -> bool:
        return bool(self.speeds or self.memory)


def _sorted(receipt: Receipt, work: Workload) -> str | None:
    """Where a readable receipt goes: None (a run like the plan's), "unlike" (another run on this GPU), or why it
    is skipped."""
    device, plan, measured = receipt.device, receipt.plan, receipt.measured
    if device.kind != "cuda":
        return CPU_TRIAL
    if not (measured.step_time_s or measured.peak_allocated or measured.peak_reserved):
        return NOTHING
    if plan.hardware.gpu != work.gpu:
        return ANOTHER_GPU
    if device.gpu != work.gpu and (device.gpu is not None or device.name is not None):
        return ANOTHER_DEVICE
    like = (plan.model, plan.seq_len, plan.adapter, plan.choice.world_size) == (
        work.model, work.seq_len, work.adapter, work.world_size)
    return None if like else "unlike"


def learn(receipts: list[Receipt], unreadable: list[Skipped], work: Workload) -> Lessons:
    """The lessons of `receipts` for a plan of `work` (`unreadable`: the files that were not receipts)."""
    like, unlike, skipped = [], 0, Counter({UNREADABLE: len(unreadable)} if unreadable else {})
    for receipt in receipts:
        where = _sorted(receipt, work)
        if where is None:
            like.append(receipt)
        elif where == "unlike":
            unlike += 1
        else:
            skipped[where] += 1
    unnamed = sum(r.device.gpu is None and r.device.name is None for r in like)
    return Lessons(like=tuple(like), speeds=_speeds(like, work.speed), memory=_memory(like, work.estimate),
                   unlike=unlike, skipped=skipped, unnamed=unnamed)


def _speeds(like: list[Receipt], speed: Callable) -> dict[str, SpeedCalibration]:
    """Per precision family, the median of measured step time over today's model of each run's configuration."""
    ratios: dict[str, list[float]] = {}
    for receipt in like:
        measured = receipt.measured.step_time_s
        if measured is None:
            continue
        cfg = receipt.plan.choice
        modelled = speed(cfg).modelled_step_time_s
        if modelled > 0:
            ratios.setdefault(cfg.precision_family(), []).append(measured / modelled)
    return {family: SpeedCalibration(micro_step=statistics.median(r), optimizer_step=statistics.median(r),
                                     probes=len(r), precision=family, source="receipts", low=min(r), high=max(r))
            for family, r in ratios.items()}


def _memory(like: list[Receipt], estimate: Callable) -> dict[tuple, FamilyCalibration]:
    """Per configuration family, the runs' measured peaks against today's model of the configuration each ran."""
    runs = [(r.plan.choice, estimate(r.plan.choice), r.measured.peak_allocated, r.measured.peak_reserved,
             r.measured.peak_process) for r in like if r.measured.peak_allocated and r.measured.peak_reserved]
    return family_calibrations(runs)


def retimed(cand: Candidate, speeds: dict[str, SpeedCalibration]) -> Candidate:
    """A candidate re-timed from the speed model's own step time by its precision family's receipts (as it was where
    none measured its family, or where it was measured itself)."""
    speed, tp = speeds.get(cand.config.precision_family()), cand.throughput
    if speed is None or tp is None or tp.source not in ("model", "corrected"):
        return cand
    return cand.model_copy(update={"throughput": tp.corrected(tp.modelled_step_time_s * speed.micro_step,
                                                              source="receipts")})


def applied(ranked: list[Candidate], lessons: Lessons, budget: int, rank: Callable) -> list[Candidate]:
    """The candidates with what the receipts measured applied (speed per precision family, memory per configuration
    family), the fitting ones ranked again."""
    if not lessons.changes_anything:
        return ranked
    updated = [retimed(recalibrated_memory(c, lessons.memory, budget), lessons.speeds) for c in ranked]
    return rank([c for c in updated if c.fits]) + [c for c in updated if not c.fits]


def notes(before: Candidate, after: Candidate, lessons: Lessons) -> tuple[Note, ...]:
    """What the receipts changed in this plan (the chosen family's calibrations, and the choice itself where they
    changed it), and one line for every receipt that taught it nothing."""
    out = []
    speed = lessons.speeds.get(after.config.precision_family())
    if speed is not None:
        out.append(note("receipts", runs=speed.probes, precision=speed.precision, ratio=speed.micro_step,
                        low=speed.low, high=speed.high))
    calib = lessons.memory.get(after.config.family())
    if calib is not None:
        out.append(note("receipts-memory", runs=calib.runs, family=Config.family_text(after.config.family()),
                        activation_ratio=calib.activation_ratio, slack=calib.allocator_slack))
    if before.config != after.config:
        out.append(note("receipts-choice", before=before.config.label(), after=after.config.label()))
    if lessons.unnamed:
        out.append(note("receipts-unnamed", runs=lessons.unnamed))
    if lessons.unlike or lessons.skipped:
        reasons = "; ".join(f"{n} {why}" for why, n in sorted(lessons.skipped.items()))
        out.append(note("receipts-unused", unlike=lessons.unlike, skipped=sum(lessons.skipped.values()),
                        reasons=reasons))
    return tuple(out)


__all__ = ["Lessons", "Workload", "applied", "learn", "notes", "retimed"]
