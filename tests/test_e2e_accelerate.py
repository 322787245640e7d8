"""End to end on the CPU: the emitted accelerate + DeepSpeed ZeRO-2 configs train a tiny random-init model for
two optimizer steps through `accelerate launch`, at the planned micro-batch and accumulation."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import transformers

from emit import emit, launch_command
from planner import plan

pytest.importorskip("deepspeed")


def test_accelerate_launch_trains_two_steps_with_the_plan(tmp_path):
    model_dir = tmp_path / "model"
    transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0,
                            eos_token_id=0, architectures=["GPT2LMHeadModel"]).save_pretrained(model_dir)
    p = plan(str(model_dir), 8, gpu="A100-80GB", zero_stage=2, micro_batch=2, lr=1e-3)
    cfg = p.choice.config
    assert (cfg.zero_stage, cfg.micro_batch, cfg.grad_accum) == (2, 2, 4)
    out = tmp_path / "run"
    emit(p, out)
    script = Path(__file__).with_name("e2e_train.py")
    cmd = launch_command(out / "accelerate_config.yaml", [str(script), str(model_dir), str(out / "training_args.json")])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)  # noqa: S603
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("TRAINED")), None)
    assert done.returncode == 0 and line, done.stdout[-2000:] + done.stderr[-4000:]
    fields = dict(re.findall(r"(\w+)=(\S+)", line))
    assert fields["steps"] == "2"
    assert fields["micro_batch"] == str(cfg.micro_batch) and fields["batch_seen"] == str(cfg.micro_batch)
    assert fields["accum"] == str(cfg.grad_accum) and fields["engine_accum"] == str(cfg.grad_accum)
