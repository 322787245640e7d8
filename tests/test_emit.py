"""Emitted configs: loaded back by DeepSpeed's config classes and accelerate's loader; golden files; safety."""

from __future__ import annotations

import gzip
import json
import math
import os
import stat
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from emit import EmitOptions, emit, launch_command, render_files, run_launch
from emit.names import TRAIN_SCRIPTS
from planner import load_plan, plan
from planner.errors import InputError
from planner.export import CHECKPOINTING_ARGS, checkpointing_arg

GOLDEN = Path(__file__).parent / "golden"
UPDATE_GOLDEN = os.environ.get("TRAINPLAN_UPDATE_GOLDEN") == "1"

LAYOUTS = {"1gpu": (1, 1), "8gpu": (8, 1), "4x8gpu": (8, 4)}
PINS = [(0, None), (1, None), (2, None), (3, None), (2, "optimizer"), (3, "optimizer"), (3, "optimizer+params")]


def _plan(layout, zero, offload, precision="bf16-mixed"):
    per_node, nodes = LAYOUTS[layout]
    world = per_node * nodes
    if world == 1 and zero and offload is None:
        pytest.skip("ZeRO without offload is not planned on one GPU")
    p = plan("gpt2", 64 * world, gpu="A100-80GB", gpus_per_node=per_node, nodes=nodes, zero_stage=zero,
             precision=precision, lr=3e-4, lr_batch=64 * world // 4)
    if offload is not None:
        matching = [c for c in p.candidates if c.config.offload == offload]
        p = p.model_copy(update={"choice": matching[0]})
    else:
        matching = [c for c in p.candidates if c.config.offload == "none"]
        p = p.model_copy(update={"choice": matching[0]})
    return p


def _deepspeed_config(ds: dict, world: int, monkeypatch):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime import config as ds_config

    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: world)
    return ds_config.DeepSpeedConfig(ds)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("zero,offload", PINS)
def test_deepspeed_and_accelerate_load_emitted_configs(layout, zero, offload, tmp_path, monkeypatch):
    p = _plan(layout, zero, offload)
    cfg = p.choice.config
    files = emit(p, tmp_path, EmitOptions(main_process_ip="10.0.0.1"))
    assert (tmp_path / "ds_config.json").exists() == (cfg.zero_stage > 0)  # only the files the engine needs
    if cfg.zero_stage > 0:
        ds = json.loads((tmp_path / "ds_config.json").read_text())
        text = (tmp_path / "ds_config.json").read_text()
        assert "auto" not in text and "Infinity" not in text and "NaN" not in text
        loaded = _deepspeed_config(ds, cfg.world_size, monkeypatch)
        assert loaded.train_batch_size == cfg.global_batch
        assert loaded.train_micro_batch_size_per_gpu == cfg.micro_batch
        assert loaded.gradient_accumulation_steps == cfg.grad_accum
        assert loaded.zero_optimization_stage == cfg.zero_stage
        assert loaded.bfloat16_config.enabled
        if cfg.offload != "none":
            assert loaded.zero_config.offload_optimizer.device == "cpu"
        if cfg.offload == "optimizer+params":
            assert loaded.zero_config.offload_param.device == "cpu"

    from accelerate.commands.config.config_args import load_config_from_file

    acc = load_config_from_file(str(tmp_path / "accelerate_config.yaml"))
    assert acc.num_processes == cfg.world_size and acc.num_machines == LAYOUTS[layout][1]
    raw = yaml.safe_load((tmp_path / "accelerate_config.yaml").read_text())
    if cfg.zero_stage > 0:
        assert raw["distributed_type"] == "DEEPSPEED" and "mixed_precision" not in raw
        assert raw["deepspeed_config"]["deepspeed_config_file"] == "ds_config.json"  # in the folder
    else:
        assert raw["distributed_type"] == ("MULTI_GPU" if cfg.world_size > 1 else "NO")
    if LAYOUTS[layout][1] > 1:
        assert raw["main_process_ip"] == "10.0.0.1"
        assert not (tmp_path / "hostfile").exists()  # accelerate's standard launcher reads none (launch.py:452-454)
        if cfg.zero_stage > 0:  # the launcher by name (no `--hostfile None --launcher pdsh`)
            assert "deepspeed_hostfile" not in raw["deepspeed_config"]
            assert raw["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"
    args = json.loads((tmp_path / "training_args.json").read_text())
    assert args["per_device_train_batch_size"] == cfg.micro_batch
    assert args["gradient_accumulation_steps"] == cfg.grad_accum
    assert args["learning_rate"] == pytest.approx(p.lr.learning_rate)
    assert sorted(Path(f).name for f in files) == sorted(os.listdir(tmp_path))


def test_fp16_config_has_explicit_loss_scaling(monkeypatch):
    """The emitted fp16 block spells out DeepSpeed's own dynamic loss scaling defaults (deepspeed/runtime/constants.py
    FP16_*_DEFAULT), as tests/test_techniques.py compares torch's GradScaler with its signature."""
    ds = pytest.importorskip("deepspeed.runtime.constants")
    p = plan("gpt2", 64, gpu="T4-16GB", gpus_per_node=8, zero_stage=2)
    ds_config = p.to_deepspeed()
    assert ds_config["fp16"] == {
        ds.FP16_ENABLED: True, ds.FP16_LOSS_SCALE: ds.FP16_LOSS_SCALE_DEFAULT,
        ds.FP16_INITIAL_SCALE_POWER: ds.FP16_INITIAL_SCALE_POWER_DEFAULT,
        ds.FP16_LOSS_SCALE_WINDOW: ds.FP16_LOSS_SCALE_WINDOW_DEFAULT, ds.FP16_HYSTERESIS: ds.FP16_HYSTERESIS_DEFAULT,
        ds.FP16_MIN_LOSS_SCALE: ds.FP16_MIN_LOSS_SCALE_DEFAULT}
    assert _deepspeed_config(ds_config, 8, monkeypatch).float16_config.enabled


@pytest.mark.parametrize("zero,reshard", [(3, True), (2, False)])
def test_fsdp2_config(zero, reshard, tmp_path):
    p = plan("meta-llama/Llama-3.2-1B", 64, gpu="A100-80GB", gpus_per_node=8, zero_stage=zero, checkpointing="full",
             engine="fsdp")
    p = p.model_copy(update={"choice": next(c for c in p.candidates if c.config.offload == "none")})
    emit(p, tmp_path)
    from accelerate.commands.config.config_args import load_config_from_file

    acc = load_config_from_file(str(tmp_path / "accelerate_config.yaml"))
    fsdp = acc.fsdp_config
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_reshard_after_forward"] is reshard
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    assert fsdp["fsdp_activation_checkpointing"] is True
    assert acc.mixed_precision == "bf16"
    args = json.loads((tmp_path / "training_args.json").read_text())
    # FSDP checkpoints; the Trainer raises if its flag is set too
    assert args[checkpointing_arg("gradient_checkpointing")] is False
    assert not (tmp_path / "ds_config.json").exists()


def test_training_args_build_without_a_deprecation_warning(tmp_path):
    """transformers 5 renamed the Trainer's `gradient_checkpointing` to `activation_checkpointing` and warns for the
    old name (transformers/training_args.py `__post_init__`): the file has the name the installed version takes."""
    from transformers import TrainingArguments

    p = plan("gpt2", 64, gpu="A100-80GB", zero_stage=0, precision="bf16-mixed", checkpointing="full")
    emit(p, tmp_path)
    data = json.loads((tmp_path / "training_args.json").read_text())
    assert data[checkpointing_arg("gradient_checkpointing")] is True
    assert data[checkpointing_arg("gradient_checkpointing_kwargs")] == {"use_reentrant": False}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        direct = TrainingArguments(**data | {"output_dir": str(tmp_path / "out"), "use_cpu": True})
        loaded = load_plan(tmp_path).training_arguments(use_cpu=True)
    assert direct.gradient_checkpointing is True and loaded.gradient_checkpointing is True


def test_emitting_is_deterministic_and_never_overwrites(tmp_path):
    p = plan("gpt2", 16, gpu="A100-80GB")
    first = render_files(p, EmitOptions())
    assert first == render_files(p, EmitOptions())
    assert all(text.endswith("\n") for text in first.values())
    emit(p, tmp_path)
    (tmp_path / "training_args.json").write_text("mine\n")
    with pytest.raises(InputError) as info:
        emit(p, tmp_path)
    assert info.value.flag == "--emit" and "--force" in str(info.value)
    assert (tmp_path / "training_args.json").read_text() == "mine\n"
    emit(p, tmp_path, EmitOptions(force=True))
    assert json.loads((tmp_path / "training_args.json").read_text())["gradient_accumulation_steps"] > 0
    assert os.stat(tmp_path / "launch.sh").st_mode & stat.S_IXUSR
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]  # no temporary files left


#: golden folder -> GPUs per node of the plan whose files it holds
GOLDEN_PLANS = {"bloom-560m-a100-1gpu": 1, "bloom-560m-a100-8gpu": 8}


@pytest.mark.parametrize("name,per_node", GOLDEN_PLANS.items())
@pytest.mark.long
def test_golden_files(name, per_node):
    """Every emitted file as recorded: the configs byte for byte, plan.json (0.7-0.9 MB: stored gzipped) in every
    number and every non-prose field. Modelled numbers move with calibration: a change that is meant re-records the
    goldens (TRAINPLAN_UPDATE_GOLDEN=1) in a commit that says why."""
    files = _golden_plan_files(per_node)
    folder = GOLDEN / name
    if UPDATE_GOLDEN:
        _record_golden(folder, files)
    for fname, text in files.items():
        if fname == "plan.json":
            recorded = json.loads(gzip.decompress((folder / "plan.json.gz").read_bytes()))
            found = plan_json_differences(recorded, json.loads(text))
            changed = "\n".join(found[:20])
            assert not found, f"{name}/plan.json changed (rerun with TRAINPLAN_UPDATE_GOLDEN=1):\n{changed}"
            continue
        expected = (folder / fname).read_text()
        if fname == "training_args.json":
            expected = _installed_names(expected)
        assert expected == text, f"{name}/{fname} changed: rerun with TRAINPLAN_UPDATE_GOLDEN=1"


def _golden_plan_files(per_node: int) -> dict[str, str]:
    """The files of the golden plan, but the shipped training scripts (copied as they are: emit/scripts/)."""
    p = plan("bigscience/bloom-560m", 256, gpu="A100-80GB", gpus_per_node=per_node, lr=2e-4, lr_batch=32,
             use_receipts=False)  # what earlier tests' runs left in the cache is not the golden plan's
    return {name: text for name, text in render_files(p, EmitOptions()).items() if name not in TRAIN_SCRIPTS}


def _record_golden(folder: Path, files: dict[str, str], only: tuple[str, ...] | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for fname, text in files.items():
        if only is not None and fname not in only:
            continue
        if fname == "plan.json":
            (folder / "plan.json.gz").write_bytes(gzip.compress(text.encode(), mtime=0))
        else:
            (folder / fname).write_text(text)


#: plan.json fields whose values are sentences, free to change form: the numbers they quote live in typed fields
#: beside them (a candidate's `memory` and `verdict` beside its `reason`, `advice` beside `notes`)
PLAN_PROSE = {"notes", "reason", "network_source"}
#: plan.json fields that name the code that planned (its version and planner/ tree), not the plan
PLANNER_IDENTITY = "planner"


def plan_json_differences(old, new, path: str = "") -> list[str]:
    """Where plan.json `new` departs from the recorded `old`: a number, a non-prose string, a field added or lost.
    An `error` holding a sentence (an error message) is prose; one holding error bars is compared but for its
    `source`, the sentence naming the benchmark they come from. Numbers are compared exactly: the same
    configuration planned twice gives the same floats (the same Python arithmetic in the same order)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = [f"{path}.{key}: added" for key in new.keys() - old.keys()]
        for key, value in old.items():
            if key in PLAN_PROSE or (key == "error" and isinstance(value, str)) or (
                    key == "source" and path.endswith(".error")) or (key == PLANNER_IDENTITY and "tree" in value):
                continue
            where = f"{path}.{key}"
            out += [f"{where}: lost"] if key not in new else plan_json_differences(value, new[key], where)
        return out
    if isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            return [f"{path}: {len(old)} items, now {len(new)}"]
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in plan_json_differences(a, b, f"{path}[{i}]")]
    if _number(old) and _number(new):
        return [] if old == new or (math.isnan(old) and math.isnan(new)) else [f"{path}: {old!r} -> {new!r}"]
    return [] if type(old) is type(new) and old == new else [f"{path}: {old!r} -> {new!r}"]


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def test_the_plan_json_comparison_sees_numbers_and_names_but_not_sentences():
    recorded = {"memory": {"peak": 10, "method": "trace"}, "reason": "fits: peak 1.0 GiB",
                "throughput": {"error": {"median": 0.2, "source": "benchmarks/report.py over 30 rows"}}}
    same_but_worded = {"memory": {"peak": 10, "method": "trace"}, "reason": "fits, 1 GiB",
                       "throughput": {"error": {"median": 0.2, "source": "report.py, 30 rows"}}}
    assert plan_json_differences(recorded, same_but_worded) == []
    moved = {"memory": {"peak": 11, "method": "analytic"}, "reason": "fits",
             "throughput": {"error": {"median": 0.25, "source": ""}, "extra": 1}}
    assert plan_json_differences(recorded, moved) == [
        ".memory.peak: 10 -> 11", ".memory.method: 'trace' -> 'analytic'", ".throughput.extra: added",
        ".throughput.error.median: 0.2 -> 0.25"]


def _installed_names(text: str) -> str:
    """training_args.json (recorded with transformers 5) with the Trainer's checkpointing arguments under the names
    the installed transformers takes."""
    data = json.loads(text)
    for old, new in CHECKPOINTING_ARGS.items():
        if new in data:
            data[checkpointing_arg(old)] = data.pop(new)
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def test_launch_command_and_exit_code(tmp_path):
    cmd = launch_command(tmp_path / "accelerate_config.yaml", ["train.py", "--epochs", "1"])
    assert cmd[-5:] == ["--config_file", str(tmp_path / "accelerate_config.yaml"), "train.py", "--epochs", "1"]
    with pytest.raises(InputError):
        launch_command(tmp_path / "a.yaml", [])
    assert run_launch([sys.executable, "-c", "import sys; sys.exit(7)"]) == 7


if __name__ == "__main__":
    if sys.argv[1:] != ["--record-plan-json"]:
        sys.exit("usage: python tests/test_emit.py --record-plan-json  (re-records the goldens' plan.json only)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for golden, gpus in GOLDEN_PLANS.items():
        _record_golden(GOLDEN / golden, _golden_plan_files(gpus), only=("plan.json",))
        print(f"{golden}/plan.json.gz recorded")
