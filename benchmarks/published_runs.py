"""Published training runs of HF model code against the plan pinned to each: step time and peak memory.

Rows come from benchmarks/data/published_runs.json (sources and caveats in published_runs_SOURCES.md): runs whose
every setting a plan pins (model, GPUs, precision, optimizer, micro-batch, accumulation, sequence, checkpointing,
attention, engine, Liger). Each is planned with `planner.plan` pinned to it, offline, and the plan's step time or
peak reserved memory (without the plan's margin) is compared with the published value. A published tokens/s per
GPU is compared as the step time it implies at the row's batch and sequence. A run the plan says cannot fit is
still judged on the estimate of that very configuration.

Scored in the commit that added the rows, so they are first-look (benchmarks/evidence.py keeps that first score).

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

from benchmarks import evidence  # noqa: E402
from planner.errors import InputError  # noqa: E402

DATA_FILE = "published_runs.json"
DATA = ROOT / "benchmarks" / "data" / DATA_FILE
COMMAND = "HF_HUB_OFFLINE=1 python benchmarks/published_runs.py"
STACK = ("`planner.plan` pinned to each published configuration, offline, installed stack; measured: the sources' "
         "own runs (HF Trainer via ms-swift and torchacc's run_clm.py; cuDNN frontend's own loop on HF Llama)")
CANNOT_SHOW = ("packing as the sources ran it (packed rows whose samples attend apart are planned as full rows), "
               "clocks other than the catalog's (cuDNN frontend's GPUs ran locked at base clock), the sources' "
               "library versions, memory tools the sources do not name")
GiB = 2**30


def pinned(row: dict):
    """The plan's candidate for the row's configuration (the rejected one where it is predicted not to fit)."""
    fields = dict(gpu=row["gpu"], gpus_per_node=row["gpus"] // row["nodes"], nodes=row["nodes"],
                  seq_len=row["seq_len"], micro_batch=row["micro_batch"], precision=row["precision"],
                  optimizer=row["optimizer"], checkpointing=row["checkpointing"], zero_stage=row["zero_stage"],
                  attention=row["attention"], offload=False, compile="off", liger="on" if row["liger"] else "off",
                  detect=False)
    if row["zero_stage"]:
        fields["engine"] = row["engine"]
    batch = row["micro_batch"] * row["grad_accum"] * row["gpus"]
    return evidence.pinned_choice(row["model"], batch, **fields)


def measured(row: dict) -> float:
    """The published value in the unit the prediction is in: seconds per step, or bytes."""
    if row["metric"] == "tokens_per_s_per_gpu":
        return row["micro_batch"] * row["grad_accum"] * row["seq_len"] / row["value"]
    if row["metric"] == "peak_reserved_gib":
        return row["value"] * GiB
    return float(row["value"])


def judged(row: dict) -> tuple[str, evidence.Row]:
    memory = row["metric"].startswith("peak")
    choice = pinned(row)  # once outside the recording: the prediction below reuses its caches
    group = evidence.run_group(row["program"], row["gpu"], choice.config, gpus_per_node=row["gpus"] // row["nodes"],
                               adapter=row["adapter"])
    note = "; ".join(filter(None, (row["caveat"], choice.reason if not choice.fits else "")))

    def predict():
        cand = pinned(row)
        return cand.memory.peak_reserved if memory else cand.throughput.step_time_s

    return ("memory" if memory else "throughput"), evidence.predicted_row(
        id=row["id"], data_file=DATA_FILE, source=row["source"], measured=measured(row), predict=predict,
        group=group, note=note)


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    rows: dict[str, list[evidence.Row]] = {"memory": [], "throughput": []}
    skipped = []
    for row in json.loads(DATA.read_text())["rows"]:
        try:
            kind, judged_row = judged(row)
        except InputError as err:
            skipped.append(f"{row['id']}: {err}")
            continue
        rows[kind].append(judged_row)
        print(f"{row['id']:55s} {kind}", flush=True)
    metrics = {"memory": "peak memory: the sources' max_memory_reserved (GiB as ms-swift logs it) against the plan's "
                         "peak_reserved, which holds no margin",
               "throughput": "seconds per optimizer step, published or implied by tokens/s per GPU at the row's "
                             "batch and sequence, against the plan's step time"}
    for kind, judged_rows in rows.items():
        path = evidence.write_results(f"published_runs-{kind}", judged_rows, kind=kind, metric=metrics[kind],
                                      stack=STACK, cannot_show=CANNOT_SHOW + (
                                          f"; skipped: {'; '.join(skipped)}" if skipped else ""), command=COMMAND)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
