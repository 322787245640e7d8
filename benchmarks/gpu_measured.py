"""The planner offline against what a real GPU measured: every single-GPU step our probes ran on a lent H100.

Rows come from benchmarks/data/gpu_measured_h100.json (copied from the committed gpu_validation results, each with
its source file and command). Each row's configuration is planned pinned, exactly as gpu_validation.py planned it on
the GPU (`plan`, the HF Trainer's program through trainplan's files), and the plan's predictions are compared with
the measurements: peak allocated, peak reserved and process memory (NVML) as memory rows, the optimizer step's time
(its micro-steps at the planned accumulation plus the optimizer step) as throughput rows. Several facts were fitted
to these rows (the workspace placement, the BLAS threads, the CUDA modules' bytes, the misaligned-GEMM fractions:
their `fitted_to` names this file and the gpu_validation results), so which rows are in-sample is computed
(benchmarks/evidence.py), never assumed.

A step the plan predicts not to fit although it ran is a wrong verdict, an error of its own kind: it is counted
and named (the results' "wrong_verdicts" and their metric text), and its memory rows still carry the plan's
estimate of that very configuration (the candidate the no-fit answer carries), so no median leaves it out. It has no
throughput row when the plan gives no time for a configuration it rejects.

Written with benchmarks/evidence.py (`python -m benchmarks.report` reads them):
  benchmarks/results/gpu_measured-H100-80GB.json              kind "memory"
  benchmarks/results/gpu_measured-throughput-H100-80GB.json   kind "throughput"

Run:  HF_HUB_OFFLINE=1 python benchmarks/gpu_measured.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages import without an install
    sys.path.insert(0, str(ROOT))

from benchmarks import evidence  # noqa: E402
from benchmarks.gpu_validation import pinned_plan  # noqa: E402
from planner.errors import NoFitError  # noqa: E402

DATA_FILE = "gpu_measured_h100.json"
DATA = Path(__file__).resolve().parent / "data" / DATA_FILE
#: the plan's program, as evidence rows name it (planner/planning.py `PROGRAM`)
PROGRAM = "trainer"
#: (prediction, measurement field, what was measured)
MEMORY = (("peak_allocated", "peak_allocated", "torch.cuda.max_memory_allocated"),
          ("peak_reserved", "peak_reserved", "torch.cuda.max_memory_reserved"),
          ("peak_process", "process_memory", "NVML per-process memory (what nvidia-smi shows)"))
COMMAND = "HF_HUB_OFFLINE=1 python benchmarks/gpu_measured.py"
STACK = ("`planner.plan` pinned to each measured configuration (as gpu_validation.py planned it), offline; measured: "
         "the HF Trainer through trainplan's emitted files on a lent NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, "
         "transformers 5.23, driver 580), 3 micro-steps after warm-up")
CANNOT_SHOW = ("other GPUs or several GPUs, long runs (a few steps: no fragmentation over hours), real data "
               "(synthetic full-length batches), models beyond GPT-2, BLOOM-560m, Llama-3.2-1B and BERT-large; "
               "accuracy without fitted facts where a fact fitted to these rows is read")


def row_id(row: dict) -> str:
    return (f"{row['model'].split('/')[-1]}-s{row['seq_len']}-b{row['batch']}-{row['precision']}-"
            f"{row['checkpointing']}-mb{row['micro_batch']}")


def measured_step_s(row: dict) -> float:
    """The row's measured optimizer step: its micro-steps at the planned accumulation and the optimizer step."""
    return row["batch"] // row["micro_batch"] * row["micro_step_s"] + row["optimizer_step_s"]


def planned(row: dict, gpu: str):
    """The pinned plan's choice, and whether the plan rejects the configuration (its choice is then the rejected
    candidate, with its estimate)."""
    try:
        draft = pinned_plan(row["model"], row["seq_len"], row["precision"], row["checkpointing"], row["micro_batch"],
                            gpu, batch=row["batch"], liger="off")  # the probes that measured them ran no Liger
        return draft.choice, False
    except NoFitError as err:
        return err.plan.choice, True


def evidence_rows(row: dict, gpu: str) -> tuple[list[evidence.Row], list[evidence.Row], dict | None]:
    """The step's memory rows and throughput row, and its wrong verdict (None where the plan says it fits)."""
    rid = row_id(row)
    choice, rejected = planned(row, gpu)  # once outside the recording: the rows below share its caches
    group = evidence.run_group(PROGRAM, gpu, choice.config)
    common = {"data_file": DATA_FILE, "source": row["source"], "group": group}
    verdict, suffix = None, ""
    if rejected:
        margin = choice.memory.margin if choice.memory else 0
        verdict = {"id": rid, "verdict": choice.reason, "predicted_peak": choice.verdict.peak,
                   "error_margin": margin, "budget": choice.verdict.budget,
                   "measured_process": row["process_memory"]}
        suffix = (f"; the plan says it does not fit ({choice.reason}; {margin / 2**30:.1f} GiB of that peak is the "
                  f"error margin), but it ran")
    memory = [evidence.predicted_row(id=f"{rid}/{ours}", measured=row[theirs], note=what + suffix,
                                     predict=lambda ours=ours: getattr(planned(row, gpu)[0].memory, ours), **common)
              for ours, theirs, what in MEMORY if choice.memory is not None]
    speed = []
    if choice.throughput is not None:
        speed.append(evidence.predicted_row(
            id=f"{rid}/step_time_s", measured=measured_step_s(row), predict=lambda: planned(row, gpu)[0].throughput
            .step_time_s, note=f"{row['batch'] // row['micro_batch']} micro-steps of {row['micro_batch']}" + suffix,
            **common))
    return memory, speed, verdict


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=evidence.RESULTS, help="the results folder")
    args = parser.parse_args()
    data = json.loads(DATA.read_text())
    gpu = data["gpu"]
    memory, speed, verdicts = [], [], []
    for row in data["rows"]:
        mem, step, verdict = evidence_rows(row, gpu)
        memory += mem
        speed += step
        verdicts += [verdict] if verdict else []
        errors = "  ".join(f"{r.id.split('/')[-1]} {r.error:+7.1%}" for r in mem + step)
        print(f"{row_id(row):<52} {errors}{'  PREDICTED NOT TO FIT' if verdict else ''}", flush=True)
    steps = len(data["rows"])
    wrong = (f"; wrong verdicts: {len(verdicts)} of {steps} steps ran although the plan predicted they would not fit "
             f"({', '.join(v['id'] + ': ' + v['verdict'] for v in verdicts)}), counted here and kept in the rows with "
             f"the plan's estimate of that configuration"
             if verdicts else f"; wrong verdicts: none of {steps} steps")
    args.out.mkdir(parents=True, exist_ok=True)
    written = {}
    for kind, rows, metric, name in (
            ("memory", memory, "peak memory per step (one row per metric): " + "; ".join(
                f"{what} against the plan's {ours}" for ours, _, what in MEMORY) + wrong,
             f"gpu_measured-{gpu}"),
            ("throughput", speed, "seconds per optimizer step (its micro-steps at the planned accumulation plus the "
                                  "optimizer step), CUDA-synchronised wall clock, against the plan's step time" + wrong,
             f"gpu_measured-throughput-{gpu}")):
        path = evidence.write_results(name, rows, kind=kind, metric=metric, stack=STACK, cannot_show=CANNOT_SHOW,
                                      command=COMMAND, out=args.out / f"{name}.json")
        record = json.loads(path.read_text())
        record["wrong_verdicts"] = {"steps": steps, "predicted_no_fit_but_ran": verdicts}
        path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        written[kind] = rows
    for kind, rows in written.items():
        for label, part in (("all", rows), ("in-sample", [r for r in rows if r.in_sample]),
                            ("no fitted fact", [r for r in rows if not r.in_sample])):
            s = evidence.summary(part)
            if s["rows"]:
                print(f"{kind} [{label}]: {s['rows']} rows, median |error| {s['median_abs']:.1%}, worst "
                      f"{s['worst_abs']:.1%}, bias {s['bias']:+.1%}, under {s['under']:.0%}")
    for metric in [ours for ours, _, _ in MEMORY]:
        part = [r for r in memory if r.id.endswith("/" + metric)]
        s = evidence.summary(part)
        print(f"  {metric:<15} {s['rows']} rows, median |error| {s['median_abs']:.2%}, worst {s['worst_abs']:.1%}, "
              f"under {s['under']:.0%}")
    print(f"wrong verdicts: {len(verdicts)} of {steps} steps predicted not to fit although they ran"
          + "".join(f"\n  {v['id']}: {v['verdict']} (error margin {v['error_margin'] / 2**30:.1f} GiB; measured "
                    f"process {v['measured_process'] / 2**30:.1f} GiB)" for v in verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
