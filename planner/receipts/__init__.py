"""Receipts: every measured run as one record (receipt.json, schema 2): what ran, where, the prediction made before it
and what it measured (docs/receipts.md). `Meter` takes one during a run, `read_receipts` reads them back; the next plan
(planner/calibration.py) and the accuracy report (benchmarks/report.py) read nothing else."""

from planner.receipts.meter import (
    CACHE_KIND, CHECK_AFTER, DEFAULT_WARMUP, RECEIPT, Meter, StepClock, StepTime, check, device, host_peak,
    prediction, process_memory, run_plan, versions,
)
from planner.receipts.schema import (
    MEMORY_FIGURES, RATIO_RANGE, READS, SCHEMA, STEP_TIME, Device, Figures, Hardware, Prediction, Receipt, RunPlan,
    parse,
)
from planner.receipts.source import planner_tree, planner_version, tree_hash
from planner.receipts.store import Skipped, read_receipts, receipt_files

__all__ = ["CACHE_KIND", "CHECK_AFTER", "DEFAULT_WARMUP", "Device", "Figures", "Hardware", "MEMORY_FIGURES", "Meter",
           "Prediction", "RATIO_RANGE", "READS", "RECEIPT", "Receipt", "RunPlan", "SCHEMA", "STEP_TIME", "Skipped",
           "StepClock", "StepTime", "check", "device", "host_peak", "parse", "planner_tree", "prediction",
           "planner_version", "process_memory", "read_receipts", "receipt_files", "run_plan", "tree_hash", "versions"]
