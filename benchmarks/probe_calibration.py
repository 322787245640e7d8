"""Probe calibration of the speed model, checked on the steps a lent H100 measured.

Every single-GPU step in benchmarks/data/gpu_measured_h100.json is planned pinned, as gpu_measured.py plans it. Each
row in turn plays the probe: its measured micro-step and optimizer step calibrate the model
(planner/refine.py `speed_calibrations_from`), and every other row of the same model is predicted three ways:
- uncalibrated: the model's step time;
- pooled: the probe's ratio applied to every candidate, whatever its precision (the rule before calibration was kept
  per precision family);
- per family: the planner's rule, the ratio applied to candidates of the probe's precision family
  (`Config.precision_family`: fp16 and bf16 autocast as one), the others left as modelled.
The error is predicted / measured step time - 1 (the measured step: the row's accumulation of micro-steps plus its
optimizer step). Every prediction is of a row the calibration did not see.

Run:  HF_HUB_OFFLINE=1 python benchmarks/probe_calibration.py [--out benchmarks/results/probe_calibration.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "gpu_measured_h100.json"
RULES = ("uncalibrated", "pooled", "per family")


def measured_step_s(row: dict) -> float:
    return row["batch"] // row["micro_batch"] * row["micro_step_s"] + row["optimizer_step_s"]


def candidates(data: dict) -> list[tuple[dict, object]]:
    """(row, the planner's candidate for it) for every row the planner plans."""
    from gpu_validation import pinned_plan

    from planner.errors import NoFitError

    out = []
    for row in data["rows"]:
        try:
            draft = pinned_plan(row["model"], row["seq_len"], row["precision"], row["checkpointing"],
                                row["micro_batch"], data["gpu"], batch=row["batch"])
        except NoFitError:
            continue
        out.append((row, draft.choice))
    return out


def predictions(probe: tuple[dict, object], target: object) -> dict[str, float]:
    """The target candidate's step time under each rule, calibrated by the probe's measurement."""
    from planner.refine import _recalibrated, retimed, speed_calibrations_from
    from planner.types import Measurement

    row, cand = probe
    result = Measurement(status="ok", micro_step_s=row["micro_step_s"], optimizer_step_s=row["optimizer_step_s"],
                         step_time_s=measured_step_s(row))
    speeds = speed_calibrations_from({cand.config: (cand, result)})
    (calib,) = speeds.values()
    return {"uncalibrated": target.throughput.step_time_s,
            "pooled": _recalibrated(target, calib).throughput.step_time_s,
            "per family": retimed(target, speeds).throughput.step_time_s}


def summary(errors: list[float]) -> dict:
    return {"median_abs": statistics.median(abs(e) for e in errors), "worst": max(errors, key=abs),
            "pairs": len(errors)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the pairs and the summary as JSON")
    args = parser.parse_args()
    data = json.loads(DATA.read_text())
    planned = candidates(data)
    pairs, errors = [], {(rule, scope): [] for rule in RULES for scope in ("same", "other", "all")}
    for probe in planned:
        for target in planned:
            if target is probe or target[0]["model"] != probe[0]["model"]:
                continue
            got = predictions(probe, target[1])
            same = probe[1].config.precision_family() == target[1].config.precision_family()
            pair = {"probe": probe[1].config.label(), "target": target[1].config.label(),
                    "model": probe[0]["model"], "seq_len": (probe[0]["seq_len"], target[0]["seq_len"]),
                    "measured_step_s": measured_step_s(target[0])}
            for rule, seconds in got.items():
                error = seconds / pair["measured_step_s"] - 1
                pair[f"{rule} error"] = error
                for scope in ("same" if same else "other", "all"):
                    errors[(rule, scope)].append(error)
            pairs.append(pair)
    report = {"gpu": data["gpu"], "summary": {}, "pairs": pairs}
    titles = {"same": "target of the probe's precision family", "other": "target of another precision family",
              "all": "every target"}
    for scope, title in titles.items():
        print(f"{title}:")
        for rule in RULES:
            s = summary(errors[(rule, scope)])
            report["summary"][f"{rule} / {scope}"] = s
            print(f"  {rule:<13} median |error| {s['median_abs']:6.1%}  worst {s['worst']:+7.1%}  "
                  f"({s['pairs']} probe-target pairs)")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
