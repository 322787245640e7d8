"""The `plan` CLI in-process (typer's CliRunner) and once as the real console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_help_console_script_is_fast():
    script = Path(sys.executable).with_name("plan")
    assert script.exists(), script
    start = time.perf_counter()
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    assert "--model" in proc.stdout and "--batch" in proc.stdout
    assert elapsed < 1.5, f"plan --help took {elapsed:.2f} s"


def test_list_gpus_json():
    result = invoke("--list-gpus", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert len(rows) == 16
    assert {"A100-80GB", "H100-80GB", "T4-16GB"} <= {r["name"] for r in rows}


def test_list_models():
    result = invoke("--list-models")
    assert result.exit_code == 0, result.output
    assert "gpt2" in result.stdout


def test_list_models_json():
    result = invoke("--list-models", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert len(rows) >= 30
    assert any(r["id"] == "openai-community/gpt2" for r in rows)


BAD = [
    (["--model", "gpt2", "--batch", "0"], "--batch"),
    (["--model", "gpt2", "--batch", "abc"], "--batch"),
    (["--model", "gpt2", "--batch", "8", "--gpu", "Z100"], "--gpu"),
    (["--model", "nope/nope", "--batch", "8"], "--model"),
    (["--model", "gpt2", "--batch", "8", "--precision", "fp8"], "--precision"),
    (["--model", "gpt2", "--batch", "8", "--headroom", "2"], "--headroom"),
    (["--model", "gpt2", "--batch", "8", "--zero-stage", "5"], "--zero-stage"),
    (["--batch", "8"], "--model"),
    (["--model", "gpt2"], "--batch"),
]


@pytest.mark.parametrize(("args", "flag"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_exits_2_naming_the_flag(args, flag):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert flag in result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) <= 6, result.output


def test_batch_not_divisible_by_gpus():
    result = invoke("--model", "gpt2", "--batch", "7", "--gpus-per-node", "2", "--gpu", "A100-80GB")
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "--batch" in result.output
    assert "6" in result.output and "8" in result.output
    assert "Traceback" not in result.output


def test_plan_gpt2_json():
    result = invoke("--model", "gpt2", "--batch", "8", "--gpu", "A100-80GB", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert {"model", "hardware", "choice", "memory", "throughput", "candidates", "files"} <= set(data)
    assert data["model"]["parameters"] == 124_439_808
    assert data["hardware"]["gpu"] == "A100-80GB"
    assert data["hardware"]["detected"] is False
    choice = data["choice"]
    assert choice["micro_batch"] * choice["grad_accum"] * choice["world_size"] == 8
    assert choice["global_batch"] == 8
    assert data["candidates"]
    assert data["memory"]["peak"] > 0


def test_plan_without_gpu_uses_reference():
    from planner.hardware import detect_gpus

    if detect_gpus() is not None:
        pytest.skip("a GPU is detected here")
    result = invoke("--model", "gpt2", "--batch", "8")
    assert result.exit_code == 0, result.output
    assert "reference A100-80GB" in result.output
