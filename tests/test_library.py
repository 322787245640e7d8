"""The library as a launcher uses it: the public names, and the object `plan()` returns applied and written directly."""

from __future__ import annotations

import json

import transformers

import planner


def _tiny_llama():
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=300, architectures=["LlamaForCausalLM"])


def test_the_public_api_is_listed_and_loads():
    names = {"plan", "estimate_memory", "load_plan", "Plan", "PlanRequest", "Adapter", "InputError", "NoFitError"}
    assert names <= set(planner.__all__) and set(planner.__all__) <= set(dir(planner))
    assert all(getattr(planner, name) is not None for name in planner.__all__)


def test_the_plan_object_prepares_a_model_builds_its_arguments_and_writes_its_files(tmp_path):
    config = _tiny_llama()
    p = planner.plan(config, 8, gpu="A100-80GB", seq_len=64, peft="lora", lora_rank=4, detect=False)
    assert p.model.adapter["method"] == "lora" and p.model.adapter["rank"] == 4  # --peft lora, as a keyword
    model = p.prepare(transformers.LlamaForCausalLM(config))
    assert hasattr(model, "peft_config") and model.peft_config["default"].r == 4
    args = p.training_arguments(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False)
    cfg = p.choice.config
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (cfg.micro_batch, cfg.grad_accum)
    written = p.emit(tmp_path / "run")
    assert str(tmp_path / "run" / "plan.json") in written
    loaded = planner.load_plan(tmp_path / "run")
    assert loaded.choice.config == cfg  # the shape of plan().choice
    assert json.loads((tmp_path / "run" / "training_args.json").read_text())["gradient_accumulation_steps"] == \
        cfg.grad_accum


def test_a_deepspeed_plan_in_memory_carries_its_config_as_a_dict():
    p = planner.plan("gpt2", 16, gpu="A100-80GB", gpus_per_node=2, seq_len=128, zero_stage=2, offload="none",
                     detect=False)
    args = p._loaded().training_arguments_dict()
    assert args["deepspeed"] == p.to_deepspeed() and args["deepspeed"]["zero_optimization"]["stage"] == 2


def test_every_lazy_name_is_public():
    assert set(planner._LAZY) <= set(planner.__all__)
