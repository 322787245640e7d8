"""Receipts: a run records what it measured beside what its plan predicted, checks itself against the plan's error
bars, and the next plan on that GPU is re-timed by what the receipts measured (and by nothing else)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import transformers

import planner
from benchmarks.receipt_overhead import Rows
from planner import receipts
from planner.cache import cache_dir

GiB = 2**30


def _tiny_llama():
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=300, architectures=["LlamaForCausalLM"])


def _vm_hwm() -> int:
    """This process's high-water RSS as /proc reports it (the instrument the receipt is checked against)."""
    with open("/proc/self/status") as status:
        line = next(ln for ln in status if ln.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINPLAN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.slow
def test_a_trainer_run_with_the_callback_writes_its_receipt(tmp_path, cache):
    p = planner.plan(_tiny_llama(), 4, gpu="A100-80GB", seq_len=32, precision="fp32", zero_stage=0, detect=False)
    args = p.training_arguments(output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=8, report_to="none",
                                save_strategy="no", include_num_input_tokens_seen="non_padding", disable_tqdm=True)
    callback = p.callback(tmp_path / "run", warmup=2)
    trainer = transformers.Trainer(model=p.prepare(transformers.LlamaForCausalLM(_tiny_llama())), args=args,
                                   train_dataset=Rows(64, 32), callbacks=[callback])
    trainer.train()
    instrument = _vm_hwm()
    receipt = json.loads((tmp_path / "run" / "receipt.json").read_text())
    data = p.to_json()
    assert receipt["schema"] == 1 and receipt["steps"] == 6 and receipt["device"]["kind"] == "cpu"
    assert receipt["predicted"]["peak_reserved"] == data["memory"]["peak_reserved"]
    assert receipt["predicted"]["step_time_s"] == data["throughput"]["step_time_s"]
    assert receipt["predicted"] == receipts.predicted(data)
    assert receipt["error_bars"]["memory"] == data["memory"]["error"]
    measured = receipt["measured"]
    assert measured["host_peak"] == pytest.approx(instrument, rel=0.01)
    cfg = p.choice.config
    tokens = cfg.micro_batch * cfg.grad_accum * 32
    assert measured["tokens_per_s"] == pytest.approx(tokens / measured["step_time_s"])
    assert measured["real_tokens_per_s"] == pytest.approx(measured["tokens_per_s"])  # no padding in these rows
    assert measured["peak_reserved"] is None  # a CPU has no CUDA counters: not measured, not made up
    assert str(tmp_path) not in json.dumps(receipt)  # no paths
    assert [json.loads(f.read_text()) for f in (cache / "receipts").glob("*.json")] == [receipt]


@pytest.mark.slow
@pytest.mark.long
def test_the_shipped_probes_train_writes_a_receipt_its_parent_can_check(tmp_path, cache):
    """`python -m probes.train` under a parent that waits for it: the kernel's record of the child's peak RSS
    (getrusage RUSAGE_CHILDREN, read by the parent) is the instrument the receipt's host_peak is checked against."""
    import os
    import subprocess
    import sys

    from tiny import tiny_llama

    model = tiny_llama(tmp_path / "tiny-llama")
    p = planner.plan(str(model), 4, gpu="A100-80GB", seq_len=32, precision="fp32", zero_stage=0, detect=False)
    p.emit(tmp_path / "run")
    parent = ("import resource, subprocess, sys; subprocess.run([sys.executable, '-m', 'probes.train', '--plan', "
              f"{str(tmp_path / 'run')!r}, '--steps', '4', '--warmup', '1'], check=True); "
              "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
    done = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    instrument = int(done.stdout.strip().splitlines()[-1])
    receipt = json.loads((tmp_path / "run" / "receipt.json").read_text())
    assert receipt["predicted"] == receipts.predicted(json.loads((tmp_path / "run" / "plan.json").read_text()))
    assert receipt["measured"]["host_peak"] == pytest.approx(instrument, rel=0.01)
    assert receipt["device"]["kind"] == "cpu" and str(tmp_path) not in json.dumps(receipt)


def test_a_loop_without_the_trainer_takes_a_receipt_with_the_context_manager(tmp_path, cache):
    p = planner.plan("gpt2", 16, gpu="A100-80GB", seq_len=128, detect=False, liger="off")
    with p.receipt(tmp_path, warmup=1, tokens_per_step=1000) as meter:
        for _ in range(4):
            time.sleep(0.01)
            meter.step()
    receipt = json.loads((tmp_path / "receipt.json").read_text())
    assert receipt["steps"] == 3 and receipt["status"] == "ok" and meter.path == tmp_path / "receipt.json"
    assert receipt["measured"]["step_time_s"] >= 0.01
    assert receipt["measured"]["tokens_per_s"] == pytest.approx(1000 / receipt["measured"]["step_time_s"])


def _gpu_measured(data: dict, peak: float = 1.0, step: float = 1.0) -> dict:
    expected = receipts.predicted(data)
    return {**expected, "peak_reserved": int(expected["peak_reserved"] * peak),
            "step_time_s": expected["step_time_s"] * step}


def test_a_run_outside_the_error_bar_says_so_once(caplog):
    data = planner.plan("gpt2", 16, gpu="A100-80GB", seq_len=128, detect=False, liger="off").to_json()
    bar = data["memory"]["error"]
    high = (bar or {}).get("high") or 1.0
    assert receipts.check(_gpu_measured(data, peak=0.99 * high), receipts.predicted(data), data) == []
    lines = receipts.check(_gpu_measured(data, peak=1.2 * high), receipts.predicted(data), data)
    assert len(lines) == 1 and "above the plan's" in lines[0] and "budget" in lines[0]
    meter = receipts.Meter(data, None, warmup=0, cache=False)
    meter.measured = lambda: _gpu_measured(data, peak=1.2 * high)  # a GPU's counters, as this CPU has none
    with caplog.at_level(logging.WARNING, logger="planner"):
        for _ in range(receipts.CHECK_AFTER + 3):
            meter.step()
    assert [r.getMessage() for r in caplog.records] == lines  # at once, and once


def _write(folder, data: dict, step: float, kind: str = "cuda", name: str = "r1.json", memory: dict | None = None
           ) -> None:
    """A receipt of the plan `data`: steps `step` x the predicted time, and the peaks in `memory` (None: none measured,
    a receipt that pins speed alone)."""
    folder.mkdir(parents=True, exist_ok=True)
    measured = {**_gpu_measured(data, step=step), "peak_allocated": None, "peak_reserved": None, "peak_process": None,
                **(memory or {})}
    receipt = {"schema": 1, "plan": receipts.plan_summary(data), "predicted": receipts.predicted(data),
               "measured": measured, "device": {"kind": kind}}
    (folder / name).write_text(json.dumps(receipt))


@pytest.mark.slow
@pytest.mark.long
def test_the_next_plan_is_retimed_by_its_receipts_and_nothing_else(tmp_path, cache):
    ask = dict(gpu="A100-80GB", seq_len=512, detect=False, liger="off")
    first = planner.plan("gpt2", 32, **ask)
    team = tmp_path / "team"
    _write(team, first.to_json(), step=1.1)
    _write(team, first.to_json(), step=1.1, kind="cpu", name="cpu.json")  # a CPU trial pins nothing of a GPU
    (team / "broken.json").write_text("{")
    second = planner.plan("gpt2", 32, receipts=str(team), **ask)
    assert second.choice.config == first.choice.config
    assert second.choice.throughput.tokens_per_s == pytest.approx(first.choice.throughput.tokens_per_s / 1.1)
    assert second.choice.memory == first.choice.memory
    kinds = [n.kind for n in second.notes]
    assert kinds.count("receipts") == 1 and kinds.count("receipt-skipped") == 1
    speed = next(n for n in second.notes if n.kind == "receipts")
    assert speed.values["runs"] == 1 and speed.values["ratio"] == pytest.approx(1.1)
    assert second.to_json()["speed_calibrations"][0]["source"] == "receipts"
    other = planner.plan("gpt2", 32, receipts=str(team), **{**ask, "gpu": "H100-80GB"})
    assert "receipts" not in [n.kind for n in other.notes]  # another GPU's runs say nothing of this one


@pytest.mark.slow
@pytest.mark.long
def test_a_receipt_that_measured_memory_calibrates_its_family_and_nothing_else(tmp_path, cache):
    ask = dict(gpu="A100-80GB", seq_len=512, detect=False, liger="off")
    first = planner.plan("gpt2", 32, **ask)
    data, chosen = first.to_json(), first.choice
    grown = chosen.memory.peak_allocated + GiB  # the run kept 1 GiB more activations than modelled
    _write(tmp_path / "team", data, step=1.0, memory={"peak_allocated": grown, "peak_reserved": grown + GiB // 4,
                                                      "peak_process": grown + GiB})
    second = planner.plan("gpt2", 32, receipts=str(tmp_path / "team"), **ask)
    family = chosen.config.family()
    same = {c.config: c for c in second.candidates if c.memory and c.config.family() == family}
    mem = same[chosen.config].memory
    assert mem.method == "receipt-calibrated" and mem.peak_allocated == pytest.approx(grown, rel=1e-6)
    assert mem.peak_reserved == pytest.approx(grown + GiB // 4, rel=1e-3) and mem.terms.error_margin == 0
    assert mem.peak_process == pytest.approx(grown + GiB, rel=1e-3)  # NVML's total: context and NCCL as measured
    terms = mem.terms
    assert mem.peak == mem.peak_process
    assert mem.overhead == terms.allocated_overheads + terms.allocator_slack + terms.outside_allocator
    before = {c.config: c for c in first.candidates}
    for cand in second.candidates:  # other families as modelled; every speed as modelled
        if cand.memory and cand.config.family() != family and before[cand.config].memory:
            assert cand.memory == before[cand.config].memory
        if cand.throughput and before[cand.config].throughput:
            assert cand.throughput.tokens_per_s == before[cand.config].throughput.tokens_per_s
    assert second.choice.config.family() == family and "receipts-memory" in [n.kind for n in second.notes]
    checks = {c.quantity: c for c in second.receipt_checks}
    assert checks["peak_allocated"].measured == grown
    assert checks["peak_allocated"].predicted == chosen.memory.peak_allocated  # today's model of that configuration
    assert checks["peak_allocated"].predicted_then == chosen.memory.peak_allocated


@pytest.mark.slow
@pytest.mark.long
def test_the_cache_is_read_unless_asked_not_to(tmp_path, cache):
    ask = dict(gpu="A100-80GB", seq_len=512, detect=False, liger="off")
    first = planner.plan("gpt2", 32, **ask)
    _write(cache_dir("receipts"), first.to_json(), step=2.0)
    assert planner.plan("gpt2", 32, **ask).choice.throughput.tokens_per_s < first.choice.throughput.tokens_per_s
    unread = planner.plan("gpt2", 32, use_receipts=False, **ask)
    assert unread.choice.throughput.tokens_per_s == first.choice.throughput.tokens_per_s


def test_a_missing_receipts_path_is_a_flag_error():
    with pytest.raises(planner.InputError) as info:
        planner.plan("gpt2", 32, gpu="A100-80GB", detect=False, receipts="/nonexistent/receipts")
    assert info.value.flag == "--receipts"


def test_a_gpu_receipt_is_a_memory_row_and_a_speed_row_for_the_accuracy_report():
    from benchmarks.receipt_rows import rows_of

    data = planner.plan("gpt2", 16, gpu="A100-80GB", seq_len=128, detect=False, liger="off").to_json()
    receipt = {"plan": receipts.plan_summary(data), "predicted": receipts.predicted(data),
               "measured": _gpu_measured(data, peak=1.05, step=1.2), "device": {"kind": "cuda"}}
    rows = rows_of(receipt, "run-1.json")
    assert rows["peak_reserved"][0].ratio == pytest.approx(1.05, rel=1e-6)
    assert rows["step_time_s"][0].ratio == pytest.approx(1.2)
    assert rows["step_time_s"][0].group["gpu"] and rows["step_time_s"][0].data_file == "receipts/run-1.json"
    assert rows_of({**receipt, "device": {"kind": "cpu"}}, "cpu.json") == {}
