"""Guided refinement with measurements: confirm the model's choice with few probes, calibrate, re-rank.

`measure(context, config) -> dict` (status ok | oom | timeout | error | skipped, peak_allocated, peak_reserved,
step_time_s, tokens_per_s) is supplied by the caller (the CLI passes probes.Prober). Per family (precision,
checkpointing, ZeRO, offload) we start at the model's largest fitting micro-batch and move down on OOM, up
when the calibrated model says the next one fits: at most `MAX_PROBES_PER_FAMILY` probes, where power-of-two
or binary-search finders need 8-25 trials. The best measured candidate wins.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from planner.types import Candidate, ThroughputInfo

MAX_PROBES_PER_FAMILY = 3
FAMILIES_PROBED = 3
DEFAULT_PROBE_BUDGET_S = 60.0


@dataclass(frozen=True)
class ProbeContext:
    resolved: object
    seq_len: int
    optimizer: str
    attention: str
    gpu_name: str


def _family(cfg) -> tuple:
    return cfg.precision, cfg.checkpointing, cfg.zero_stage, cfg.offload


def refine_with_measurements(plan, measure: Callable, resolved, *, budget_s: float = DEFAULT_PROBE_BUDGET_S,
                             progress: Callable | None = None):
    context = ProbeContext(resolved, plan.seq_len, plan.optimizer, plan.attention, plan.hardware.gpu)
    deadline = time.monotonic() + budget_s
    by_family: dict[tuple, list[Candidate]] = {}
    for c in plan.candidates:
        if c.memory is not None:
            by_family.setdefault(_family(c.config), []).append(c)
    fitting_families, kinds = [], set()
    for cand in plan.candidates:
        family, kind = _family(cand.config), cand.config.kind()
        if cand.fits and kind not in kinds:  # fp16 and bf16 autocast measure alike: probe the faster-ranked one
            kinds.add(kind)
            fitting_families.append(family)
    records, measured = [], {}
    for family in fitting_families[:FAMILIES_PROBED]:
        members = sorted(by_family[family], key=lambda c: c.config.micro_batch)
        for cand, result in _walk_family(members, measure, context, plan.hardware.budget_bytes, deadline, progress):
            records.append(_record(cand, result))
            measured[cand.config] = (cand, result)
        if time.monotonic() > deadline:
            break
    return _rerank(plan, measured, records)


def _walk_family(members, measure, context, budget, deadline, progress):
    """Yield (candidate, result) for the probes of one family."""
    fitting = [i for i, c in enumerate(members) if c.fits]
    if not fitting:
        return
    index, tried, direction = fitting[-1], set(), 0
    while len(tried) < MAX_PROBES_PER_FAMILY and 0 <= index < len(members) and index not in tried:
        if time.monotonic() > deadline:
            return
        cand = members[index]
        tried.add(index)
        if progress:
            progress(cand.config.label())
        result = measure(context, cand.config)
        yield cand, result
        if result.get("status") == "oom" or (result.get("status") == "ok" and _measured_peak(result, cand) > budget):
            if direction > 0:
                return
            index, direction = index - 1, -1
        elif result.get("status") == "ok" and direction >= 0 and index + 1 < len(members):
            ratio = result["peak_allocated"] / max(cand.memory.peak_allocated, 1)
            nxt = members[index + 1]
            if nxt.memory.peak_allocated * ratio + (nxt.memory.peak - nxt.memory.peak_allocated) <= budget:
                index, direction = index + 1, 1
            else:
                return
        else:
            return


def _measured_peak(result: dict, cand: Candidate) -> int:
    """What the process needs on the card: the allocator's measured reservation plus what the model says lives
    outside it (CUDA context, NCCL buffers): the predicted peak less what the allocator holds."""
    mem = cand.memory
    outside = mem.peak - mem.peak_allocated - mem.terms.get("allocator_fragmentation", 0)
    return int(result["peak_reserved"]) + outside


def _record(cand: Candidate, result: dict) -> dict:
    out = {"config": cand.config.label(), "micro_batch": cand.config.micro_batch, "status": result.get("status"),
           "predicted_peak_allocated": cand.memory.peak_allocated if cand.memory else None,
           "predicted_tokens_per_s": cand.throughput.tokens_per_s if cand.throughput else None}
    for key in ("peak_allocated", "peak_reserved", "tokens_per_s", "step_time_s", "cached", "seconds", "reason", "error"):
        if key in result:
            out[key] = result[key]
    return out


def calibration_from(measured: dict) -> dict[tuple, dict]:
    """Per family: measured/predicted activations, and the allocator's measured slack per activation byte."""
    out: dict[tuple, dict] = {}
    for cand, result in measured.values():
        if result.get("status") != "ok" or cand.memory is None or cand.memory.activations <= 0:
            continue
        mem = cand.memory
        fixed = mem.peak_allocated - mem.activations  # states and allocated overheads, as predicted
        act = max(1, int(result["peak_allocated"]) - fixed)
        slack = max(0, int(result["peak_reserved"]) - int(result["peak_allocated"]))
        entry = out.setdefault(_family(cand.config), {"activation_ratio": [], "fragmentation": []})
        entry["activation_ratio"].append(act / mem.activations)
        entry["fragmentation"].append(slack / act)
    return {fam: {k: max(v) for k, v in entry.items()} for fam, entry in out.items()}  # the cautious side


def _calibrated(cand: Candidate, calib: dict, budget: int) -> Candidate:
    """An unprobed candidate of a probed family, its activation and fragmentation terms corrected."""
    mem = cand.memory
    act = int(mem.activations * calib["activation_ratio"])
    frag = int(act * calib["fragmentation"])
    old_frag = mem.terms.get("allocator_fragmentation", 0)
    peak_allocated = mem.peak_allocated + act - mem.activations
    peak = mem.peak + (act - mem.activations) + (frag - old_frag)
    memory = mem.model_copy(update={"activations": act, "peak_allocated": peak_allocated, "peak": peak,
                                    "method": "probe-calibrated",
                                    "terms": {**mem.terms, "allocator_fragmentation": frag}})
    fits = peak <= budget
    reason = (f"fits (calibrated by probes): peak {peak / 2**30:.1f} GiB of {budget / 2**30:.1f} GiB" if fits else
              f"OOM by {(peak - budget) / 2**30:.1f} GiB (calibrated by probes): peak {peak / 2**30:.1f} GiB")
    return cand.model_copy(update={"memory": memory, "fits": fits, "reason": reason})


def _rerank(plan, measured: dict, records: list[dict]):
    budget = plan.hardware.budget_bytes
    calibration = calibration_from(measured)
    updated = []
    for cand in plan.candidates:
        entry = measured.get(cand.config)
        if entry:
            updated.append(_apply(cand, entry[1], budget))
        elif cand.memory is not None and _family(cand.config) in calibration and cand.memory.activations > 0:
            updated.append(_calibrated(cand, calibration[_family(cand.config)], budget))
        else:
            updated.append(cand)
    probed_ok = [c for c in updated if c.throughput and c.throughput.source.startswith("probe") and c.fits]
    rest = [c for c in updated if c not in probed_ok]
    probed_ok.sort(key=lambda c: -c.throughput.tokens_per_s)
    ranked = probed_ok + [c for c in rest if c.fits] + [c for c in rest if not c.fits]
    spent = sum(r.get("seconds", 0.0) for r in records)
    cached = sum(1 for r in records if r.get("cached"))
    note = (f"Probes: {len(records)} run ({cached} from cache) in {spent:.0f} s; "
            f"{len(probed_ok)} confirmed by measurement.")
    table = {" / ".join(str(x) for x in fam): {k: round(v, 4) for k, v in c.items()} for fam, c in calibration.items()}
    return plan.model_copy(update={"choice": ranked[0], "candidates": tuple(ranked), "probes": tuple(records),
                                   "calibration": table, "notes": plan.notes + (note,)})


def _apply(cand: Candidate, result: dict, budget: int) -> Candidate:
    status = result.get("status")
    if status == "oom":
        return cand.model_copy(update={"fits": False, "reason": "OOM in a probe (measured)"})
    if status != "ok":
        return cand
    world = cand.config.world_size
    mem = cand.memory
    peak = _measured_peak(result, cand)
    memory = mem.model_copy(update={"peak_allocated": int(result["peak_allocated"]), "peak": peak, "method": "probe",
                                    "terms": {**mem.terms, "allocator_fragmentation":
                                              int(result["peak_reserved"]) - int(result["peak_allocated"])}})
    model_tp = cand.throughput
    compute_s = result["step_time_s"]
    step_s = compute_s + (model_tp.parts.get("communication", 0.0) + model_tp.parts.get("offload", 0.0))
    samples = cand.config.micro_batch * cand.config.grad_accum * world
    tokens_per_step = result["tokens_per_s"] * compute_s * world
    throughput = ThroughputInfo(tokens_per_s=tokens_per_step / step_s, samples_per_s=samples / step_s,
                                mfu=model_tp.mfu * (model_tp.step_time_s / step_s), step_time_s=step_s,
                                source="probe" if world == 1 else "probe+model", parts={"measured": compute_s})
    fits = peak <= budget
    reason = (f"measured: peak {peak / 2**30:.1f} GiB of {budget / 2**30:.1f} GiB budget" if fits
              else f"OOM by measurement: peak {peak / 2**30:.1f} GiB > budget {budget / 2**30:.1f} GiB")
    return cand.model_copy(update={"memory": memory, "throughput": throughput, "fits": fits, "reason": reason})
