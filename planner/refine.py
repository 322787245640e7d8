"""Guided refinement with measurements: confirm the model's choice with few probes, calibrate, re-rank.

`measure(context, config, timeout_s) -> Measurement` is supplied by the caller (the CLI passes probes.Prober).
Per family (`Config.family()`: the configuration apart from its micro-batch split) we start at the model's largest
fitting micro-batch and move down on OOM, up when the calibrated model says the next one fits: at most
`MAX_PROBES_PER_FAMILY` probes, where power-of-two or binary-search finders need 8-25 trials. The best measured
candidate wins. The probe budget is a hard limit: each probe gets at most the time left, and is stopped there.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from planner.config import Config
from planner.notes import Verdict, note
from planner.speed.step import StepParts
from planner.types import Candidate, FamilyCalibration, Measurement, ProbeRecord, SpeedCalibration
from planner.uncertainty import NO_MARGIN
from planner.vocab import OK, OOM

MAX_PROBES_PER_FAMILY = 3
FAMILIES_PROBED = 3
DEFAULT_PROBE_BUDGET_S = 60.0
#: A probe is not started with less time than this left: it could not finish.
MIN_PROBE_S = 5.0


@dataclass(frozen=True)
class ProbeContext:
    """What a measurement needs besides the candidate: the model, the workload and the draft plan."""

    resolved: object
    seq_len: int
    optimizer: str
    attention: str
    gpu_name: str
    plan: object = None


class _Clock:
    """The probe budget's deadline."""

    def __init__(self, budget_s: float):
        self.deadline = time.monotonic() + budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()


def refine_with_measurements(plan, measure: Callable, resolved, *, budget_s: float = DEFAULT_PROBE_BUDGET_S,
                             progress: Callable | None = None, estimate: Callable | None = None):
    """Probe, calibrate and re-rank. `estimate(config)` gives the modelled memory of a configuration the probes ran
    in place of a candidate (fewer processes than planned): the plan adds the modelled difference."""
    context = ProbeContext(resolved, plan.seq_len, plan.optimizer, plan.attention, plan.hardware.gpu, plan)
    clock = _Clock(budget_s)
    records, measured = [], {}
    for members in _families(plan)[:FAMILIES_PROBED]:
        for cand, result in _walk_family(members, measure, context, plan.hardware.budget_bytes, clock, progress):
            result = _as_candidate(result, cand, estimate)
            records.append(_record(cand, result))
            measured[cand.config] = (cand, result)
        if clock.left() < MIN_PROBE_S:
            break
    return _rerank(plan, measured, records)


def _families(plan) -> list[list[Candidate]]:
    """Per family with a fitting candidate, in rank order: its members of the lead's precision, by micro-batch
    (fp16 and bf16 autocast measure alike, so the faster-ranked one stands for both)."""
    leads: dict[tuple, Candidate] = {}
    for cand in plan.candidates:
        if cand.fits and cand.memory is not None:
            leads.setdefault(cand.config.family(), cand)
    out = []
    for family, lead in leads.items():
        members = [c for c in plan.candidates if c.memory is not None and c.config.family() == family
                   and c.config.precision == lead.config.precision]
        out.append(sorted(members, key=lambda c: c.config.micro_batch))
    return out


def _walk_family(members, measure, context, budget, clock: _Clock, progress):
    """Yield (candidate, result) for the probes of one family."""
    fitting = [i for i, c in enumerate(members) if c.fits]
    if not fitting:
        return
    index, tried, direction = fitting[-1], set(), 0
    while len(tried) < MAX_PROBES_PER_FAMILY and 0 <= index < len(members) and index not in tried:
        if clock.left() < MIN_PROBE_S:
            return
        cand = members[index]
        tried.add(index)
        if progress:
            progress(cand.config.label())
        result = measure(context, cand.config, clock.left())
        yield cand, result
        if result.status == OOM or (result.status == OK and _measured_peak(result, cand) > budget):
            if direction > 0:
                return
            index, direction = index - 1, -1
        elif result.status == OK and direction >= 0 and index + 1 < len(members):
            ratio = result.peak_allocated / max(cand.memory.peak_allocated, 1)
            nxt = members[index + 1]
            if nxt.memory.peak_allocated * ratio + (nxt.memory.peak - nxt.memory.peak_allocated) <= budget:
                index, direction = index + 1, 1
            else:
                return
        else:
            return


def _as_candidate(result: Measurement, cand: Candidate, estimate: Callable | None) -> Measurement:
    """A run with fewer processes than the candidate plans (this node lacks the GPUs) measured one rank of a
    smaller job: add the modelled per-rank difference (buckets, partitions) between the two."""
    cfg = cand.config
    if result.status != OK or result.processes >= cfg.world_size or estimate is None:
        return result
    ran = cfg.model_copy(update={"world_size": result.processes, "grad_accum": result.grad_accum or cfg.grad_accum})
    planned, measured_as = estimate(cfg), estimate(ran)
    allocated = result.peak_allocated + planned.peak_allocated - measured_as.peak_allocated
    reserved = result.peak_reserved + planned.peak_reserved - measured_as.peak_reserved
    return result.model_copy(update={"peak_allocated": max(0, allocated), "peak_reserved": max(0, reserved)})


def _measured_peak(result: Measurement, cand: Candidate) -> int:
    """What the process needs on the card: the allocator's measured reservation plus what lives outside it (CUDA
    context, NCCL buffers), as the model says."""
    return result.peak_reserved + cand.memory.terms.outside_allocator


def _record(cand: Candidate, result: Measurement) -> ProbeRecord:
    return ProbeRecord(config=cand.config.label(), micro_batch=cand.config.micro_batch,
                       world_size=cand.config.world_size,
                       predicted_peak_allocated=cand.memory.peak_allocated if cand.memory else None,
                       predicted_tokens_per_s=cand.throughput.tokens_per_s if cand.throughput else None,
                       measurement=result)


def calibration_from(measured: dict) -> dict[tuple, FamilyCalibration]:
    """Per family: measured/predicted activations, and the allocator's measured slack per activation byte."""
    return family_calibrations([(cand.config, cand.memory, result.peak_allocated, result.peak_reserved, None)
                                for cand, result in measured.values() if result.status == OK])


def family_calibrations(runs: list[tuple]) -> dict[tuple, FamilyCalibration]:
    """Per family, from (configuration, its predicted MemoryEstimate, measured peak allocated, reserved and process
    total or None) runs: the measured/predicted activations, the allocator's slack per activation byte and the bytes
    outside the allocator, the cautious (larger) of each."""
    found: dict[tuple, list[tuple[float, float, int | None]]] = {}
    for config, mem, peak_allocated, peak_reserved, process in runs:
        if mem is None or mem.activations <= 0:
            continue
        fixed = mem.peak_allocated - mem.activations  # states and allocated overheads, as predicted
        act = max(1, peak_allocated - fixed)
        slack = max(0, peak_reserved - peak_allocated)
        outside = max(0, process - peak_reserved) if process else None
        found.setdefault(config.family(), []).append((act / mem.activations, slack / act, outside))
    out = {}
    for fam, runs_ in found.items():
        outside = [o for _, _, o in runs_ if o is not None]
        out[fam] = FamilyCalibration(activation_ratio=max(r for r, _, _ in runs_),
                                     allocator_slack=max(s for _, s, _ in runs_), runs=len(runs_),
                                     outside=max(outside) if outside else None)
    return out


def _calibrated(cand: Candidate, calib: FamilyCalibration, budget: int, method: str = "probe-calibrated") -> Candidate:
    """An unprobed candidate of a probed (or, `method` receipt-calibrated, earlier run) family, its activation,
    allocator-slack and (where measured) outside-the-allocator terms corrected."""
    mem, terms = cand.memory, cand.memory.terms
    act = int(mem.activations * calib.activation_ratio)
    slack = int(act * calib.allocator_slack)
    peak_allocated = mem.peak_allocated + act - mem.activations
    # what the runs measured outside the allocator, where they did, stands for the modelled context and NCCL buffers
    context = terms.cuda_context if calib.outside is None else max(0, calib.outside - terms.nccl_buffers)
    nccl = terms.nccl_buffers if calib.outside is None else calib.outside - context
    # measured on this GPU: the model's error margin is replaced by the measurement
    peak = mem.peak + (act - mem.activations) + (slack - terms.allocator_slack) - terms.error_margin + (
        context + nccl - terms.outside_allocator)
    terms = terms.model_copy(update={"allocator_slack": slack, "error_margin": 0, "cuda_context": context,
                                     "nccl_buffers": nccl})
    memory = mem.model_copy(update={"activations": act, "peak_allocated": peak_allocated, "peak": peak,
                                    "method": method, "margin_basis": NO_MARGIN, "margin_rows": 0, "terms": terms,
                                    "overhead": terms.allocated_overheads + slack + terms.outside_allocator,
                                    "model": mem.modelled()})
    return cand.model_copy(update={"memory": memory, "verdict": Verdict.of_peak(peak, budget, memory.method)})


def speed_calibrations_from(measured: dict) -> dict[str, SpeedCalibration]:
    """Per precision family (`Config.precision_family`): the median measured / modelled micro-step and
    optimizer-step times over its successful probes."""
    ratios: dict[str, tuple[list[float], list[float]]] = {}
    for cand, result in measured.values():
        parts = cand.throughput.parts if cand.throughput else None
        if result.status != OK or parts is None or parts.compute <= 0 or result.micro_step_s <= 0:
            continue
        micro, optim = ratios.setdefault(cand.config.precision_family(), ([], []))
        micro.append(result.micro_step_s / (parts.compute / cand.config.grad_accum))
        if parts.optimizer > 0 and result.optimizer_step_s > 0:
            optim.append(result.optimizer_step_s / parts.optimizer)
    return {family: SpeedCalibration(micro_step=statistics.median(micro),
                                     optimizer_step=statistics.median(optim) if optim else 1.0, probes=len(micro),
                                     precision=family)
            for family, (micro, optim) in ratios.items()}


def recalibrated_memory(cand: Candidate, memory: dict[tuple, FamilyCalibration], budget: int) -> Candidate:
    """A candidate whose family earlier runs on this GPU measured (`receipt_memory`), its memory corrected by them;
    as modelled otherwise."""
    calib = memory.get(cand.config.family())
    if calib is None or cand.memory is None or cand.memory.activations <= 0:
        return cand
    return _calibrated(cand, calib, budget, "receipt-calibrated")


def retimed(cand: Candidate, speeds: dict[str, SpeedCalibration]) -> Candidate:
    """An unprobed candidate re-timed by its precision family's calibration (`speed_calibrations_from`); as modelled
    where its family was not probed."""
    speed = speeds.get(cand.config.precision_family())
    return _recalibrated(cand, speed) if speed else cand


def _recalibrated(cand: Candidate, calib: SpeedCalibration) -> Candidate:
    """An unprobed candidate's modelled speed, its micro-steps and optimizer step rescaled by the probes."""
    tp = cand.throughput
    if tp is None or tp.source != "model":
        return cand
    parts = tp.parts.model_copy(update={"compute": tp.parts.compute * calib.micro_step,
                                        "optimizer": tp.parts.optimizer * calib.optimizer_step})
    return cand.model_copy(update={"throughput": tp.corrected(parts.total, source="calibrated", parts=parts)})


def _rerank(plan, measured: dict, records: list[ProbeRecord]):
    budget = plan.hardware.budget_bytes
    calibration = calibration_from(measured)
    speeds = speed_calibrations_from(measured)
    updated = []
    for cand in plan.candidates:
        entry = measured.get(cand.config)
        family = cand.config.family()
        if entry:
            updated.append(_apply(cand, entry[1], budget))
            continue
        if cand.memory is not None and family in calibration and cand.memory.activations > 0:
            cand = _calibrated(cand, calibration[family], budget)
        updated.append(retimed(cand, speeds))
    probed_ok = [c for c in updated if c.throughput and c.throughput.source.startswith("probe") and c.fits]
    rest = sorted((c for c in updated if c not in probed_ok),
                  key=lambda c: -(c.throughput.tokens_per_s if c.throughput else 0.0))
    probed_ok.sort(key=lambda c: -c.throughput.tokens_per_s)
    ranked = probed_ok + [c for c in rest if c.fits] + [c for c in rest if not c.fits]
    spent = sum(r.measurement.seconds for r in records)
    cached = sum(1 for r in records if r.measurement.cached)
    probes = note("probes", run=len(records), cached=cached, seconds=spent, confirmed=len(probed_ok),
                  unprobed_precision=bool(speeds) and any(c.config.precision_family() not in speeds for c in updated))
    table = {Config.family_text(fam): c for fam, c in calibration.items()}
    return plan.model_copy(update={"choice": ranked[0], "candidates": tuple(ranked), "probes": tuple(records),
                                   "calibration": table,
                                   "speed_calibration": speeds.get(ranked[0].config.precision_family()),
                                   "speed_calibrations": tuple(speeds.values()), "notes": plan.notes + (probes,)})


def _apply(cand: Candidate, result: Measurement, budget: int) -> Candidate:
    if result.status == OOM:
        return cand.model_copy(update={"verdict": Verdict(kind="probe-oom")})
    if result.status != OK:
        return cand
    mem = cand.memory
    peak = _measured_peak(result, cand)
    memory = mem.model_copy(update={"peak_allocated": result.peak_allocated, "peak": peak, "method": "probe",
                                    "margin_basis": NO_MARGIN, "margin_rows": 0, "model": mem.modelled(),
                                    "terms": mem.terms.model_copy(
                                        update={"allocator_slack": result.peak_reserved - result.peak_allocated,
                                                "error_margin": 0})})
    cfg, model_tp = cand.config, cand.throughput
    step_s, source = result.step_time_s, "probe"
    if model_tp.parts.compile:  # a probe times steps after its warm-up, which compiled the model
        step_s += model_tp.parts.compile
        source = "probe+model"
    if result.processes < cfg.world_size:  # ranks measured alone: add what they did not do, the communication
        step_s += model_tp.parts.communication
        source = "probe+model"
    throughput = model_tp.at_step_time(step_s, source=source, parts=StepParts(),
                                       model_step_time_s=model_tp.modelled_step_time_s,
                                       step_time_fast_host_s=None, step_time_slow_host_s=None)  # measured here
    return cand.model_copy(update={"memory": memory, "throughput": throughput,
                                   "verdict": Verdict.of_peak(peak, budget, memory.method)})
