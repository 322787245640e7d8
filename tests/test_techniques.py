"""The seed articles' toolbox, planned: TF32, LAMB / Sophia, loss normalisation, fp16 loss scaling."""

from __future__ import annotations

import json

import pytest

from emit import emit
from planner import plan
from planner.errors import InputError
from planner.hardware import lookup_gpu
from planner.render import note_text


def kinds(p) -> set[str]:
    return {n.kind for n in p.notes}


def note_of(p, kind: str):
    return next(n for n in p.notes if n.kind == kind)


def test_fp32_on_an_a100_says_what_tf32_gains():
    p = plan("bigscience/bloom-560m", 64, gpu="A100-80GB", precision="fp32")
    gain = note_of(p, "tf32-gain")
    assert gain["gain"] == pytest.approx(gain["step_s"] / gain["tf32_step_s"]) and gain["gain"] > 1.5
    tf32 = plan("bigscience/bloom-560m", 64, gpu="A100-80GB", precision="tf32")
    assert tf32.choice.memory.peak == pytest.approx(p.choice.memory.peak, rel=0.01)  # the same bytes
    # the note times TF32 on the fp32 plan's own configuration, so a TF32 plan free to re-split is no slower
    assert tf32.choice.throughput.step_time_s <= gain["tf32_step_s"] * (1 + 1e-9)


def test_tf32_is_a_candidate_of_its_own_and_rejected_where_the_gpu_lacks_it():
    a100 = plan("gpt2", 32, gpu="A100-80GB", seq_len=512)
    assert {"tf32", "fp32"} <= {c.config.precision for c in a100.candidates}
    speed = {c.config.model_copy(update={"precision": "x"}): c.throughput.tokens_per_s
             for c in a100.candidates if c.config.precision == "tf32" and c.throughput}
    fp32 = [c for c in a100.candidates if c.config.precision == "fp32" and c.throughput]
    # TF32 speeds the GPU's matmuls; a step the host binds (micro-batch 1 under selective checkpointing's policy
    # mode) runs as long either way
    device_bound = [c for c in fp32 if c.config.micro_batch >= 4]
    assert fp32 and all(c.throughput.tokens_per_s <= speed[c.config.model_copy(update={"precision": "x"})]
                        for c in fp32)
    assert device_bound and all(c.throughput.tokens_per_s < speed[c.config.model_copy(update={"precision": "x"})]
                                for c in device_bound)
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
    cpu = loaded.training_arguments(use_cpu=True)  # transformers raises for tf32 on a CPU: the trial turns it off
    assert not cpu.tf32 and any(line.startswith("tf32 off") for line in loaded.cpu_changes)
    assert isinstance(loaded.training_arguments(use_cpu=True, tf32=None), transformers.TrainingArguments)


def test_tf32_on_a_gpu_without_it_is_an_input_error():
    with pytest.raises(InputError, match="no TF32"):
        plan("gpt2", 8, gpu="T4-16GB", precision="tf32")


def test_token_losses_over_accumulated_micro_batches_are_normalised_as_the_trainer_does(tmp_path):
    import transformers

    from planner.models import resolve_model
    from planner.planning import _accepts_loss_kwargs

    p = plan("gpt2", 64, gpu="T4-16GB", seq_len=1024, micro_batch=4)
    assert note_of(p, "loss-normalised").values == {"grad_accum": p.choice.config.grad_accum, "global_batch": 64}
    cls = plan("google-bert/bert-base-uncased", 64, gpu="T4-16GB", seq_len=128, micro_batch=4, task="seq-cls",
               num_labels=2)
    assert not {"loss-normalised", "loss-averaged"} & kinds(cls)  # one label per sample: a mean of means is exact
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                      vocab_size=100, architectures=["LlamaForCausalLM"])
    trainer = transformers.Trainer(model=transformers.LlamaForCausalLM(config),
                                   args=transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                                                       report_to="none"))
    assert _accepts_loss_kwargs(resolve_model(config)) is trainer.model_accepts_loss_kwargs is True


def test_fp16_loss_scaling_is_stated_and_is_what_the_libraries_run(tmp_path):
    import inspect

    import torch

    torch_plan = plan("gpt2", 8, gpu="T4-16GB", seq_len=256, zero_stage=0)
    policy = json.loads(json.dumps(torch_plan.to_json()))["loss_scaling"]
    defaults = inspect.signature(torch.amp.GradScaler.__init__).parameters
    assert policy["engine"] == "torch.amp.GradScaler"
    assert {k: policy[k] for k in ("init_scale", "growth_factor", "backoff_factor", "growth_interval")} == \
        {k: defaults[k].default for k in ("init_scale", "growth_factor", "backoff_factor", "growth_interval")}
    assert note_of(torch_plan, "fp16-loss-scaling").values == policy
    ds_plan = plan("gpt2", 8, gpu="T4-16GB", gpus_per_node=2, seq_len=256, zero_stage=2, offload="none")
    emit(ds_plan, tmp_path / "run")
    ds = json.loads((tmp_path / "run" / "ds_config.json").read_text())["fp16"]
    written = json.loads((tmp_path / "run" / "plan.json").read_text())["loss_scaling"]
    assert all(written[k] == ds[k] for k in ("initial_scale_power", "loss_scale_window", "hysteresis",
                                              "min_loss_scale", "loss_scale"))
    assert plan("gpt2", 8, gpu="A100-80GB", seq_len=256).to_json()["loss_scaling"] is None  # bf16: no scaling


def test_batchnorm_gets_the_accumulation_warning_with_what_to_do():
    from planner.planning import _lr_notes

    p = plan("gpt2", 64, gpu="A100-80GB", micro_batch=4, seq_len=128)
    assert "batchnorm" not in kinds(p)
    with_bn = p.model_copy(update={"model": p.model.model_copy(update={"has_batchnorm": True})})
    note = next(n for n in _lr_notes(with_bn) if n.kind == "batchnorm")
    assert note["micro_batch"] == 4
    text = note_text(note)
    assert "SyncBatchNorm" in text and "LayerNorm" in text


def test_tensor_parallel_candidates_stand_beside_zero3_for_a_70b_model(tmp_path):
    import yaml
    from accelerate.parallelism_config import ParallelismConfig

    p = plan("meta-llama/Llama-3.1-70B", 512, gpu="H100-80GB", gpus_per_node=8, nodes=4)
    kinds = {(c.config.tensor_parallel, c.config.engine, c.config.zero_stage) for c in p.candidates if c.fits}
    assert {t for t, _, _ in kinds} >= {1, 2, 4, 8} and ("deepspeed" in {e for _, e, z in kinds if z == 3})
    cfg = p.choice.config
    assert cfg.tensor_parallel * cfg.data_parallel == 32 and cfg.global_batch == 512
    assert cfg.tensor_parallel == 1 or note_of(p, "tensor-parallel")["speedup"] > 1
    tp = next(c for c in p.candidates if c.fits and c.config.tensor_parallel == 8)
    from emit import EmitOptions

    emit(p.model_copy(update={"choice": tp}), tmp_path / "run", EmitOptions(main_process_ip="10.0.0.1"))
    acc = yaml.safe_load((tmp_path / "run" / "accelerate_config.yaml").read_text())
    assert acc["distributed_type"] == "FSDP" and acc["fsdp_config"]["fsdp_version"] == 2
    sizes = acc["parallelism_config"]
    pc = ParallelismConfig(dp_shard_size=sizes["parallelism_config_dp_shard_size"],
                           tp_size=sizes["parallelism_config_tp_size"])
    assert pc.tp_size == 8 and pc.dp_shard_size == 4


def test_tensor_parallel_splits_memory_and_pays_all_reduces():
    p = plan("meta-llama/Llama-3.1-8B", 64, seq_len=4096, gpu="H100-80GB", gpus_per_node=8, micro_batch=2,
             checkpointing="none", precision="bf16-mixed", engine="fsdp")
    tp = {c.config.tensor_parallel: c for c in p.candidates
          if c.config.engine == "fsdp" and c.config.zero_stage == 3 and c.config.offload == "none"}
    assert tp[8].memory.activations < tp[1].memory.activations / 2  # the heads and MLP split 8 ways
    assert tp[8].memory.activations > tp[1].memory.activations / 8  # norms, residual and logits stay whole
    assert tp[8].throughput.parts.compute > tp[1].throughput.parts.compute / 8  # the all-reduces are waited for


@pytest.mark.long
def test_models_without_a_tp_plan_say_why_and_prepare_checks_the_split(tmp_path):
    import transformers

    from planner import load_plan

    p = plan("bigscience/bloom-560m", 64, gpu="A100-80GB", gpus_per_node=8)
    assert note_of(p, "no-tp-plan")["architecture"] == "BloomForCausalLM"
    assert all(c.config.tensor_parallel == 1 for c in p.candidates)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=300,
                                      architectures=["LlamaForCausalLM"])
    config.save_pretrained(tmp_path / "tiny")
    q = plan(str(tmp_path / "tiny"), 32, gpu="A100-80GB", gpus_per_node=4, seq_len=64)
    tp = next(c for c in q.candidates if c.fits and c.config.tensor_parallel == 4)
    emit(q.model_copy(update={"choice": tp}), tmp_path / "run")
    loaded = load_plan(tmp_path / "run")
    assert loaded.from_pretrained_kwargs() == {"tp_plan": "auto"}
    with pytest.raises(InputError, match="not split"):
        loaded.prepare(transformers.LlamaForCausalLM(config))


def test_lamb_is_planned_unsharded_with_warmup_and_built_by_the_script(tmp_path):
    import transformers

    from planner import load_plan
    from planner.lr import scale_lr

    lamb = plan("gpt2", 64, gpu="A100-80GB", gpus_per_node=2, seq_len=256, optimizer="lamb", precision="bf16-mixed")
    adam = plan("gpt2", 64, gpu="A100-80GB", gpus_per_node=2, seq_len=256, optimizer="adamw", precision="bf16-mixed",
                zero_stage=0)
    assert lamb.choice.config.zero_stage == 0 and lamb.choice.memory.optimizer_states == \
        adam.choice.memory.optimizer_states  # two fp32 moments, as Adam
    assert lamb.choice.throughput.parts.optimizer > adam.choice.throughput.parts.optimizer  # the trust-ratio norms
    assert note_of(lamb, "optimizer-client")["client"] == "bitsandbytes.optim.LAMB"
    with pytest.raises(InputError, match="per-layer trust ratio"):
        plan("gpt2", 64, gpu="A100-80GB", gpus_per_node=2, seq_len=256, optimizer="lamb", zero_stage=2,
             offload="none")
    assert scale_lr(1e-3, 512, 256, "auto", "lamb", 1000).warmup_steps > 0  # x1.4 already warms up, as LAMB is used
    assert scale_lr(1e-3, 512, 256, "auto", "adamw", 1000).warmup_steps == 0
    emit(lamb, tmp_path / "run")
    loaded = load_plan(tmp_path / "run")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2))
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        with pytest.raises(InputError, match="bitsandbytes"):
            loaded.create_optimizer(model)
    assert load_plan(_emitted_adamw(tmp_path)).create_optimizer(model) is None


def _emitted_adamw(tmp_path):
    emit(plan("gpt2", 8, gpu="A100-80GB", seq_len=128), tmp_path / "adamw")
    return tmp_path / "adamw"


def test_sophia_is_planned_but_not_emitted(tmp_path):
    from typer.testing import CliRunner

    from planner.cli import app

    p = plan("gpt2", 8, gpu="A100-80GB", seq_len=128, optimizer="sophia", precision="fp32")
    assert p.choice.memory.optimizer_states == 8 * p.model.trainable_parameters
    result = CliRunner().invoke(app, ["--model", "gpt2", "--batch", "8", "--gpu", "A100-80GB", "--optimizer",
                                      "sophia", "--emit", str(tmp_path / "run")])
    assert result.exit_code == 2 and "--optimizer" in result.output and "implements sophia" in result.output
    assert not (tmp_path / "run" / "training_args.json").exists()
