"""Run a Python script under the live-storage tracker and report the peak: `python tests/tracked_run.py SCRIPT
ARGS...` prints `PEAK <bytes> <dtype of the first parameter>` last (for tests; the script itself is unchanged)."""

import runpy
import sys

import torch

from planner.program.tracker import LiveStorageTracker

tracker = LiveStorageTracker()
script, sys.argv = sys.argv[1], sys.argv[1:]
with tracker:
    scope = runpy.run_path(script, run_name="__main__")
model = scope["trainer"].model
print(f"PEAK {tracker.peak} {next(model.parameters()).dtype}", flush=True)
