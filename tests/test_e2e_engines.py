"""Run what we emit: for each engine, `plan --emit` then `accelerate launch` the shipped training script with those
files on the CPU; the planned micro-batch and accumulation are what ran, the loss is finite, and each rank's measured
peak is compared with `estimate_memory(device="cpu")` (benchmarks/engine_memory_cpu.py runs the same cases and
records them in benchmarks/results/engine_memory_cpu.json)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
_SPEC = importlib.util.spec_from_file_location(
    "engine_memory_cpu", Path(__file__).resolve().parents[1] / "benchmarks" / "engine_memory_cpu.py")
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)

#: predicted / measured - 1 allowed per case. Within 5% where the engine's buffers are modelled from its source;
#: ZeRO-2 with optimizer offload keeps ~2 B/param more on the host than modelled (-8.1% measured); FSDP2 is
#: over-estimated (+20% measured, on the safe side): the trace's 16-bit model and gradients outlive what FSDP2's
#: per-block gathering keeps, which the model does not yet follow.
BOUNDS = {"zero2-offload-optimizer": (-0.09, 0.05), "fsdp2-full-shard": (0.0, 0.30)}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return bench.tiny_model(tmp_path_factory.mktemp("model"))


@pytest.mark.parametrize("case", bench.CASES)
def test_emitted_files_train_as_planned(case, model, tmp_path):
    row = bench.run_case(case, model, tmp_path)
    assert row["status"] == "ok", row["reason"]
    assert row["processes"] == row["world_size"]
    assert (row["ran_micro_batch"], row["ran_grad_accum"]) == (row["micro_batch"], row["grad_accum"])
    assert len(row["losses"]) == 3 and all(math.isfinite(x) for x in row["losses"])
    low, high = BOUNDS.get(case, (-0.05, 0.05))
    assert low <= row["error"] <= high, row
