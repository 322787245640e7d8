"""Probes on the CPU with tiny models: the shipped training script under each candidate's emitted files, process
groups, timeouts, OOM as a result, the cache, the guided walk and calibration."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
import transformers

import probes.runner as runner
from planner import plan
from planner.models import resolve_model
from planner.refine import MAX_PROBES_PER_FAMILY, ProbeContext
from planner.types import Measurement
from probes import Prober
from probes.measure import failure

FAULTS = (str(Path(__file__).with_name("probe_faults.py")),)
A100 = "A100-80GB"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             vocab_size=300, max_position_embeddings=128,
                             architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    return str(folder)


def _context(tiny_dir, draft):
    return ProbeContext(resolve_model(tiny_dir), 32, "adamw", "sdpa", A100, draft)


def test_probe_runs_the_training_script_under_the_candidates_files(tiny_dir):
    draft = plan(tiny_dir, 8, gpu=A100, seq_len=32, zero_stage=0, micro_batch=2)
    result = Prober(device="cpu", use_cache=False)(_context(tiny_dir, draft), draft.choice.config)
    assert result.status == "ok", result
    assert result.peak_allocated > 0 and result.peak_reserved >= result.peak_allocated
    assert result.step_time_s > 0 and result.tokens_per_s > 0 and result.engine == "torch"
    assert len(result.losses) == 3 and all(math.isfinite(x) for x in result.losses)


def test_out_of_memory_error_is_an_oom_result():
    assert failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")).status == "oom"
    assert failure(RuntimeError("DefaultCPUAllocator: can't allocate memory: out of memory")).status == "oom"
    assert failure(ValueError("bad shape")).status == "error"


@pytest.mark.parametrize("mode,status", [("oom", "oom"), ("crash", "error")])
def test_a_failing_run_is_a_result(tiny_dir, mode, status):
    draft = plan(tiny_dir, 8, gpu=A100, seq_len=32, zero_stage=0, micro_batch=2)
    prober = Prober(device="cpu", use_cache=False, script=(*FAULTS, mode))
    result = prober(_context(tiny_dir, draft), draft.choice.config)
    assert result.status == status, result


@pytest.mark.long
def test_hang_times_out_and_its_process_group_is_killed(tiny_dir):
    draft = plan(tiny_dir, 8, gpu=A100, seq_len=32, zero_stage=0, micro_batch=2)
    start = time.monotonic()
    prober = Prober(device="cpu", use_cache=False, timeout_s=8, script=(*FAULTS, "hang"))
    result = prober(_context(tiny_dir, draft), draft.choice.config)
    assert result.status == "timeout" and result.budget_s == pytest.approx(8, abs=1)
    assert time.monotonic() - start < 30


def test_second_plan_runs_no_probe(tiny_dir, monkeypatch):
    kw = dict(gpu=A100, seq_len=32, zero_stage=0, checkpointing="none", precision="bf16-mixed")
    first = plan(tiny_dir, 16, measure=Prober(device="cpu"), probe_budget_s=300, **kw)
    assert first.probes and all(not r.measurement.cached for r in first.probes)
    assert first.choice.throughput.source == "probe" and first.choice.memory.method == "probe"

    def no_run(*args, **kwargs):
        raise AssertionError("a probe ran although its result was cached")

    monkeypatch.setattr(runner, "run_training", no_run)
    second = plan(tiny_dir, 16, measure=Prober(device="cpu"), probe_budget_s=300, **kw)
    assert second.probes and all(r.measurement.cached for r in second.probes)
    assert second.choice.config == first.choice.config


@pytest.mark.long
def test_deepspeed_candidate_is_probed_through_deepspeed(tiny_dir):
    pytest.importorskip("deepspeed")
    draft = plan(tiny_dir, 8, gpu=A100, seq_len=32, zero_stage=2, micro_batch=2, offload="optimizer")
    result = Prober(device="cpu", use_cache=False, timeout_s=600)(_context(tiny_dir, draft), draft.choice.config)
    assert result.status == "ok" and result.engine == "deepspeed", result
    assert result.step_time_s > 0 and result.peak_allocated > 0


def test_candidate_wider_than_the_node_is_measured_with_the_ranks_there_plus_the_model(tiny_dir):
    """A DDP candidate on 8 GPUs, probed where 2 processes run: its peak is the measured rank plus the modelled
    difference between 8-way and 2-way (labelled probe+model)."""
    p = plan(tiny_dir, 32, gpu=A100, gpus_per_node=8, seq_len=32, zero_stage=0, precision="bf16-mixed",
             checkpointing="none", micro_batch=2, measure=Prober(device="cpu", use_cache=False), probe_budget_s=300)
    probed = [c for c in p.candidates if c.throughput.source != "model"]
    assert probed and all(c.throughput.source == "probe+model" for c in probed)
    assert all(r.measurement.processes == 2 for r in p.probes)


def test_oom_walks_down_with_few_probes(tiny_dir):
    calls = []

    def measure(context, cfg, timeout_s):
        calls.append(cfg)
        if cfg.micro_batch > 4:
            return Measurement(status="oom")
        return Measurement(status="ok", peak_allocated=10_000_000, peak_reserved=12_000_000, step_time_s=1.0,
                           tokens_per_s=cfg.micro_batch * cfg.grad_accum * 32.0)

    p = plan(tiny_dir, 16, gpu=A100, seq_len=32, precision="fp32", checkpointing="none", zero_stage=0,
             measure=measure)
    assert 1 < len(calls) <= MAX_PROBES_PER_FAMILY  # one family here: at most 3 probes to find its micro-batch
    assert p.choice.config.micro_batch == 4 and p.choice.throughput.source == "probe"  # 16 OOM, 8 OOM, 4 fits
    oomed = [c for c in p.candidates if c.verdict.kind == "probe-oom"]
    assert oomed and all(not c.fits for c in oomed)


def test_probes_calibrate_the_unprobed_candidates_of_their_family(tiny_dir):
    def measure(context, cfg, timeout_s):  # the GPU holds 3x the predicted activations and leaves 10% slack
        mem = next(c.memory for c in base.candidates if c.config == cfg)
        allocated = mem.peak_allocated + 2 * mem.activations
        return Measurement(status="ok", peak_allocated=allocated, peak_reserved=int(allocated * 1.1), step_time_s=1.0,
                           tokens_per_s=1.0)

    kw = dict(gpu=A100, seq_len=32, precision="fp32", checkpointing="none", zero_stage=0)
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


def test_probes_re_time_only_the_candidates_of_their_precision_family(tiny_dir):
    """A probe's measured/modelled ratio is its precision's: unprobed candidates of that family are re-timed with it,
    those of another keep the model's time (carried across precisions, a ratio predicted the lent H100's measured
    steps worse than no calibration: benchmarks/probe_calibration.py)."""
    def measure(context, cfg, timeout_s):  # mixed-precision steps run 1.5x slower than modelled; others fail
        if cfg.precision_family() != "mixed":
            return Measurement(status="error", reason="not measured")
        cand = next(c for c in base.candidates if c.config == cfg)
        parts = cand.throughput.parts
        return Measurement(status="ok", peak_allocated=cand.memory.peak_allocated,
                           peak_reserved=cand.memory.peak_reserved, micro_step_s=1.5 * parts.compute / cfg.grad_accum,
                           optimizer_step_s=parts.optimizer, step_time_s=1.5 * parts.compute + parts.optimizer,
                           tokens_per_s=1.0)

    kw = dict(gpu=A100, seq_len=32, precision="auto", checkpointing="none", zero_stage=0)
    base = plan(tiny_dir, 16, **kw)
    assert {c.config.precision for c in base.candidates} >= {"fp32", "bf16-mixed"}
    p = plan(tiny_dir, 16, measure=measure, **kw)
    assert [(c.precision, c.micro_step) for c in p.speed_calibrations] == [("mixed", pytest.approx(1.5))]
    before = {c.config: c.throughput for c in base.candidates}
    for c in p.candidates:
        if c.throughput.source == "calibrated":
            assert c.config.precision_family() == "mixed"
            assert c.throughput.parts.compute == pytest.approx(1.5 * before[c.config].parts.compute)
        elif c.config.precision_family() != "mixed":
            assert c.throughput == before[c.config]
    assert any(c.throughput.source == "calibrated" for c in p.candidates)
    assert next(n for n in p.notes if n.kind == "probes")["unprobed_precision"] is True
    assert p.to_json()["speed_calibrations"] == [c.model_dump() for c in p.speed_calibrations]


def test_cli_refuses_probe_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from typer.testing import CliRunner

    from planner.cli import app

    result = CliRunner().invoke(app, ["--model", "gpt2", "--batch", "8", "--probe"])
    assert result.exit_code == 2 and "--probe" in result.output


@pytest.mark.long
def test_probe_budget_is_a_hard_limit(tiny_dir):
    """A probe still running when the budget ends is stopped (its process group killed), and no new one starts."""
    start = time.monotonic()
    p = plan(tiny_dir, 16, gpu=A100, seq_len=32, zero_stage=0,
             measure=Prober(device="cpu", use_cache=False, script=(*FAULTS, "hang")), probe_budget_s=8)
    elapsed = time.monotonic() - start
    assert [r.measurement.status for r in p.probes] == ["timeout"]
    assert elapsed < 8 + 20, elapsed  # the budget plus planning, not the hang's hour
    assert p.choice.throughput.source in ("model", "corrected")


@pytest.mark.gpu
def test_probe_on_the_gpu(tiny_dir):
    draft = plan(tiny_dir, 8, seq_len=32, zero_stage=0, micro_batch=2, precision="bf16-mixed")
    result = Prober(device="cuda", use_cache=False, timeout_s=300)(_context(tiny_dir, draft), draft.choice.config)
    assert result.status == "ok" and result.peak_reserved >= result.peak_allocated > 0


def test_bloom_probes_with_its_own_attention(tmp_path):
    """BLOOM has no SDPA: the probe runs it eager, as the plan and the emitted files do (it used to error)."""
    transformers.BloomConfig(n_layer=2, hidden_size=64, n_head=4, vocab_size=300,
                             architectures=["BloomForCausalLM"]).save_pretrained(tmp_path)
    draft = plan(str(tmp_path), 8, gpu=A100, seq_len=32, zero_stage=0, micro_batch=2)
    context = ProbeContext(resolve_model(str(tmp_path)), 32, "adamw", "sdpa", A100, draft)
    result = Prober(device="cpu", use_cache=False)(context, draft.choice.config)
    assert result.status == "ok", result


def _event(action, addr, size, where=None):
    frames = [{"filename": f"/env/site-packages/{file}", "line": line, "name": name}
              for file, line, name in where or []]
    return {"action": action, "addr": addr, "size": size, "frames": frames}


def test_peak_anatomy_replays_the_allocator_history_to_its_peak():
    from probes.measure import peak_anatomy

    linear = [("torch/nn/functional.py", 5, "linear"), ("transformers/models/llama/modeling_llama.py", 9, "forward")]
    trace = [_event("alloc", 1, 100, linear), _event("alloc", 2, 50),
             _event("free_requested", 1, 100),  # still allocated until the free completes
             _event("alloc", 3, 30, [("transformers/trainer.py", 7, "step")]),
             _event("free_completed", 1, 100), _event("alloc", 4, 60)]
    anatomy = peak_anatomy({"device_traces": [[], trace]}, max_entries=100)
    assert anatomy["peak_replayed"] == 180 and anatomy["peak_event"] == 3 and not anatomy["truncated"]
    sites = {s["site"]: s["bytes"] for s in anatomy["sites"]}
    assert sites == {"transformers/models/llama/modeling_llama.py:9 forward <- torch/nn/functional.py:5 linear": 100,
                     "(no Python frame)": 50, "transformers/trainer.py:7 step": 30}
    assert anatomy["peak_site"] == "transformers/trainer.py:7 step"
    assert peak_anatomy({"device_traces": [trace]}, max_entries=len(trace))["truncated"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without CUDA")
def test_memory_peak_needs_cuda():
    from probes.measure import memory_history

    with pytest.raises(RuntimeError, match="needs a CUDA GPU"), memory_history("peak.json"):
        pass


@pytest.mark.gpu
def test_memory_peak_on_the_gpu(tiny_dir, tmp_path):
    import json

    from probes.runner import accelerate_command, probe_files, run_group, write_files

    draft = plan(tiny_dir, 8, seq_len=32, zero_stage=0, micro_batch=2, precision="bf16-mixed")
    write_files(probe_files(draft, draft.choice.config), tmp_path)
    cmd = accelerate_command(tmp_path / "accelerate_config.yaml",
                             ["-m", "probes.train", "--plan", str(tmp_path), "--memory-peak", str(tmp_path / "p.json")])
    _, stderr, code = run_group(cmd, None, 300, cwd=tmp_path)
    assert code == 0, stderr[-2000:]
    anatomy = json.loads((tmp_path / "p.json").read_text())
    # trace entries carry requested sizes where torch's counter adds the blocks' rounding (0.03 % here)
    assert anatomy["peak_replayed"] == pytest.approx(anatomy["max_memory_allocated"], rel=0.02)
    assert sum(s["bytes"] for s in anatomy["sites"]) + anatomy["other_sites_bytes"] == anatomy["peak_replayed"]
