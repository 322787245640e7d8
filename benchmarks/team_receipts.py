"""A team's receipts as evidence: every receipt.json copied into benchmarks/data/receipts/ (a run of the shipped
scripts, the Trainer callback, a probe), read as `plan` reads them (planner/receipts: a file that is not a believable
receipt is skipped and named), into benchmarks/results/receipts/team.json, which the report scores like every run.
Each keeps the prediction its plan made before it ran; its measurement was first written to its own file there.

    python -m benchmarks.team_receipts
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks import runs
from planner.receipts import read_receipts

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "benchmarks" / "data" / "receipts"
NAME = "team"


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if not FOLDER.is_dir():
        print(f"no {FOLDER.relative_to(ROOT)}: nothing written")
        return 0
    found = []
    for path in sorted(FOLDER.glob("*.json")):
        receipts, skipped = read_receipts([path], cache=False)
        for problem in skipped:
            print(f"skipped {problem.file}: {problem.why}")
        found += [r.model_copy(update={"data_file": str(path.relative_to(ROOT))}) for r in receipts
                  if r.device.kind == "cuda"]
    if not found:
        print(f"no GPU receipts in {FOLDER.relative_to(ROOT)}: nothing written")
        return 0
    path = runs.write(runs.Benchmark(
        name=NAME, metric="what each run's receipt measured (torch.cuda's peaks, NVML's process total, the median "
                          "optimizer step after its warm-up)",
        stack="the team's own runs, through plan.callback(), the shipped scripts or probes", receipts=tuple(found),
        cannot_show="what the runs did not measure; receipts of one configuration each",
        command="python -m benchmarks.team_receipts"))
    print(f"{len(found)} receipts -> {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
