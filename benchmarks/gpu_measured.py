"""The planner offline against what a real GPU measured: every single-GPU step our probes ran on a lent H100.

Rows come from benchmarks/data/gpu_measured_h100.json (copied from the committed gpu_validation results, each with
its source file and command). Each row is a run: its configuration is planned pinned, exactly as gpu_validation.py
plans it on the GPU (`planner.plan`, the HF Trainer's program through trainplan's files), and the plan's own
prediction is kept beside the measurement in a receipt (benchmarks/runs.py): peak allocated, peak reserved and
process memory (NVML), and the optimizer step (its micro-steps at the planned accumulation plus the optimizer step).
Several facts were fitted to these runs (their `fitted_to` names this file and the gpu_validation results), so they
are development evidence, computed (benchmarks/provenance.py), never assumed. A step the plan predicts not to fit
although it ran is a wrong verdict: its receipt says so and carries the plan's estimate of that very configuration.

Writes benchmarks/results/receipts/gpu_measured-H100-80GB.json (`python -m benchmarks.report` reads it).

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

from benchmarks import runs  # noqa: E402
from benchmarks.gpu_validation import pinned_fields  # noqa: E402
from planner.receipts import Device  # noqa: E402

DATA_FILE = "benchmarks/data/gpu_measured_h100.json"
DATA = ROOT / DATA_FILE
NVML_NAME = "NVIDIA H100 80GB HBM3"
COMMAND = "HF_HUB_OFFLINE=1 python benchmarks/gpu_measured.py"
METRIC = ("per run: torch.cuda.max_memory_allocated and max_memory_reserved, NVML per-process memory (what nvidia-smi "
          "shows), and seconds per optimizer step (its micro-steps at the planned accumulation plus the optimizer "
          "step, CUDA-synchronised wall clock)")
STACK = ("`planner.plan` pinned to each measured configuration (as gpu_validation.py plans it), offline; measured: "
         "the HF Trainer through trainplan's emitted files on a lent NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, "
         "transformers 5.23, driver 580), 3 micro-steps after warm-up")
CANNOT_SHOW = ("other GPUs or several GPUs, long runs (a few steps: no fragmentation over hours), real data "
               "(synthetic full-length batches), models beyond GPT-2, BLOOM-560m, Llama-3.2-1B and BERT-large; "
               "accuracy without fitted facts where a fact fitted to these runs is read")


def row_id(row: dict) -> str:
    return (f"{row['model'].split('/')[-1]}-s{row['seq_len']}-b{row['batch']}-{row['precision']}-"
            f"{row['checkpointing']}-mb{row['micro_batch']}")


def measured_step_s(row: dict) -> float:
    """The row's measured optimizer step: its micro-steps at the planned accumulation and the optimizer step."""
    return row["batch"] // row["micro_batch"] * row["micro_step_s"] + row["optimizer_step_s"]


def receipt(row: dict, gpu: str):
    """The run's receipt: the pinned plan's own prediction beside the measurement (its memory traced, as the plan
    traces what it may choose, also where it predicts the configuration not to fit)."""
    request = {"model": row["model"], "global_batch": row["batch"], "liger": "off", "memory_method": "trace",
               **pinned_fields(row["seq_len"], row["precision"], row["checkpointing"], row["micro_batch"], gpu)}
    step = measured_step_s(row)
    measured = {"peak_allocated": row["peak_allocated"], "peak_reserved": row["peak_reserved"],
                "peak_process": row["process_memory"], "step_time_s": step,
                "tokens_per_s": row["batch"] * row["seq_len"] / step}
    return runs.receipt_of(id=row_id(row), source=row["source"], data_file=DATA_FILE, request=request,
                           measured=measured, device=Device(kind="cuda", name=NVML_NAME, gpu=gpu, count=1),
                           note=f"{row['batch'] // row['micro_batch']} micro-steps of {row['micro_batch']}")


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    data = json.loads(DATA.read_text())
    gpu = data["gpu"]
    receipts = []
    for row in data["rows"]:
        found = receipt(row, gpu)
        receipts.append(found)
        errors = "  ".join(f"{q} {1 / found.ratio(q) - 1:+7.1%}" for q in ("peak_allocated", "peak_reserved",
                                                                          "peak_process", "step_time_s")
                           if found.ratio(q))
        print(f"{found.id:<52} {errors}{'  ' + found.note.split('; ')[-1] if 'yet it ran' in found.note else ''}",
              flush=True)
    path = runs.write(runs.Benchmark(name=f"gpu_measured-{gpu}", metric=METRIC, stack=STACK, cannot_show=CANNOT_SHOW,
                                     command=COMMAND, receipts=tuple(receipts)))
    print(f"{len(receipts)} runs -> {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
