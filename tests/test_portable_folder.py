"""A run folder planned on one machine trains on another: the emitted files name each other by file name, and whoever
reads them (launch.sh, `plan --launch`, `load_plan`, the shipped script) resolves the names against the folder. The
slow tests emit into tmp/a, move the folder to tmp/b and train from another directory, on the CPU."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
import yaml

from emit import EmitOptions, emit, launch_command
from planner import load_plan, plan

HERE = Path(__file__).parent
#: plan() arguments per case: one process, and DeepSpeed ZeRO-2 on two (gloo ranks on the CPU)
CASES = {"single": {"gpus_per_node": 1, "zero_stage": 0},
         "zero2": {"gpus_per_node": 2, "zero_stage": 2, "offload": "none"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=300, max_position_embeddings=256,
                             architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    return folder


def _plan(model_dir, case: str, **kw):
    return plan(str(model_dir), 8, gpu="A100-80GB", micro_batch=2, seq_len=64, precision="bf16-mixed", detect=False,
                **CASES[case], **kw)


def _moved(p, tmp_path, opts: EmitOptions = EmitOptions()) -> Path:
    """Emit into tmp/a, move the folder to tmp/b (a is gone); returns b."""
    emit(p, tmp_path / "a", opts)
    shutil.move(tmp_path / "a", tmp_path / "b")
    assert not (tmp_path / "a").exists()
    return tmp_path / "b"


def _env() -> dict:
    """This interpreter's `accelerate` first on PATH (launch.sh runs it by name), the hub offline."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def test_emitted_files_name_only_files_of_their_folder(model_dir, tmp_path):
    p = plan(str(model_dir), 64, gpu="A100-80GB", gpus_per_node=8, nodes=2, zero_stage=2, offload="none",
             seq_len=64, detect=False)
    emit(p, tmp_path / "run", EmitOptions(main_process_ip="10.0.0.1"))
    for file in (tmp_path / "run").iterdir():
        text = file.read_text()
        if file.name == "plan.json":  # `paths` keeps each local input absolute too, for a folder moved alone
            data = json.loads(text)
            assert {kind: where["relative"] for kind, where in data.pop("paths").items()} \
                == {"model": os.path.relpath(model_dir, tmp_path / "run")}
            text = json.dumps(data)
        assert str(tmp_path) not in text and str(tmp_path.resolve()) not in text, file.name
    raw = yaml.safe_load((tmp_path / "run" / "accelerate_config.yaml").read_text())
    assert raw["deepspeed_config"]["deepspeed_config_file"] == "ds_config.json"
    assert "deepspeed_hostfile" not in raw["deepspeed_config"]  # the standard launcher never reads one
    assert not (tmp_path / "run" / "hostfile").exists()
    assert json.loads((tmp_path / "run" / "training_args.json").read_text())["deepspeed"] == "ds_config.json"
    launch = (tmp_path / "run" / "launch.sh").read_text()
    assert '--deepspeed_config_file "$here/ds_config.json"' in launch
    assert "hostfile" not in launch


def test_load_plan_resolves_the_files_against_the_moved_folder(model_dir, tmp_path, monkeypatch):
    folder = _moved(_plan(model_dir, "zero2"), tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    # what `accelerate launch --config_file ../b/accelerate_config.yaml` exports from the config as written
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ds_config.json")
    loaded = load_plan(os.path.relpath(folder))
    args = loaded.training_arguments_dict()
    assert args["deepspeed"] == str(folder / "ds_config.json") and Path(args["deepspeed"]).is_file()
    assert args["output_dir"] == str(folder / "output")
    assert os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == str(folder / "ds_config.json")  # for an Accelerator()
    assert loaded.training_arguments_dict(deepspeed="mine.json")["deepspeed"] == "mine.json"  # overrides stay


def test_plan_launch_gives_accelerate_the_folder_files(model_dir, tmp_path):
    folder = _moved(_plan(model_dir, "zero2"), tmp_path)
    cmd = launch_command(folder / "accelerate_config.yaml", ["train.py"])
    at = cmd.index("--deepspeed_config_file")
    assert cmd[at + 1] == str(folder / "ds_config.json")
    assert cmd[-3:] == ["--config_file", str(folder / "accelerate_config.yaml"), "train.py"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)  # noqa: S603
    # a rank's own error comes before the launcher's summary: show the lines that name one
    causes = [ln for ln in done.stderr.splitlines() if re.search(r"Error|error:|terminate|what\(\)|Abort", ln)]
    if done.returncode:  # the whole run, in the report's captured output: where a rank aborted, and after what
        print(f"$ {' '.join(cmd)}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")
    assert done.returncode == 0, ("\n".join(causes[-20:]), done.stdout[-2000:], done.stderr[-4000:])
    return done


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
@pytest.mark.long
def test_shipped_script_trains_from_the_moved_folder(case, model_dir, tmp_path):
    """launch.sh from another directory for one process; the README's `accelerate launch --config_file
    b/accelerate_config.yaml -m probes.train --plan b` from the folder's parent for ZeRO-2."""
    p = _plan(model_dir, case)
    folder = _moved(p, tmp_path)
    script = ["-m", "probes.train", "--plan", str(folder), "--steps", "1", "--warmup", "0"]
    if case == "single":
        (tmp_path / "elsewhere").mkdir()
        done = _run([str(folder / "launch.sh"), *script], tmp_path / "elsewhere")
    else:
        relative = ["-m", "probes.train", "--plan", "b", "--steps", "1", "--warmup", "0"]
        # a free rendezvous port: the default 29500 may be held by another job on a shared machine
        done = _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "b/accelerate_config.yaml",
                     "--main_process_port", str(_free_port()), *relative], tmp_path)
    results = [json.loads(ln.split(" ", 1)[1]) for ln in done.stdout.splitlines() if ln.startswith("PROBE-RESULT")]
    assert [r["status"] for r in results] == ["ok"] * CASES[case]["gpus_per_node"], results
    assert {r["engine"] for r in results} == {p.choice.config.engine}
    progress = [ln for ln in done.stderr.splitlines() if ln.startswith("step ")]
    assert len(progress) == 1 and re.fullmatch(r"step 1/1  loss \d+\.\d{4}  \d+\.\d\d s", progress[0]), progress


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
@pytest.mark.long
def test_a_plain_trainer_script_trains_from_the_moved_folder(case, model_dir, tmp_path):
    """tests/trainer_example.py (load_plan(...).prepare(model) and .training_arguments() only): the README's
    `accelerate launch --config_file` from the folder's parent for one process, launch.sh elsewhere for ZeRO-2."""
    folder = _moved(_plan(model_dir, case), tmp_path)
    script = [str(HERE / "trainer_example.py"), str(folder), str(model_dir)]
    if case == "single":
        _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "b/accelerate_config.yaml",
              *script], tmp_path)
    else:
        (tmp_path / "elsewhere").mkdir()
        done = _run([str(folder / "launch.sh"), *script], tmp_path / "elsewhere")
        assert "DeepSpeed" in done.stdout + done.stderr  # the run went through DeepSpeed, not plain DDP
