"""Published runs of sequences split across GPUs (context parallelism) against the plan pinned to each.

Rows come from benchmarks/data/sequence_split_published.json: torchtitan doubles the sequence with the split, so each
rank's share stays the same; each configuration is planned with `planner.plan` pinned to it (split, micro-batch,
precision, checkpointing, FSDP2, compiled), offline, and its tokens/s per GPU and peak reserved memory (without the
plan's margin) are compared with the published ones. A configuration the plan says cannot fit is still judged on the
estimate of that very configuration.

Run:  HF_HUB_OFFLINE=1 python benchmarks/sequence_split.py
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

NAME = "sequence_split"
DATA_FILE = "sequence_split_published.json"
COMMAND = "HF_HUB_OFFLINE=1 python benchmarks/sequence_split.py"
GiB = 2**30


def pinned(row: dict, common: dict):
    """The plan's candidate for the row's configuration (the rejected one where it does not fit)."""
    fields = dict(gpu=common["gpu"], gpus_per_node=common["gpus"], seq_len=row["seq_len"],
                  micro_batch=common["micro_batch"], precision=common["precision"],
                  checkpointing=common["checkpointing"], zero_stage=common["zero_stage"], engine=common["engine"],
                  offload=False, compile="on" if common["compiled"] else "off", liger="off", detect=False,
                  context_parallel=row["cp"] if row["cp"] > 1 else "off")
    return evidence.pinned_choice(common["model"], common["micro_batch"] * common["gpus"] // row["cp"], **fields)


def judged(row: dict, common: dict) -> list[evidence.Row]:
    choice = pinned(row, common)
    group = evidence.run_group("optimised", common["gpu"], choice.config, gpus_per_node=common["gpus"])
    speed = evidence.predicted_row(
        id=f"{row['id']}/speed", data_file=DATA_FILE, source=common["source"], measured=row["tokens_per_s_per_gpu"],
        predict=lambda: pinned(row, common).throughput.tokens_per_s / common["gpus"], group=group,
        note=common["caveat"])
    memory = evidence.predicted_row(
        id=f"{row['id']}/memory", data_file=DATA_FILE, source=common["source"], measured=row["memory_gib"] * GiB,
        predict=lambda: pinned(row, common).memory.peak_reserved, group=group, note=common["caveat"])
    return [speed, memory]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=evidence.RESULTS, help="the results folder")
    args = parser.parse_args()
    data = json.loads((evidence.DATA / DATA_FILE).read_text())
    rows = [r for row in data["rows"] for r in judged(row, data["common"])]
    args.out.mkdir(parents=True, exist_ok=True)
    evidence.write_results(
        NAME, rows, kind="other", command=COMMAND, out=args.out / f"{NAME}.json",
        metric="tokens/s per GPU (/speed) and peak memory per GPU (/memory, predicted: peak reserved) of a run whose "
               "sequences are split by ring attention",
        stack="planner.plan pinned to each configuration (context parallelism under FSDP2, fp8, compiled, full "
              "checkpointing), offline, installed stack; measured: torchtitan's own runs",
        cannot_show="torchtitan's program (its own Llama and loop, not HF model code under the Trainer) and its 500 W "
                    "HBM2e H100s; what torchtitan's memory column counts")
    for r in rows:
        print(f"{r.id:48s} measured {r.measured:12.6g} predicted {r.predicted:12.6g} {r.error:+7.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
