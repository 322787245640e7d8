"""The seed articles' toolbox, planned: TF32, LAMB / Sophia, loss normalisation, fp16 loss scaling."""

from __future__ import annotations

import json

import pytest

from emit import emit
from planner import plan
from planner.errors import InputError
from planner.hardware import lookup_gpu


def test_fp32_on_an_a100_says_what_tf32_gains():
    p = plan("bigscience/bloom-560m", 64, gpu="A100-80GB", precision="fp32")
    note = next(n for n in p.notes if "TF32" in n)
    gain = float(note.split("x faster")[0].rsplit(" ", 1)[-1])
    assert gain > 1.5 and "--precision tf32" in note
    tf32 = plan("bigscience/bloom-560m", 64, gpu="A100-80GB", precision="tf32")
    assert tf32.choice.memory.peak == pytest.approx(p.choice.memory.peak, rel=0.01)  # the same bytes
    assert tf32.choice.throughput.step_time_s < p.choice.throughput.step_time_s / 1.5


def test_tf32_is_a_candidate_of_its_own_and_rejected_where_the_gpu_lacks_it():
    a100 = plan("gpt2", 32, gpu="A100-80GB", seq_len=512)
    assert {"tf32", "fp32"} <= {c.config.precision for c in a100.candidates}
    speed = {c.config.model_copy(update={"precision": "x"}): c.throughput.tokens_per_s
             for c in a100.candidates if c.config.precision == "tf32" and c.throughput}
    fp32 = [c for c in a100.candidates if c.config.precision == "fp32" and c.throughput]
    assert fp32 and all(c.throughput.tokens_per_s < speed[c.config.model_copy(update={"precision": "x"})]
                        for c in fp32)
    v100 = plan("gpt2", 32, gpu="V100-32GB", seq_len=512)
    rejected = [c for c in v100.candidates if c.config.precision == "tf32"]
    assert rejected and "no TF32 tensor cores" in rejected[0].reason
    assert lookup_gpu("T4-16GB").cannot_run("tf32") and not lookup_gpu("H100-80GB").cannot_run("tf32")


def test_tf32_is_emitted_for_the_trainer_and_applied_by_prepare(tmp_path):
    import torch
    import transformers

    from planner import load_plan

    p = plan("gpt2", 8, gpu="A100-80GB", precision="tf32", seq_len=128)
    emit(p, tmp_path / "run")
    args = json.loads((tmp_path / "run" / "training_args.json").read_text())
    assert args["tf32"] is True and args["bf16"] is False and args["fp16"] is False
    loaded = load_plan(tmp_path / "run")
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        loaded.prepare(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)))
        assert torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    with pytest.raises(ValueError, match="tf32"):  # what transformers does with it on a machine without TF32
        loaded.training_arguments(use_cpu=True)
    assert isinstance(loaded.training_arguments(use_cpu=True, tf32=None), transformers.TrainingArguments)


def test_tf32_on_a_gpu_without_it_is_an_input_error():
    with pytest.raises(InputError, match="no TF32"):
        plan("gpt2", 8, gpu="T4-16GB", precision="tf32")
