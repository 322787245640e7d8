"""A Trainer script we did not write (the transformers quick tour's, see trainer_example.py) trains with the emitted
files and the one `plan.prepare(model)` line: selective checkpointing lands between none and full, and a bf16-true
plan trains 16-bit weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from typer.testing import CliRunner

from planner.cli import app

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    transformers.LlamaConfig(num_hidden_layers=3, hidden_size=128, intermediate_size=384, num_attention_heads=4,
                             vocab_size=256, max_position_embeddings=512,
                             architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    return folder


def _peak(model_dir, tmp_path, precision: str, checkpointing: str) -> tuple[int, str]:
    out = tmp_path / f"{precision}-{checkpointing}"
    result = CliRunner().invoke(app, ["--model", str(model_dir), "--batch", "4", "--micro-batch", "4", "--seq-len",
                                      "256", "--gpu", "A100-80GB", "--zero-stage", "0", "--precision", precision,
                                      "--checkpointing", checkpointing, "--no-probe", "--emit", str(out)])
    assert result.exit_code == 0, result.output
    cmd = [sys.executable, str(HERE / "tracked_run.py"), str(HERE / "trainer_example.py"), str(out), str(model_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,  # noqa: S603
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("PEAK ")), None)
    assert done.returncode == 0 and line, done.stderr[-3000:]
    _, peak, dtype = line.split()
    return int(peak), dtype


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
@pytest.mark.long
def test_selective_plan_lands_between_none_and_full(model_dir, tmp_path, precision):
    peaks = {ck: _peak(model_dir, tmp_path, precision, ck) for ck in ("none", "selective", "full")}
    assert peaks["full"][0] < peaks["selective"][0] < peaks["none"][0], peaks
    expected = "torch.bfloat16" if precision == "bf16-true" else "torch.float32"
    assert {dtype for _, dtype in peaks.values()} == {expected}
