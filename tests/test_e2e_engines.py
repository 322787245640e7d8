"""Run what we emit: for each engine, `plan --emit` then `accelerate launch` the shipped training script with those
files on the CPU; the planned micro-batch and accumulation are what ran, the loss is finite, and each rank's measured
peak is compared with `estimate_memory(device="cpu")` (benchmarks/engine_memory_cpu.py runs the same cases and
records them in benchmarks/results/engine_memory_cpu.json). And the shipped script's first contact: a plan that cannot
fit this machine is refused at once, naming both numbers (`--force` runs it anyway); `--help` says what it does."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "engine_memory_cpu", Path(__file__).resolve().parents[1] / "benchmarks" / "engine_memory_cpu.py")
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)

#: Cases whose estimate is further from the measured peak than `allowed_error` allows: product defects in
#: planner/memory, each its own strict xfail, so that a fix shows (the case passes, which strict xfail reports). A
#: defect may shrink but not grow: its miss must stay within what benchmarks/results/engine_memory_cpu.json recorded,
#: to this comparison's resolution (a larger miss fails the test outright). (Figures: that file.)
KNOWN_OUTSIDE = {
    "zero2-offload-optimizer": "ZeRO-2 with optimizer offload keeps ~2.9 B per parameter more than modelled (measured "
                               "3.98 MB, predicted 3.66 MB): an unmodelled host-side copy of the gradients or weights",
    "zero3-offload-params": "ZeRO-3 with parameter offload keeps ~1.5 B per parameter more than modelled (measured "
                            "3.46 MB, predicted 3.29 MB)",
    "fsdp2-full-shard": "FSDP2 is over-estimated by ~6 B per parameter of a rank's shard (measured 1.91 MB, predicted "
                        "2.25 MB): the trace's 16-bit model and gradients outlive what FSDP2's per-block gathering "
                        "keeps, which the model does not yet follow",
}
RECORDED = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "engine_memory_cpu.json"


class KnownMiss(Exception):
    """A listed defect still outside the allowed error, by no more than it was recorded: the expected failure."""


def _recorded_miss(case: str) -> int:
    row = next(r for r in json.loads(RECORDED.read_text())["rows"] if r["case"] == case)
    return abs(row["predicted_peak"] - row["measured_peak"])


CASES = [pytest.param(case, marks=pytest.mark.xfail(strict=True, raises=KnownMiss, reason=KNOWN_OUTSIDE[case]))
         if case in KNOWN_OUTSIDE else case for case in bench.CASES]
#: A predicted peak no machine has: 1 PiB.
HUGE = 2**50


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return bench.tiny_model(tmp_path_factory.mktemp("model"))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.long
def test_emitted_files_train_as_planned(case, model, tmp_path):
    pytest.importorskip("deepspeed")
    row = bench.run_case(case, model, tmp_path)
    assert row["status"] == "ok", row["reason"]
    assert row["processes"] == row["world_size"]
    assert (row["ran_micro_batch"], row["ran_grad_accum"]) == (row["micro_batch"], row["grad_accum"])
    assert len(row["losses"]) == 3 and all(math.isfinite(x) for x in row["losses"])
    allowed = allowed_error(case, model, row["world_size"])
    off = row["predicted_peak"] - row["measured_peak"]
    if case in KNOWN_OUTSIDE:
        # grown by a whole mis-counted copy: more than the resolution `allowed_error` gives this comparison (a
        # multi-rank run's peak varies between runs by less: FSDP2's two ranks, 1,872,458 or 1,910,986 B)
        recorded = _recorded_miss(case)
        assert abs(off) <= recorded + allowed, f"{case}: the known miss grew from {recorded} B to {abs(off)} B"
        if abs(off) > allowed:
            raise KnownMiss(f"{case}: {off:+} B, outside {allowed} B ({KNOWN_OUTSIDE[case]})")
    assert abs(off) <= allowed, f"{case}: predicted {row['predicted_peak']} B, measured {row['measured_peak']} B"


def allowed_error(case: str, model: Path, world_size: int) -> int:
    """Bytes an estimate may be off on the CPU: half of a 16-bit copy of one rank's share of the weights (2 B x
    parameters / world / 2). Such a copy is the smallest state these engines keep or drop (a bf16 weight or gradient
    partition, DeepSpeed's and FSDP2's 16-bit shards): an error under half of one says no copy was mis-counted, one
    over half says one may have been. Nothing else is allowed for: on the CPU the measured peak is exact to the byte
    (the live-storage tracker counts every tensor storage the run's ops create, as the trace behind the estimate
    does) and holds none of what a GPU adds (the caching allocator's rounding and slack, the CUDA context, NCCL's
    buffers), which estimate_memory(device="cpu") leaves out too. The parameters are transformers' own count of the
    model the case trains (its head; LoRA's frozen base)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(model)
    flags = bench.CASES[case]
    with torch.device("meta"):
        if "seq-cls" in flags:
            config.num_labels = int(flags[flags.index("--num-labels") + 1])
            built = transformers.AutoModelForSequenceClassification.from_config(config)
        else:
            built = transformers.AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for p in built.parameters())
    return parameters // world_size


def test_the_allowed_error_is_half_a_16_bit_copy_of_a_ranks_weights(model):
    # the tiny Llama by hand: embeddings and LM head 2 x 300 x 64; per block q 64x64, k and v 64x32, o 64x64, MLP
    # 3 x 64x128, 2 norms of 64; a final norm of 64: 38,400 + 2 x 36,992 + 64 = 112,448 parameters
    assert allowed_error("single", model, 1) == 112_448
    assert allowed_error("fsdp2-full-shard", model, 2) == 112_448 // 2
    # the classifier's head is 3 x 64 instead of the LM head's 300 x 64
    assert allowed_error("lora-ddp-classifier", model, 2) == (112_448 - 300 * 64 + 3 * 64) // 2


def _train(folder: Path, *flags: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "probes.train", "--plan", str(folder), *flags],  # noqa: S603
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return done, time.monotonic() - start


@pytest.fixture
def huge_plan(model, tmp_path):
    """A one-process plan of the tiny model whose plan.json predicts a peak of 1 PiB."""
    from emit import emit
    from planner import plan

    p = plan(str(model), 8, gpu="A100-80GB", gpus_per_node=1, zero_stage=0, micro_batch=2, seq_len=bench.SEQ_LEN,
             precision="bf16-mixed", detect=False)
    emit(p, tmp_path / "run")
    data = json.loads((tmp_path / "run" / "plan.json").read_text())
    data["memory"].update(peak=HUGE, peak_allocated=HUGE, terms={**data["memory"]["terms"], "cuda_context": 0})
    (tmp_path / "run" / "plan.json").write_text(json.dumps(data))
    return tmp_path / "run"


def test_a_plan_that_cannot_fit_is_refused_at_once(huge_plan):
    from probes.train import NO_FIT, available_ram

    done, seconds = _train(huge_plan)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == NO_FIT and seconds < 20, (done.returncode, seconds, done.stderr[-2000:])
    assert len(lines) == 1 and "--force" in lines[0] and not done.stdout, done.stderr
    assert f"needs {HUGE / 2**30:.1f} GiB" in lines[0]  # the plan's number
    has = re.search(r"has (\d+\.\d) GiB", lines[0])  # and this machine's
    import torch

    if not torch.cuda.is_available():
        assert has and abs(float(has.group(1)) - available_ram() / 2**30) < 2.0, lines[0]


def test_on_a_gpu_the_peak_is_compared_with_its_free_memory(monkeypatch):
    import torch

    from probes.train import memory_refusal

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    data = {"memory": {"peak": 21 * gib, "peak_allocated": 15 * gib, "terms": {"cuda_context": gib}},
            "hardware": {"gpu": "A100-80GB"}, "model": {"name": "m", "seq_len": 512}, "choice": {"micro_batch": 1}}
    line = memory_refusal(data)  # the context is counted once: it exists when the free memory is read
    assert "needs 20.0 GiB per GPU" in line and "has 10.0 GiB free" in line and "--micro-batch" not in line
    data["memory"]["peak"] = 11 * gib
    assert memory_refusal(data) is None


@pytest.mark.slow
def test_force_runs_the_plan_anyway_and_reports_each_step(huge_plan):
    done, _ = _train(huge_plan, "--force", "--steps", "2")  # the default warm-up step is one of the two
    assert done.returncode == 0, done.stderr[-3000:]
    assert '"status":"ok"' in done.stdout and "{'loss'" not in done.stdout  # the Trainer's log dicts are gone
    progress = [ln for ln in done.stderr.splitlines() if ln.startswith("step ")]
    assert [ln.split("  ")[0] for ln in progress] == ["step 1/2", "step 2/2"], done.stderr[-2000:]
    result = json.loads(done.stdout.split("PROBE-RESULT ", 1)[1])
    assert len(result["losses"]) == 2


def test_the_warm_up_is_counted_inside_steps_and_one_step_is_always_measured():
    from probes.train import parse_args

    assert (parse_args(["--plan", "p"]).steps, parse_args(["--plan", "p"]).warmup) == (3, 1)
    assert parse_args(["--plan", "p", "--steps", "2"]).warmup == 1
    assert parse_args(["--plan", "p", "--steps", "1"]).warmup == 0
    assert parse_args(["--plan", "p", "--steps", "4", "--warmup", "9"]).warmup == 3


def test_help_is_a_whole_sentence():
    from probes.train import DESCRIPTION

    done = subprocess.run([sys.executable, "-m", "probes.train", "--help"], capture_output=True, text=True,  # noqa: S603
                          timeout=120)
    assert done.returncode == 0
    assert DESCRIPTION.endswith(".") and " ".join(DESCRIPTION.split()) in " ".join(done.stdout.split())
