"""`load_plan(...).prepare(model)` and `.training_arguments()`: what the emitted files cannot say, applied."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers

from emit import emit
from planner import load_plan, plan
from planner.errors import InputError
from planner.export import CHECKPOINTING_ARGS, checkpointing_arg

A100 = "A100-80GB"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, vocab_size=300, architectures=["LlamaForCausalLM"])
    config.save_pretrained(folder)
    return folder, config


def _emitted(tiny, tmp_path, **kw):
    folder, _ = tiny
    p = plan(str(folder), 8, gpu=A100, seq_len=32, micro_batch=2, **kw)
    emit(p, tmp_path / "run")
    return load_plan(tmp_path / "run" / "plan.json"), p


def _model(tiny):
    return transformers.LlamaForCausalLM._from_config(tiny[1])


def test_selective_plan_applies_the_per_op_policy_and_keeps_the_trainer_flag_off(tiny, tmp_path):
    loaded, p = _emitted(tiny, tmp_path, zero_stage=0, checkpointing="selective")
    model = loaded.prepare(_model(tiny))
    assert model.is_activation_checkpointing
    args = loaded.training_arguments(use_cpu=True)
    assert isinstance(args, transformers.TrainingArguments)
    assert args.gradient_checkpointing is False  # the Trainer would replace the selective policy with full
    assert args.per_device_train_batch_size == 2 and args.gradient_accumulation_steps == p.choice.config.grad_accum
    assert args.ddp_find_unused_parameters is False and args.lr_scheduler_type == "linear"


def test_bf16_true_plan_trains_bf16_weights_without_autocast(tiny, tmp_path):
    loaded, _ = _emitted(tiny, tmp_path, zero_stage=0, precision="bf16-true")
    model = loaded.prepare(_model(tiny))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    data = json.loads((tmp_path / "run" / "training_args.json").read_text())
    assert data["bf16"] is False and data["fp16"] is False  # no autocast over the bf16 weights
    acc = (tmp_path / "run" / "accelerate_config.yaml").read_text()
    assert "mixed_precision: 'no'" in acc


def test_attention_implementation_follows_the_plan(tiny, tmp_path):
    loaded, _ = _emitted(tiny, tmp_path, zero_stage=0, attention="eager")
    model = loaded.prepare(_model(tiny))
    assert model.config._attn_implementation == "eager"


def test_fsdp_full_checkpointing_is_left_to_fsdp(tiny, tmp_path):
    folder, _ = tiny
    p = plan(str(folder), 16, gpu=A100, gpus_per_node=2, seq_len=32, zero_stage=3, engine="fsdp",
             checkpointing="full", offload="none")
    emit(p, tmp_path / "run")
    model = load_plan(tmp_path / "run").prepare(_model(tiny))
    assert not model.is_activation_checkpointing


def test_sgd_momentum_is_emitted_as_itself(tiny, tmp_path):
    loaded, _ = _emitted(tiny, tmp_path, zero_stage=0, optimizer="sgd-momentum")
    args = loaded.training_arguments(use_cpu=True)
    assert args.optim == "sgd" and args.optim_args == "momentum=0.9"


def test_load_plan_refuses_what_is_not_a_plan(tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(InputError, match="not a plan"):
        load_plan(tmp_path)
    with pytest.raises(InputError):
        load_plan(tmp_path / "missing")


@pytest.mark.parametrize("names", ["old", "new"])
def test_training_arguments_take_either_checkpointing_name(names, tiny, tmp_path):
    """A training_args.json from transformers 4 (gradient_checkpointing) or 5 (activation_checkpointing) builds the
    installed TrainingArguments without a deprecation warning."""
    loaded, _ = _emitted(tiny, tmp_path, zero_stage=0, checkpointing="full")
    file = tmp_path / "run" / "training_args.json"
    data = json.loads(file.read_text())
    for old, new in CHECKPOINTING_ARGS.items():
        value = data.pop(checkpointing_arg(old))
        data[old if names == "old" else new] = value
    file.write_text(json.dumps(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        args = loaded.training_arguments(use_cpu=True)
        unset = loaded.training_arguments(use_cpu=True, gradient_checkpointing=False)  # an override in the old name
    assert args.gradient_checkpointing is True and args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert unset.gradient_checkpointing is False
