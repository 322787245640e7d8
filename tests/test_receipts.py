"""Receipts: a run records what ran, where, the prediction made before it and what it measured (schema 2); the next
plan learns only from runs like its own, against the model's own figures, so repeated runs converge on the truth;
anything else, corrupt receipts included, leaves the plan as it was and is said in one line."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import pytest
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import planner
from benchmarks.receipt_overhead import Rows
from planner import calibration, receipts
from planner.cache import cache_dir
from planner.receipts import Device, Figures, Receipt

GiB = 2**30
A100 = Device(kind="cuda", name="NVIDIA A100-SXM4-80GB", gpu="A100-80GB", count=1, host="a test host")
RTX4090 = Device(kind="cuda", name="NVIDIA GeForce RTX 4090", gpu="RTX4090-24GB", count=1)


def _tiny_llama():
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=300, architectures=["LlamaForCausalLM"])


def tiny_folder(root: Path, name: str = "tiny-llama", layers: int = 2) -> Path:
    """A local model folder (config.json only: a plan builds the model on the meta device)."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    config = _tiny_llama()
    config.num_hidden_layers = layers
    config.save_pretrained(folder)
    return folder


def _vm_hwm() -> int:
    """This process's high-water RSS as /proc reports it (the instrument the receipt is checked against)."""
    with open("/proc/self/status") as status:
        line = next(ln for ln in status if ln.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINPLAN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def gpu_receipt(data: dict, step: float = 1.0, *, device: Device = A100, memory: dict | None = None,
                name: str = "r1") -> Receipt:
    """What a GPU run of the plan `data` would write: its steps `step` x the model's own step time (the truth, in
    units of the model), and the peaks in `memory` (None: no peak measured)."""
    prediction = receipts.prediction(data)
    measured = Figures(step_time_s=prediction.model.step_time_s * step, **(memory or {}))
    return Receipt(id=name, created="2026-11-28T00:00:00+00:00", plan=receipts.run_plan(data), device=device,
                   predicted=prediction, measured=measured, steps=5, warmup=3)


def write(folder: Path, receipt: Receipt | dict, name: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = receipt.to_json() if isinstance(receipt, Receipt) else receipt
    path = folder / f"{name or data.get('id', 'receipt')}.json"
    path.write_text(json.dumps(data))
    return path


# --- taking one -----------------------------------------------------------------------------------------------------
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
    written = json.loads((tmp_path / "run" / "receipt.json").read_text())
    receipt = receipts.parse(written)
    data = p.to_json()
    assert written["schema"] == receipts.SCHEMA == 2 and receipt.steps == 6 and receipt.device.kind == "cpu"
    assert receipt.plan.choice == p.choice.config and receipt.plan.seq_len == 32 and receipt.plan.adapter == "none"
    assert receipt.predicted == receipts.prediction(data)
    assert receipt.predicted.printed.step_time_s == data["throughput"]["step_time_s"]
    assert receipt.predicted.model.step_time_s == data["throughput"]["model"]["step_time_s"]
    assert receipt.predicted.tree == data["planner"]["tree"] == receipts.planner_tree()
    assert receipt.error_bars["memory"] == data["memory"]["error"]
    assert receipt.versions["torch"] and receipt.device.host
    measured = receipt.measured
    assert measured.host_peak == pytest.approx(instrument, rel=0.01)
    tokens = p.choice.config.micro_batch * p.choice.config.grad_accum * 32
    assert measured.tokens_per_s == pytest.approx(tokens / measured.step_time_s)
    assert measured.real_tokens_per_s == pytest.approx(measured.tokens_per_s)  # no padding in these rows
    assert measured.peak_reserved is None  # a CPU has no CUDA counters: not measured, not made up
    assert str(tmp_path) not in json.dumps(written)  # no paths
    assert [json.loads(f.read_text()) for f in (cache / "receipts").glob("*.json")] == [written]


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
    receipt = receipts.parse(json.loads((tmp_path / "run" / "receipt.json").read_text()))
    assert receipt.predicted == receipts.prediction(json.loads((tmp_path / "run" / "plan.json").read_text()))
    assert receipt.measured.host_peak == pytest.approx(instrument, rel=0.01)
    assert receipt.device.kind == "cpu" and receipt.plan.model == "tiny-llama"
    assert str(tmp_path) not in json.dumps(receipt.to_json())


def test_a_loop_without_the_trainer_takes_a_receipt_with_the_context_manager(tmp_path, cache):
    p = planner.plan(str(tiny_folder(tmp_path)), 16, gpu="A100-80GB", seq_len=128, detect=False)
    with p.receipt(tmp_path / "run", warmup=1, tokens_per_step=1000) as meter:
        for _ in range(4):
            time.sleep(0.01)
            meter.step()
    receipt = receipts.parse(json.loads((tmp_path / "run" / "receipt.json").read_text()))
    assert receipt.steps == 3 and receipt.status == "ok" and meter.path == tmp_path / "run" / "receipt.json"
    assert receipt.measured.step_time_s >= 0.01
    assert receipt.measured.tokens_per_s == pytest.approx(1000 / receipt.measured.step_time_s)


def test_the_step_clock_times_steps_after_its_warm_up_and_resets_the_peaks_once():
    resets = []
    clock = receipts.StepClock(warmup=2, cuda=False, reset=lambda: resets.append(clock.steps))
    clock.start()
    for _ in range(5):
        clock.begin()
        time.sleep(0.002)
        clock.mark("optimizer-begin")
        time.sleep(0.001)
        clock.mark("optimizer-end")
        clock.end()
    assert resets == [2] and len(clock.times) == 3  # reset when the warm-up ended, three steps timed after it
    assert all(t.whole >= t.micro_steps + t.optimizer > 0 and t.micro_steps >= 0.002 for t in clock.times)
    assert clock.median().whole == sorted(t.whole for t in clock.times)[1]


def test_a_run_outside_the_error_bar_says_so_once(tmp_path, caplog):
    data = planner.plan(str(tiny_folder(tmp_path)), 16, gpu="A100-80GB", seq_len=128, detect=False).to_json()
    printed = receipts.prediction(data).printed
    high = (data["memory"]["error"] or {}).get("high") or 1.0

    def measured(peak: float) -> Figures:
        return Figures(peak_reserved=printed.peak_reserved * peak, step_time_s=printed.step_time_s)

    assert receipts.check(measured(0.99 * high), printed, data) == []
    lines = receipts.check(measured(1.2 * high), printed, data)
    assert len(lines) == 1 and "above the plan's" in lines[0] and "budget" in lines[0]
    meter = receipts.Meter(data, None, warmup=0, cache=False)
    meter.measured = lambda: measured(1.2 * high)  # a GPU's counters, as this CPU has none
    with caplog.at_level(logging.WARNING, logger="planner"):
        for _ in range(receipts.CHECK_AFTER + 3):
            meter.step()
    assert [r.getMessage() for r in caplog.records] == lines  # at once, and once


# --- the next plan learns -------------------------------------------------------------------------------------------
def test_five_runs_of_one_truth_converge_on_it(tmp_path, cache):
    """A loop of five runs whose steps take twice the model's time, each planned with the receipts of the runs
    before it (their printed figures already calibrated): the plan says the truth from the first receipt on, and
    stays there (within 2 %), never drifting toward the square root of it. The precision is pinned: unpinned, a
    family measured slower than modelled gives way to another (`test_receipts_that_change_the_choice_say_so`)."""
    model, team = str(tiny_folder(tmp_path)), tmp_path / "team"
    ask = dict(gpu="A100-80GB", seq_len=128, detect=False, precision="bf16-mixed")
    for run in range(5):
        plan = planner.plan(model, 32, receipts=str(team), **ask) if run else planner.plan(model, 32, **ask)
        data = plan.to_json()
        truth = 2.0 * data["throughput"]["model"]["step_time_s"]
        if run:
            assert data["throughput"]["step_time_s"] == pytest.approx(truth, rel=0.02), run
            assert data["throughput"]["source"] == "receipts"
        write(team, gpu_receipt(data, step=2.0, name=f"run-{run}"))
    assert len(list(team.glob("*.json"))) == 5


def test_receipts_of_another_model_gpu_or_adapter_leave_the_plan_alone(tmp_path, cache):
    ask = dict(gpu="A100-80GB", seq_len=128, detect=False, precision="bf16-mixed")
    mine, other = str(tiny_folder(tmp_path)), str(tiny_folder(tmp_path, "other-llama", layers=3))
    plain = planner.plan(mine, 32, **ask)
    team = tmp_path / "team"
    grown = {"peak_allocated": 3 * plain.choice.memory.peak_allocated, "peak_reserved": 3 * plain.choice.memory.peak_reserved}
    write(team, gpu_receipt(planner.plan(other, 32, **ask).to_json(), step=3.0, memory=grown, name="other-model"))
    write(team, gpu_receipt(plain.to_json(), step=3.0, memory=grown, device=RTX4090, name="on-a-4090"))
    lora = planner.plan(mine, 32, peft="lora", **ask).to_json()
    write(team, gpu_receipt(lora, step=3.0, memory={"peak_allocated": 0.4 * lora["memory"]["peak_allocated"],
                                                   "peak_reserved": 0.4 * lora["memory"]["peak_reserved"]},
                            name="lora"))
    again = planner.plan(mine, 32, receipts=str(team), **ask)
    assert [c.model_dump() for c in again.candidates] == [c.model_dump() for c in plain.candidates]
    unused = [n for n in again.notes if n.kind == "receipts-unused"]
    assert len(unused) == 1 and unused[0]["unlike"] == 2 and unused[0]["skipped"] == 1  # one line for all three
    assert "another GPU than planned" in unused[0]["reasons"]
    assert not {"receipts", "receipts-memory", "receipts-choice"} & {n.kind for n in again.notes}


def test_a_receipt_of_a_run_like_the_plan_recalibrates_its_family_memory(tmp_path, cache):
    ask = dict(gpu="A100-80GB", seq_len=128, detect=False, precision="bf16-mixed")
    model = str(tiny_folder(tmp_path))
    first = planner.plan(model, 32, **ask)
    chosen = first.choice
    grown = chosen.memory.peak_allocated + GiB // 8  # the run kept more activations than modelled
    write(tmp_path / "team", gpu_receipt(first.to_json(), memory={
        "peak_allocated": grown, "peak_reserved": grown + GiB // 32, "peak_process": grown + GiB // 4}))
    second = planner.plan(model, 32, receipts=str(tmp_path / "team"), **ask)
    mem = next(c for c in second.candidates if c.config == chosen.config).memory
    assert mem.method == "receipt-calibrated" and mem.peak_allocated == pytest.approx(grown, rel=1e-6)
    assert mem.peak_process == pytest.approx(grown + GiB // 4, rel=1e-3) and mem.terms.error_margin == 0
    assert mem.model.peak_allocated == chosen.memory.peak_allocated  # the model's own figure, kept beside
    assert second.to_json()["memory"]["model"]["peak_allocated"] == chosen.memory.peak_allocated
    before = {c.config: c for c in first.candidates}
    for cand in second.candidates:  # other families as modelled
        if cand.memory and cand.config.family() != chosen.config.family() and before[cand.config].memory:
            assert cand.memory == before[cand.config].memory
    checks = {c.quantity: c for c in second.receipt_checks}
    assert checks["peak_allocated"].measured == grown
    assert checks["peak_allocated"].predicted == chosen.memory.peak_allocated  # today's model of that configuration


def test_receipts_that_change_the_choice_say_so(tmp_path, cache):
    ask = dict(gpu="A100-80GB", seq_len=128, detect=False, precision="auto")
    model = str(tiny_folder(tmp_path))
    first = planner.plan(model, 32, **ask)
    write(tmp_path / "team", gpu_receipt(first.to_json(), step=10.0))  # its precision family ran 10x slower
    second = planner.plan(model, 32, receipts=str(tmp_path / "team"), **ask)
    assert second.choice.config.precision_family() != first.choice.config.precision_family()
    changed = [n for n in second.notes if n.kind == "receipts-choice"]
    assert len(changed) == 1 and changed[0]["before"] == first.choice.config.label()
    assert changed[0]["after"] == second.choice.config.label()


def test_a_schema_1_receipt_is_read_and_one_naming_no_device_is_said(tmp_path, cache):
    ask = dict(gpu="A100-80GB", seq_len=128, detect=False, precision="bf16-mixed")
    model = str(tiny_folder(tmp_path))
    data = planner.plan(model, 32, **ask).to_json()
    modelled = data["throughput"]["model"]["step_time_s"]
    old = {"schema": 1, "created": "2026-11-01T00:00:00+00:00",
           "plan": {"model": "tiny-llama", "seq_len": 128, "adapter": "none", "hardware": data["hardware"],
                    "choice": {k: data["choice"][k] for k in planner.Config.model_fields}},
           "predicted": {"step_time_s": data["throughput"]["step_time_s"]},
           "measured": {"step_time_s": 1.5 * modelled}, "device": {"kind": "cuda"}}
    write(tmp_path / "team", old, "old")
    again = planner.plan(model, 32, receipts=str(tmp_path / "team"), **ask)
    assert again.choice.throughput.step_time_s == pytest.approx(1.5 * modelled)
    assert "receipts-unnamed" in {n.kind for n in again.notes}


def test_the_cache_is_read_unless_asked_not_to(tmp_path, cache):
    ask = dict(gpu="A100-80GB", seq_len=128, detect=False, precision="bf16-mixed")
    model = str(tiny_folder(tmp_path))
    first = planner.plan(model, 32, **ask)
    write(cache_dir("receipts"), gpu_receipt(first.to_json(), step=2.0))
    assert planner.plan(model, 32, **ask).choice.throughput.tokens_per_s < first.choice.throughput.tokens_per_s
    unread = planner.plan(model, 32, use_receipts=False, **ask)
    assert unread.choice.throughput.tokens_per_s == first.choice.throughput.tokens_per_s


def test_a_missing_receipts_path_is_a_flag_error():
    with pytest.raises(planner.InputError) as info:
        planner.plan("gpt2", 32, gpu="A100-80GB", detect=False, receipts="/nonexistent/receipts")
    assert info.value.flag == "--receipts"


# --- corrupt receipts -----------------------------------------------------------------------------------------------
#: Values no figure or count may take, and ways a receipt's JSON may be broken.
BAD_VALUES = st.sampled_from(["12", "fast", "", [], {}, True, float("nan"), float("inf"), -float("inf"), 0, -1,
                              -1e9, 1e300])
FIGURE_PATHS = [("measured", "step_time_s"), ("measured", "peak_reserved"), ("measured", "peak_allocated"),
                ("predicted", "model", "step_time_s"), ("predicted", "printed", "step_time_s"),
                ("plan", "choice", "micro_batch"), ("plan", "choice", "world_size"), ("plan", "seq_len"),
                ("plan", "hardware", "gpu"), ("plan", "model"), ("device", "kind"), ("schema",), ("plan",),
                ("measured",), ("plan", "choice", "precision")]


def _with(data: dict, path: tuple, value) -> dict:
    """`data` with the value at `path` replaced (as it is where an earlier corruption removed the path)."""
    out = json.loads(json.dumps(data))
    node = out
    for key in path[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node[path[-1]] = value
    return out


@pytest.fixture(scope="module")
def a_receipt(tmp_path_factory):
    """A plan of a tiny local model, and a believable receipt of its run (what corruptions start from)."""
    folder = tiny_folder(tmp_path_factory.mktemp("model"))
    plan = planner.plan(str(folder), 32, gpu="A100-80GB", seq_len=128, detect=False, precision="bf16-mixed",
                        liger="off")
    memory = {"peak_allocated": 1.2 * plan.choice.memory.peak_allocated,
              "peak_reserved": 1.2 * plan.choice.memory.peak_reserved}
    return folder, plan, gpu_receipt(plan.to_json(), step=1.5, memory=memory)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(corruptions=st.lists(st.tuples(st.sampled_from(FIGURE_PATHS), BAD_VALUES), min_size=1, max_size=3),
       ratio=st.sampled_from([None, 0.05, 12.0, 1e6]))
def test_a_corrupt_receipt_is_skipped_never_raised_and_never_changes_a_plan(a_receipt, tmp_path_factory,
                                                                             corruptions, ratio):
    """A wrong type, NaN, infinity, zero, a negative, a missing part or a measurement off its prediction by more than
    10x (or text where a name was: then a run of another model or GPU): the receipt teaches nothing and is counted
    in the one note, and the plan's candidates stay as they were."""
    _, plan, good = a_receipt
    data = good.to_json()
    if ratio is not None:
        data = _with(data, ("measured", "step_time_s"), good.predicted.model.step_time_s * ratio)
    for path, value in corruptions:
        data = _with(data, path, value)
    folder = tmp_path_factory.mktemp("team")
    (folder / "bad.json").write_text(json.dumps(data, allow_nan=True))
    (folder / "not-json.json").write_text("{")
    found, skipped = receipts.read_receipts([folder], cache=False)
    assert len(found) + len(skipped) == 2 and all(s.why for s in skipped)
    work = calibration.Workload(gpu="A100-80GB", model="tiny-llama", seq_len=128, adapter="none", world_size=1,
                                estimate=None, speed=None)  # never asked: nothing corrupt is a run like the plan's
    lessons = calibration.learn(found, skipped, work)
    assert not lessons.changes_anything and not lessons.like
    assert lessons.unlike + sum(lessons.skipped.values()) == 2  # each file accounted for, in the one note
    ranked = list(plan.candidates)
    assert calibration.applied(ranked, lessons, plan.hardware.budget_bytes, rank=None) is ranked


def test_a_plan_with_corrupt_receipts_is_the_plan_without_them_and_one_line_says_so(tmp_path, cache, a_receipt):
    model, plan, good = a_receipt
    bad = [(("measured", "step_time_s"), "12"), (("measured", "peak_reserved"), -1),
           (("measured", "step_time_s"), float("nan")), (("plan",), None)]
    for i, (path, value) in enumerate(bad):
        write(tmp_path / "team", _with(good.to_json(), path, value), f"bad-{i}")
    again = planner.plan(str(model), 32, gpu="A100-80GB", seq_len=128, detect=False, precision="bf16-mixed",
                         liger="off", receipts=str(tmp_path / "team"))
    assert [c.model_dump() for c in again.candidates] == [c.model_dump() for c in plan.candidates]
    unused = [n for n in again.notes if n.kind.startswith("receipts")]
    assert [n.kind for n in unused] == ["receipts-unused"] and unused[0]["skipped"] == 4


def test_a_measurement_off_its_prediction_by_more_than_ten_times_is_not_believed():
    low, high = receipts.RATIO_RANGE
    assert (low, high) == (0.1, 10.0)
    assert all(math.isfinite(x) for x in receipts.RATIO_RANGE)
