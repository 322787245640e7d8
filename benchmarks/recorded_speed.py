"""Every single-GPU step a lent GPU measured, re-predicted with today's plan path: step time and ranking.

Rows: the lent H100's steps (benchmarks/data/gpu_measured_h100.json, each the probes' HF Trainer run of a pinned
configuration) and the lent H200's validation runs (benchmarks/data/gpu_measured_h200.json, copied from
benchmarks/results/gpu_validation-H200-141GB-2026-11-27.json: every configuration that ran). Each is planned with
`planner.plan` pinned to the configuration that ran, offline, as the GPU validation planned it
(benchmarks/gpu_validation.py `pinned_plan`), Liger-Kernel pinned on where the run used it and off where it did not
(with liger-kernel installed, `--liger auto` would weigh it). Measured step time: the row's micro-steps at its
accumulation plus its optimizer step, as the probes time them.

Ranking: for each model on each GPU, Kendall's tau between the planner's order of its recorded configurations by
tokens per second and the measured order (`kendall_tau`).

These are development rows: the speed model's host, Liger and recomputation mechanisms were built looking at them
(planner/facts name the rows their constants were fitted to). Plain JSON, not the evidence format.

Run:  HF_HUB_OFFLINE=1 python benchmarks/recorded_speed.py
Writes benchmarks/results/recorded_speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages import without an install
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_validation import pinned_plan  # noqa: E402
from planner.errors import NoFitError  # noqa: E402

H100_DATA = ROOT / "benchmarks" / "data" / "gpu_measured_h100.json"
H200_DATA = ROOT / "benchmarks" / "data" / "gpu_measured_h200.json"
OUT = ROOT / "benchmarks" / "results" / "recorded_speed.json"
COMMAND = "HF_HUB_OFFLINE=1 python benchmarks/recorded_speed.py"


@dataclass(frozen=True)
class Recorded:
    """One measured step and how to plan it: the pinned configuration, its model and GPU, the tokens one optimizer
    step trains, the measured seconds per optimizer step."""

    id: str
    gpu: str
    model: str
    seq_len: int
    micro_batch: int
    grad_accum: int
    precision: str
    checkpointing: str
    measured_s: float
    source: str
    fields: tuple[tuple[str, object], ...] = ()

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.grad_accum * self.seq_len


@dataclass(frozen=True)
class Scored:
    row: Recorded
    predicted_s: float
    micro_gpu_s: float
    micro_cpu_s: float

    @property
    def error(self) -> float:
        """Signed relative error: positive where the prediction is above the measurement."""
        return self.predicted_s / self.row.measured_s - 1


def h100_rows(path: Path = H100_DATA) -> list[Recorded]:
    """The lent H100's steps, planned without Liger-Kernel as they ran (the probes of 2026-11-22/23 ran none)."""
    data = json.loads(path.read_text())
    out = []
    for r in data["rows"]:
        accum = r["batch"] // r["micro_batch"]
        rid = (f"{r['model'].split('/')[-1]}-s{r['seq_len']}-b{r['batch']}-{r['precision']}-{r['checkpointing']}"
               f"-mb{r['micro_batch']}")
        out.append(Recorded(id=rid, gpu=data["gpu"], model=r["model"], seq_len=r["seq_len"],
                            micro_batch=r["micro_batch"], grad_accum=accum, precision=r["precision"],
                            checkpointing=r["checkpointing"],
                            measured_s=accum * r["micro_step_s"] + r["optimizer_step_s"], source=r["source"],
                            fields=(("liger", "off"),)))
    return out


def h200_rows(path: Path = H200_DATA) -> list[Recorded]:
    """The lent H200's validation runs, each with the request fields its pinned plan had (Liger on where it ran)."""
    data = json.loads(path.read_text())
    out = []
    for r in data["rows"]:
        fields = {"liger": "on" if r["liger"] else "off"}
        fields.update({"peft": r["peft"]} if r["peft"] != "none" else {})
        fields.update({"task": r["task"], "num_labels": r["num_labels"]} if r.get("task") else {})
        out.append(Recorded(id=r["id"], gpu=data["gpu"], model=r["model"], seq_len=r["seq_len"],
                            micro_batch=r["micro_batch"], grad_accum=r["grad_accum"], precision=r["precision"],
                            checkpointing=r["checkpointing"],
                            measured_s=r["grad_accum"] * r["micro_step_s"] + r["optimizer_step_s"], source=r["source"],
                            fields=tuple(sorted(fields.items()))))
    return out


def predicted(row: Recorded):
    """The pinned plan's throughput for the row (the rejected candidate's where the plan says it does not fit)."""
    try:
        choice = pinned_plan(row.model, row.seq_len, row.precision, row.checkpointing, row.micro_batch, row.gpu,
                             batch=row.micro_batch * row.grad_accum, **dict(row.fields)).choice
    except NoFitError as err:
        choice = err.plan.choice
    return choice.throughput


def score(row: Recorded) -> Scored:
    tp = predicted(row)
    return Scored(row=row, predicted_s=tp.step_time_s, micro_gpu_s=tp.parts.micro_gpu, micro_cpu_s=tp.parts.micro_cpu)


def kendall_tau(predicted: list[float], measured: list[float]) -> float | None:
    """Kendall's tau-b between two orderings of the same items (1: the same order, -1: reversed); None for fewer than
    two items or where either ordering ties everything."""
    n = len(predicted)
    concordant = discordant = ties_p = ties_m = 0
    for i in range(n):
        for j in range(i + 1, n):
            a, b = predicted[i] - predicted[j], measured[i] - measured[j]
            if a == 0 and b == 0:
                continue
            if a == 0:
                ties_p += 1
            elif b == 0:
                ties_m += 1
            elif (a > 0) == (b > 0):
                concordant += 1
            else:
                discordant += 1
    pairs_p, pairs_m = concordant + discordant + ties_p, concordant + discordant + ties_m
    if n < 2 or not pairs_p or not pairs_m:
        return None
    return (concordant - discordant) / (pairs_p * pairs_m) ** 0.5


def ranking(scored: list[Scored]) -> dict[str, dict]:
    """Kendall's tau per model and GPU between the predicted and the measured tokens per second of its rows."""
    groups: dict[str, list[Scored]] = {}
    for s in scored:
        groups.setdefault(f"{s.row.model} on {s.row.gpu}", []).append(s)
    return {key: {"rows": len(rows), "tau": kendall_tau([r.row.tokens / r.predicted_s for r in rows],
                                                        [r.row.tokens / r.row.measured_s for r in rows])}
            for key, rows in sorted(groups.items())}


def summary(scored: list[Scored]) -> dict:
    errors = [s.error for s in scored]
    if not errors:
        return {"rows": 0}
    return {"rows": len(errors), "median_abs": statistics.median(abs(e) for e in errors),
            "bias": statistics.median(errors), "worst_abs": max(abs(e) for e in errors),
            "predicted_fast": sum(e < 0 for e in errors)}


def results(scored: list[Scored]) -> dict:
    by_gpu = {gpu: summary([s for s in scored if s.row.gpu == gpu]) for gpu in sorted({s.row.gpu for s in scored})}
    return {"benchmark": "recorded_speed", "command": COMMAND, "evidence": "development",
            "metric": "seconds per optimizer step, measured against the pinned plan's step time",
            "summary": {"all": summary(scored), **by_gpu}, "ranking": ranking(scored),
            "rows": [{**{k: v for k, v in asdict(s.row).items() if k != "fields"}, "fields": dict(s.row.fields),
                      "predicted_s": s.predicted_s, "micro_gpu_s": s.micro_gpu_s, "micro_cpu_s": s.micro_cpu_s,
                      "error": s.error} for s in scored]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    scored = []
    for row in h100_rows() + h200_rows():
        scored.append(score(row))
        s = scored[-1]
        print(f"{row.gpu:<11} {row.id:<52} measured {row.measured_s:9.4f} s  predicted {s.predicted_s:9.4f} s  "
              f"{s.error:+7.1%}", flush=True)
    out = results(scored)
    for key, s in out["summary"].items():
        print(f"{key}: {s['rows']} rows, median |error| {s['median_abs']:.1%}, bias {s['bias']:+.1%}, worst "
              f"{s['worst_abs']:.1%}, predicted fast {s['predicted_fast']}")
    for key, r in out["ranking"].items():
        tau = "n/a" if r["tau"] is None else f"{r['tau']:+.2f}"
        print(f"  tau {tau}  {key} ({r['rows']} rows)")
    args.out.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
