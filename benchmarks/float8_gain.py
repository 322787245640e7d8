"""Published float8 speed-ups against the planner's: each source's bf16 and float8 runs of one configuration.

Rows come from benchmarks/data/float8_published.json. Each configuration is planned with `planner.plan` pinned to it
(micro-batch, checkpointing, FSDP2, compiled) twice, in bf16-mixed and in fp8, offline; the row compares the
predicted speed-up (fp8 tokens/s over bf16-mixed tokens/s) with the published one. A configuration the plan says
cannot fit is still judged on the estimate of that very configuration.

Run:  HF_HUB_OFFLINE=1 python benchmarks/float8_gain.py
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

NAME = "float8_gain"
DATA_FILE = "float8_published.json"
COMMAND = "HF_HUB_OFFLINE=1 python benchmarks/float8_gain.py"


def pinned(row: dict, precision: str):
    """The plan's candidate for the row's configuration in `precision` (the rejected one where it does not fit)."""
    fields = dict(gpu=row["gpu"], gpus_per_node=row["gpus"], seq_len=row["seq_len"], micro_batch=row["micro_batch"],
                  precision=precision, checkpointing=row["checkpointing"], zero_stage=row["zero_stage"],
                  engine=row["engine"], compile="on" if row["compiled"] else "off", liger="off", detect=False)
    return evidence.pinned_choice(row["model"], row["micro_batch"] * row["gpus"], **fields)


def judged(row: dict) -> evidence.Row:
    def speedup() -> float:
        bf16, fp8 = (pinned(row, p) for p in ("bf16-mixed", "fp8"))
        return fp8.throughput.tokens_per_s / bf16.throughput.tokens_per_s

    cfg = pinned(row, "fp8").config
    return evidence.predicted_row(
        id=row["id"], data_file=DATA_FILE, source=row["source"],
        measured=row["float8_tokens_per_s"] / row["bf16_tokens_per_s"], predict=speedup,
        group=evidence.run_group("optimised", row["gpu"], cfg, gpus_per_node=row["gpus"]), note=row["model_note"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=evidence.RESULTS, help="the results folder")
    args = parser.parse_args()
    rows = [judged(row) for row in json.loads((evidence.DATA / DATA_FILE).read_text())["rows"]]
    args.out.mkdir(parents=True, exist_ok=True)
    evidence.write_results(
        NAME, rows, kind="other", command=COMMAND, out=args.out / f"{NAME}.json",
        metric="float8 over bf16 tokens/s of one configuration (a speed-up), published against predicted",
        stack="planner.plan pinned to each configuration in bf16-mixed and fp8 (torchao tensorwise through "
              "accelerate's AO backend), offline, installed stack; measured: torchao's and torchtitan's own runs",
        cannot_show="torchtitan's program (its own Llama, not HF model code) and its 500 W HBM2e H100s: the speed-up "
                    "cancels most of what the absolute speeds would carry")
    for r in rows:
        print(f"{r.id:48s} measured {r.measured:6.3f}x predicted {r.predicted:6.3f}x {r.error:+7.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
