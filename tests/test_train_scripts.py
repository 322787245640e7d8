"""The training scripts `plan --emit` ships (train.py for the Trainer, train_trl.py for TRL's SFTTrainer) train a local
model on a local dataset from a moved folder, on the CPU; a CPU trial turns off what cannot run here and says so once
each; a folder whose local model is gone fails in one line."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from emit import emit
from planner import load_plan, plan
from planner.prepare import cpu_trial
from tiny import tiny_llama, write_chats

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A project folder: models/tiny-llama, data/chats.jsonl."""
    root = tmp_path_factory.mktemp("project")
    tiny_llama(root / "models" / "tiny-llama")
    (root / "data").mkdir()
    write_chats(root / "data" / "chats.jsonl")
    return root


def _plan(project: Path, **kw):
    pytest.importorskip("datasets", reason="a dataset plan reads Parquet and hub data through datasets")
    return plan(str(project / "models" / "tiny-llama"), 4, gpu="A100-80GB", gpus_per_node=1, zero_stage=0,
                dataset=str(project / "data" / "chats.jsonl"), max_length=64, detect=False, **kw)


def _env() -> dict:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}


def _run(cmd: list, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True, text=True,  # noqa: S603
                          timeout=600)


def _no_native_half(monkeypatch):
    """This CPU as one without bf16 or fp16 instructions (an AVX2-only one)."""
    monkeypatch.setattr("planner.hardware.cpu.cpu_features", lambda: frozenset({"avx2", "fma3"}))


def test_cpu_trial_turns_off_what_cannot_run_here_once_each(monkeypatch):
    _no_native_half(monkeypatch)
    args, changes = cpu_trial({"bf16": True, "tf32": True, "use_liger_kernel": True, "optim": "adamw_bnb_8bit"})
    assert (args["use_cpu"], args["bf16"], args["tf32"], args["use_liger_kernel"], args["optim"]) == \
        (True, False, None, False, "adamw_torch")
    assert len(changes) == 5 and all("\n" not in line for line in changes)
    assert any("Liger" in line for line in changes) and any("adamw_bnb_8bit" in line for line in changes)
    assert any(line.startswith("fp32 instead of bf16") and "avx512_bf16" in line for line in changes)
    assert cpu_trial({"use_cpu": True, "bf16": False}) == ({"use_cpu": True, "bf16": False}, [])


def test_a_cpu_with_native_bf16_keeps_the_plan_s_bf16(monkeypatch):
    monkeypatch.setattr("planner.hardware.cpu.cpu_features", lambda: frozenset({"avx2", "avx512_bf16"}))
    args, changes = cpu_trial({"bf16": True, "use_cpu": True})
    assert args["bf16"] and changes == []


def test_a_bf16_plan_trains_fp32_on_a_cpu_without_bf16_and_its_files_keep_bf16(monkeypatch, tmp_path):
    """The accelerate config's bf16 (ACCELERATE_MIXED_PRECISION, which `accelerate launch` exports) would come back
    through TrainingArguments: the trial's arguments say "no"; the DeepSpeed config is turned off with them."""
    _no_native_half(monkeypatch)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    p = plan("gpt2", 8, gpu="A100-80GB", seq_len=128, engine="deepspeed", zero_stage=2, detect=False, liger="off")
    emit(p, tmp_path / "run")
    args = load_plan(tmp_path / "run").training_arguments(output_dir=str(tmp_path / "out"))
    assert (args.bf16, args.mixed_precision, args.deepspeed["bf16"]["enabled"]) == (False, "no", False)
    assert json.loads((tmp_path / "run" / "ds_config.json").read_text())["bf16"]["enabled"] is True
    assert json.loads((tmp_path / "run" / "training_args.json").read_text())["bf16"] is True


def test_importing_the_trainer_after_trainplan_prints_no_import_notices():
    """transformers imports torchao where it is installed; its notices about kernels no plan calls are dropped."""
    pytest.importorskip("torchao", reason="the notices come from torchao's import")
    code = "import planner, logging; logging.basicConfig(); from transformers import Trainer; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    assert "Failed to load" not in done.stderr and "Enum subclass" not in done.stderr, done.stderr[-2000:]


@pytest.mark.long
def test_a_liger_plan_s_arguments_run_on_a_cpu_and_say_what_they_turned_off(tmp_path, caplog):
    p = plan("meta-llama/Llama-3.1-8B", 64, gpu="A100-80GB", seq_len=1024, peft="lora", liger="on", detect=False)
    assert p.choice.config.liger
    emit(p, tmp_path / "run")
    loaded = load_plan(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="planner"):
        args = loaded.training_arguments(output_dir=str(tmp_path / "out"), use_cpu=True)
    assert args.use_liger_kernel is False and args.use_cpu
    lines = [r.getMessage() for r in caplog.records if r.name == "planner"]
    assert lines == [f"CPU trial: {line}" for line in loaded.cpu_changes] and any("Liger" in x for x in lines)


def test_a_qlora_plan_loads_its_base_unquantised_without_cuda(caplog):
    pytest.importorskip("peft", reason="QLoRA plans need peft")
    if __import__("torch").cuda.is_available():
        pytest.skip("with CUDA the 4-bit base is loaded as planned")
    p = plan("meta-llama/Llama-3.1-8B", 16, gpu="RTX4090-24GB", seq_len=1024, peft="qlora", detect=False)
    with caplog.at_level(logging.WARNING, logger="planner"):
        kwargs = p.from_pretrained_kwargs()
    assert "quantization_config" not in kwargs
    assert any("4-bit base is off" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("script", ["train.py", "train_trl.py"])
@pytest.mark.long
def test_the_shipped_scripts_train_from_a_moved_folder(script, project, tmp_path):
    if script == "train_trl.py":
        pytest.importorskip("trl", reason="train_trl.py trains with TRL's SFTTrainer")
    p = _plan(project, padding="packing" if script == "train.py" else "auto")
    emit(p, tmp_path / "a")
    shutil.move(tmp_path / "a", tmp_path / "b")
    (tmp_path / "elsewhere").mkdir()
    done = _run([tmp_path / "b" / "launch.sh", tmp_path / "b" / script, "--max-steps", "2"], tmp_path / "elsewhere")
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "b" / "out" / "model.safetensors").is_file()
    state = json.loads(next((tmp_path / "b" / "out").glob("checkpoint-*/trainer_state.json")).read_text())
    assert state["global_step"] == 2


def test_a_moved_project_finds_its_model_and_data_relative_to_the_folder(project, tmp_path):
    p = _plan(project)
    emit(p, project / "run")
    moved = tmp_path / "moved"
    shutil.copytree(project, moved)
    loaded = load_plan(moved / "run")
    assert loaded.model_name == os.path.normpath(moved / "models" / "tiny-llama")
    assert loaded.dataset_source == os.path.normpath(moved / "data" / "chats.jsonl")


def test_a_folder_whose_model_is_gone_fails_in_one_line(project, tmp_path):
    copy = tmp_path / "project"
    shutil.copytree(project, copy)
    p = plan(str(copy / "models" / "tiny-llama"), 4, gpu="A100-80GB", gpus_per_node=1, zero_stage=0, seq_len=32,
             detect=False)
    emit(p, tmp_path / "run")
    shutil.rmtree(copy / "models")
    done = _run([sys.executable, "-m", "probes.train", "--plan", tmp_path / "run"], tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("probes.train: the plan's model") and "Traceback" not in done.stderr
