"""Planning time against the import floor, cold cache: the budget is 1.5x (`BUDGET`).

The floor is a fresh interpreter importing what a plan cannot do without (torch, transformers, accelerate and the
model's code) and exiting; the plan is the `plan` command on a fresh, empty trace cache (TRAINPLAN_CACHE), its
output discarded. The two alternate, `--runs` times each, and the medians are compared. `--workers 1` plans with
the traces run one by one (planner/program/forked.py).

    python benchmarks/plan_speed.py                       # Llama-3.1-70B, batch 512, 8 x 8 H100
    python benchmarks/plan_speed.py --runs 3 --workers 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from planner.program.forked import usable_cores

FLOOR = ("import torch, transformers, accelerate; from transformers import LlamaForCausalLM; "
         "import transformers.models.llama.modeling_llama")
BUDGET = 1.5
PLAN = ["--model", "meta-llama/Llama-3.1-70B", "--batch", "512", "--gpu", "H100-80GB", "--gpus-per-node", "8",
        "--nodes", "8"]


def timed(command: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workers", type=int, default=None, help="TRAINPLAN_TRACE_WORKERS for the plan runs")
    parser.add_argument("--out", type=Path, default=None, help="default: results/plan_speed[-workersN].json")
    args = parser.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if args.workers is not None:
        env["TRAINPLAN_TRACE_WORKERS"] = str(args.workers)
    floors, plans = [], []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="trainplan-cold-") as cache:
            plans.append(timed([sys.executable, "-m", "planner.cli", *PLAN], {**env, "TRAINPLAN_CACHE": cache}))
        floors.append(timed([sys.executable, "-c", FLOOR], env))
        print(f"run {run + 1}/{args.runs}: plan {plans[-1]:.2f} s, floor {floors[-1]:.2f} s", file=sys.stderr)
    plan, floor = statistics.median(plans), statistics.median(floors)
    result = {"command": "plan " + " ".join(PLAN), "cores": usable_cores(),
              "trace_workers": args.workers, "plan_s": plans, "floor_s": floors, "plan_median_s": plan,
              "floor_median_s": floor, "ratio": plan / floor, "budget": BUDGET}
    print(f"plan {plan:.2f} s / import floor {floor:.2f} s = {plan / floor:.2f}x (median of {args.runs}; budget {BUDGET}x)")
    out = args.out or Path(__file__).parent / "results" / (
        "plan_speed.json" if args.workers is None else f"plan_speed-workers{args.workers}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
