"""Probe mechanics on the CPU device with tiny models: subprocess isolation, timeout, injected OOM, cache."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import transformers

import probes.runner as runner
from planner import plan
from planner.refine import MAX_PROBES_PER_FAMILY
from planner.types import Measurement
from probes import Prober, run_probe
from probes.protocol import ProbeRequest
from probes.worker import failure

FAULTS = (str(Path(__file__).with_name("probe_faults.py")),)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             vocab_size=300, architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    return str(folder)


def _request(tiny_dir, **kw):
    req = {"model_dir": tiny_dir, "config_hash": "tiny", "micro_batch": 2, "grad_accum": 2, "seq_len": 32,
           "precision": "fp32", "checkpointing": "none", "attention": "sdpa", "optimizer": "adamw", "device": "cpu",
           "warmup": 1, "steps": 1}
    req.update(kw)
    return ProbeRequest(**req)


def test_probe_measures_memory_and_time_in_a_subprocess(tiny_dir):
    result = run_probe(_request(tiny_dir), timeout_s=120)
    assert result.status == "ok", result
    assert result.peak_allocated > 0 and result.peak_reserved >= result.peak_allocated
    assert result.step_time_s > 0 and result.tokens_per_s > 0


def test_out_of_memory_error_is_an_oom_result():
    assert failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")).status == "oom"
    assert failure(RuntimeError("DefaultCPUAllocator: can't allocate memory: out of memory")).status == "oom"
    assert failure(ValueError("bad shape")).status == "error"


def test_injected_oom_is_a_result(tiny_dir):
    result = run_probe(_request(tiny_dir), timeout_s=120, worker=(*FAULTS, "oom"))
    assert result.status == "oom" and "injected" in result.reason


def test_crash_is_contained(tiny_dir):
    result = run_probe(_request(tiny_dir), timeout_s=120, worker=(*FAULTS, "crash"))
    assert result.status == "error" and "code 9" in result.reason
    assert run_probe(_request(tiny_dir), timeout_s=120).status == "ok"  # the next probe is unaffected


def test_hang_times_out_and_its_process_group_is_killed(tiny_dir):
    start = time.monotonic()
    result = run_probe(_request(tiny_dir), timeout_s=3, worker=(*FAULTS, "hang"))
    assert result.status == "timeout" and time.monotonic() - start < 30


def test_second_plan_runs_no_probe(tiny_dir, monkeypatch):
    first = plan(tiny_dir, 16, gpu="A100-80GB", seq_len=32, zero_stage=0, measure=Prober(device="cpu"),
                 probe_budget_s=120)
    assert first.probes and all(not r.measurement.cached for r in first.probes)
    assert first.choice.throughput.source == "probe" and first.choice.memory.method == "probe"

    def no_subprocess(*args, **kwargs):
        raise AssertionError("a probe ran although its result was cached")

    monkeypatch.setattr(runner, "run_probe", no_subprocess)
    second = plan(tiny_dir, 16, gpu="A100-80GB", seq_len=32, zero_stage=0, measure=Prober(device="cpu"),
                  probe_budget_s=120)
    assert second.probes and all(r.measurement.cached for r in second.probes)
    assert second.choice.config == first.choice.config


def test_deepspeed_candidate_is_probed_through_deepspeed(tiny_dir):
    pytest.importorskip("deepspeed")
    from planner.models import resolve_model
    from planner.refine import ProbeContext
    from planner.types import Config

    cfg = Config(micro_batch=2, grad_accum=4, world_size=1, precision="bf16-mixed", checkpointing="none",
                 zero_stage=2, offload="optimizer")
    context = ProbeContext(resolve_model(tiny_dir), 32, "adamw", "sdpa", "A100-80GB")
    result = Prober(device="cpu", timeout_s=600, use_cache=False)(context, cfg)
    assert result.status == "ok" and result.engine == "deepspeed", result
    assert result.step_time_s > 0 and result.peak_allocated > 0
    skipped = Prober(device="cpu")(context, cfg.model_copy(update={"world_size": 8, "grad_accum": 1}))
    assert skipped.status == "skipped" and "modelled only" in skipped.reason


def test_oom_walks_down_with_few_probes(tiny_dir):
    calls = []

    def measure(context, cfg, timeout_s):
        calls.append(cfg)
        if cfg.micro_batch > 4:
            return Measurement(status="oom")
        return Measurement(status="ok", peak_allocated=10_000_000, peak_reserved=12_000_000, step_time_s=1.0,
                           tokens_per_s=cfg.micro_batch * cfg.grad_accum * 32.0)

    p = plan(tiny_dir, 16, gpu="A100-80GB", seq_len=32, precision="fp32", checkpointing="none", zero_stage=0,
             measure=measure)
    assert 1 < len(calls) <= MAX_PROBES_PER_FAMILY  # one family here: at most 3 probes to find its micro-batch
    assert p.choice.config.micro_batch == 4 and p.choice.throughput.source == "probe"  # 16 OOM, 8 OOM, 4 fits
    oomed = [c for c in p.candidates if c.reason == "OOM in a probe (measured)"]
    assert oomed and all(not c.fits for c in oomed)


def test_probes_calibrate_the_unprobed_candidates_of_their_family(tiny_dir):
    def measure(context, cfg, timeout_s):  # the GPU holds 3x the predicted activations and leaves 10% slack
        mem = next(c.memory for c in base.candidates if c.config == cfg)
        allocated = mem.peak_allocated + 2 * mem.activations
        return Measurement(status="ok", peak_allocated=allocated, peak_reserved=int(allocated * 1.1), step_time_s=1.0,
                           tokens_per_s=1.0)

    kw = dict(gpu="A100-80GB", seq_len=32, precision="fp32", checkpointing="none", zero_stage=0)
    base = plan(tiny_dir, 16, **kw)
    p = plan(tiny_dir, 16, measure=measure, **kw)
    family = "fp32 / none / 0 / none / torch"
    assert p.calibration[family].activation_ratio == pytest.approx(3.0, rel=0.01)
    calibrated = [c for c in p.candidates if c.memory.method == "probe-calibrated"]
    assert calibrated
    for c in calibrated:
        before = next(b.memory for b in base.candidates if b.config == c.config)
        assert c.memory.activations == pytest.approx(3 * before.activations, rel=0.01)
    assert p.to_json()["calibration"] == {k: v.model_dump() for k, v in p.calibration.items()}


def test_cli_refuses_probe_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from typer.testing import CliRunner

    from planner.cli import app

    result = CliRunner().invoke(app, ["--model", "gpt2", "--batch", "8", "--probe"])
    assert result.exit_code == 2 and "--probe" in result.output


@pytest.mark.gpu
def test_probe_on_the_gpu(tiny_dir):
    result = run_probe(_request(tiny_dir, device="cuda", precision="bf16-mixed"), timeout_s=300)
    assert result.status == "ok" and result.peak_reserved >= result.peak_allocated > 0


def test_probe_budget_is_a_hard_limit(tiny_dir):
    """A probe still running when the budget ends is stopped (its process group killed), and no new one starts."""
    start = time.monotonic()
    p = plan(tiny_dir, 16, gpu="A100-80GB", seq_len=32, zero_stage=0,
             measure=Prober(device="cpu", use_cache=False, worker=(*FAULTS, "hang")), probe_budget_s=6)
    elapsed = time.monotonic() - start
    assert [r.measurement.status for r in p.probes] == ["timeout"]
    assert elapsed < 6 + 20, elapsed  # the budget plus planning, not the hang's hour
    assert p.choice.throughput.source == "model"
