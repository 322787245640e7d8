"""Published training runs of HF model code against the plan pinned to each: step time and peak memory, as receipts.

Rows come from benchmarks/data/published_runs.json (sources and caveats in published_runs_SOURCES.md): runs whose
every setting a plan pins (model, GPUs, precision, optimizer, micro-batch, accumulation, sequence, checkpointing,
attention, engine, Liger). Each is a receipt (benchmarks/runs.py): the run planned with `planner.plan` pinned to it,
offline, and the plan's own prediction beside the published figure (a tokens/s per GPU as the step time it implies at
the row's batch and sequence; a memory figure as the metric the source names). A run the plan says cannot fit is
still judged on the estimate of that very configuration.

Scored in the commit that added the rows, so they are first-look (benchmarks/provenance.py computes it; the receipts
keep that first prediction).

Run:  HF_HUB_OFFLINE=1 python benchmarks/published_runs.py
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
from planner.errors import InputError  # noqa: E402

DATA_FILE = "benchmarks/data/published_runs.json"
DATA = ROOT / DATA_FILE
NAME = "published_runs"
COMMAND = "HF_HUB_OFFLINE=1 python benchmarks/published_runs.py"
METRIC = ("per run, as its source publishes it: seconds per optimizer step (or the step a tokens/s per GPU implies at "
          "the row's batch and sequence), or max_memory_reserved (GiB as ms-swift logs it)")
STACK = ("`planner.plan` pinned to each published configuration, offline, installed stack; measured: the sources' "
         "own runs (HF Trainer via ms-swift and torchacc's run_clm.py; cuDNN frontend's own loop on HF Llama)")
CANNOT_SHOW = ("packing as the sources ran it (packed rows whose samples attend apart are planned as full rows), "
               "clocks other than the catalog's (cuDNN frontend's GPUs ran locked at base clock), the sources' "
               "library versions, memory tools the sources do not name")
GiB = 2**30


def request_of(row: dict) -> dict:
    """`planner.plan`'s keywords pinning the row's configuration."""
    fields = dict(gpu=row["gpu"], gpus_per_node=row["gpus"] // row["nodes"], nodes=row["nodes"],
                  seq_len=row["seq_len"], micro_batch=row["micro_batch"], precision=row["precision"],
                  optimizer=row["optimizer"], checkpointing=row["checkpointing"], zero_stage=row["zero_stage"],
                  attention=row["attention"], offload="none", compile="off", liger="on" if row["liger"] else "off",
                  tensor_parallel="off", context_parallel="off", sequence_parallel="off")
    if row["zero_stage"]:
        fields["engine"] = row["engine"]
    if row["adapter"] != "none":
        fields["peft"] = row["adapter"]
    return {"model": row["model"], "global_batch": row["micro_batch"] * row["grad_accum"] * row["gpus"], **fields}


def measured(row: dict) -> dict:
    """The published value as the receipt's figure: a step time, or the memory metric the source names."""
    if row["metric"] == "tokens_per_s_per_gpu":
        return {"step_time_s": row["micro_batch"] * row["grad_accum"] * row["seq_len"] / row["value"],
                "tokens_per_s": row["value"] * row["gpus"]}
    if row["metric"] == "peak_reserved_gib":
        return {"peak_reserved": row["value"] * GiB}
    return {"step_time_s": float(row["value"])}


def receipt(row: dict):
    return runs.receipt_of(id=row["id"], source=row["source"], data_file=DATA_FILE, request=request_of(row),
                           measured=measured(row), device=runs.published_device(row["gpu"], row["gpus"]),
                           program=row["program"], note=row["caveat"])


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    receipts, skipped = [], []
    for row in json.loads(DATA.read_text())["rows"]:
        try:
            receipts.append(receipt(row))
        except InputError as err:
            skipped.append(f"{row['id']}: {err}")
            continue
        print(f"{row['id']:55s} {row['metric']}", flush=True)
    path = runs.write(runs.Benchmark(name=NAME, metric=METRIC, stack=STACK, command=COMMAND, receipts=tuple(receipts),
                                     cannot_show=CANNOT_SHOW + (f"; skipped: {'; '.join(skipped)}" if skipped else "")))
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
