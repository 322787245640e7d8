"""Receipts: a run records what it measured beside what its plan predicted, checks itself against the plan's error
bars, and the next plan on that GPU is re-timed by what the receipts measured (and by nothing else)."""

from __future__ import annotations

import json
import logging
import time

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


def _write(folder, data: dict, step: float, kind: str = "cuda", name: str = "r1.json") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    receipt = {"schema": 1, "plan": receipts.plan_summary(data), "predicted": receipts.predicted(data),
               "measured": _gpu_measured(data, step=step), "device": {"kind": kind}}
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
