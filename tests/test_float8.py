"""Float8 training (planner/program/float8.py): the layers accelerate converts, the GEMMs at the FP8 rate and the casts
beside them, the files accelerate and the Trainer read, and where fp8 is refused."""

from __future__ import annotations

import json

import pytest

import planner.planning
from planner import load_plan, plan
from planner.errors import InputError
from planner.hardware import lookup_gpu
from planner.hardware.efficiency_data import efficiency_of
from planner.models import resolve_model
from planner.program.float8 import Float8Linears
from planner.request import PlanRequest
from planner.speed.kernels import gemm_seconds

H100 = dict(gpu="H100-80GB", detect=False)


@pytest.fixture(scope="module")
def fp8_plan():
    return plan("Qwen/Qwen2.5-0.5B", 32, gpus_per_node=2, precision="fp8", seq_len=1024, compile="on", **H100)


def test_accelerate_converts_every_linear_but_the_first_and_the_last():
    """Llama-3.1-8B has 32 blocks of 7 linear layers and an LM head, every dimension a multiple of 16: accelerate keeps
    the first (block 0's q_proj) and the last (lm_head) in bf16 (accelerate/utils/ao.py:140-143)."""
    linears = Float8Linears.of(resolve_model("meta-llama/Llama-3.1-8B").spec)
    assert (linears.converted_layers, linears.total_layers) == (32 * 7 - 1, 32 * 7 + 1)
    assert Float8Linears.of(resolve_model("gpt2").spec).converted_layers == 0  # GPT-2's blocks are Conv1D


def test_the_counted_layers_are_the_ones_accelerate_converts():
    pytest.importorskip("torchao", reason="torchao (the fp8 extra) is not installed")
    import torch
    import transformers
    from accelerate.utils.ao import convert_model_to_fp8_ao
    from torchao.float8.float8_linear import Float8Linear

    from planner.models.build import float8_linears

    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    model = transformers.AutoModelForCausalLM.from_config(config)
    counted = float8_linears(model)
    convert_model_to_fp8_ao(model)
    converted: dict[tuple[int, int], int] = {}
    for module in model.modules():
        if isinstance(module, Float8Linear):
            shape = (module.in_features, module.out_features)
            converted[shape] = converted.get(shape, 0) + 1
    assert {(i, o): c for i, o, c, _t in counted if c} == converted
    assert sum(isinstance(m, torch.nn.Linear) for m in model.modules()) == sum(t for *_x, t in counted)


def test_the_cast_rule_matches_a_trace_of_torchaos_float8_linear():
    """torchao's Float8Linear, forward and backward under FakeTensor, recorded op by op as the planner records a
    step: the memory-bound traffic and kernels it adds over nn.Linear are what `Float8Linears.cast_traffic` charges
    an eager step (the GEMMs stay three)."""
    pytest.importorskip("torchao", reason="torchao (the fp8 extra) is not installed")
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torchao.float8 import convert_to_float8_training

    from planner.program.profile import OpRecorder

    tokens, k, n = 256, 128, 512

    def traced(float8: bool):
        with FakeTensorMode():
            layer = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
            layer = convert_to_float8_training(layer) if float8 else layer
            x = torch.randn(1, tokens, k, dtype=torch.bfloat16, requires_grad=True)
            recorder = OpRecorder(1, tokens)
            with recorder:
                y = layer(x)
                recorder.phase = "backward"
                y.sum().backward()
        memory = recorder.profile.memory.values()
        return sum(v[0] + v[1] for v in memory), sum(v[2] for v in memory), len(recorder.profile.matmuls)

    (plain, plain_kernels, gemms), (cast, cast_kernels, float8_gemms) = traced(False), traced(True)
    rule, launches = Float8Linears(((k, n, 1, 1),)).cast_traffic(tokens, 2, compiled=False)
    assert cast - plain == pytest.approx(rule, rel=0.1) and cast_kernels - plain_kernels == launches
    assert gemms == float8_gemms == 3


def test_a_float8_gemm_is_faster_by_at_most_the_peaks_ratio():
    gpu = lookup_gpu("H100-80GB")
    eff = efficiency_of(gpu)
    bf16, fp8 = (gemm_seconds(1, 8192, 14336, 4096, dtype, gpu, eff, width) for dtype, width in (("bf16", 2),
                                                                                                  ("fp8", 1)))
    assert 1.0 < bf16 / fp8 <= gpu.peak_tflops_fp8 / gpu.peak_tflops_bf16


def test_fp8_keeps_bf16_activations_and_adds_its_casts(fp8_plan):
    """Float8Linear saves the high-precision input and weight (torchao/float8/float8_linear.py:45): the traced
    activations are bf16-mixed's, the float8 copies a transient beside them."""
    choice = next(c for c in fp8_plan.candidates if c.fits and c.config.engine == "fsdp")
    request = PlanRequest(model="Qwen/Qwen2.5-0.5B", global_batch=32, gpus_per_node=2, precision="fp8", seq_len=1024,
                          gpu="H100-80GB")
    job = planner.planning.resolve_job(request, planner.planning.resolve_hardware(request, detect=False))
    bf16 = job.evaluator.estimate(choice.config.model_copy(update={"precision": "bf16-mixed"}))
    fp8 = job.evaluator.estimate(choice.config)
    assert fp8.activations == bf16.activations and fp8.terms.float8_casts > 0
    assert fp8.peak_allocated - bf16.peak_allocated == fp8.terms.float8_casts
    assert not [c for c in fp8_plan.candidates if c.verdict.kind == "invalid"]


def test_an_fp8_plan_is_read_by_accelerate_and_the_trainer(fp8_plan, tmp_path, monkeypatch):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env
    from transformers import TrainingArguments

    choice = next(c for c in fp8_plan.candidates if c.fits and c.config.engine == "fsdp")
    fp8_plan.model_copy(update={"choice": choice}).emit(tmp_path)
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(
        ["--config_file", str(tmp_path / "accelerate_config.yaml"), "train.py"]))
    # the launcher refuses fp8 where no FP8 library imports (utils/launch.py:285-290), as the plan's requirements say
    monkeypatch.setattr("accelerate.utils.launch.is_fp8_available", lambda: True)
    env = prepare_multi_gpu_env(args)
    assert (env["ACCELERATE_MIXED_PRECISION"], env["ACCELERATE_FP8_BACKEND"]) == ("fp8", "AO")
    assert env["ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER"] == "True"
    assert args.fsdp_cpu_ram_efficient_loading in (False, "false", "False")  # accelerator.py:518-527 refuses it
    for key in ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_FP8_BACKEND"):
        monkeypatch.setenv(key, env[key])
    trainer_args = json.loads((tmp_path / "training_args.json").read_text())
    assert TrainingArguments(**{**trainer_args, "output_dir": str(tmp_path)}).mixed_precision == "fp8"
    loaded = load_plan(tmp_path)
    trial = loaded.training_arguments(use_cpu=True)
    assert trial.bf16 and trial.mixed_precision == "bf16"
    assert any(line.startswith("fp8 off") for line in loaded.cpu_changes)


@pytest.mark.parametrize("model, fields, flag", [
    ("Qwen/Qwen2.5-0.5B", dict(gpu="A100-80GB"), "--precision"),         # compute capability 8.0 < 8.9
    ("gpt2", dict(gpu="H100-80GB"), "--precision"),                     # no nn.Linear converts
])
def test_fp8_is_refused_where_it_cannot_run(model, fields, flag):
    with pytest.raises(InputError) as err:
        plan(model, 32, precision="fp8", detect=False, **fields)
    assert err.value.flag == flag


def test_auto_weighs_fp8_only_where_torchao_is_installed(monkeypatch):
    request = dict(gpus_per_node=1, seq_len=512, **H100)
    absent = plan("Qwen/Qwen2.5-0.5B", 16, **request)
    assert not [c for c in absent.candidates if c.config.precision == "fp8"]
    assert "fp8-available" in [n.kind for n in absent.notes]
    monkeypatch.setattr(planner.planning, "torchao_missing", lambda: None)
    present = plan("Qwen/Qwen2.5-0.5B", 16, **request)
    assert [c for c in present.candidates if c.config.precision == "fp8" and c.fits]
    assert {"fp8-chosen", "fp8-lost"} & {n.kind for n in present.notes}


def test_the_emitted_fp8_settings_build_accelerates_torchao_recipe(fp8_plan, tmp_path, monkeypatch):
    """With the launcher's environment, accelerate's own AORecipeKwargs (what its AO backend converts with) takes the
    plan's settings: tensorwise scaling, the float8 all-gather under FSDP2, padded inner dimensions."""
    pytest.importorskip("torchao", reason="torchao (the fp8 extra) is not installed")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import AORecipeKwargs
    from accelerate.utils.launch import prepare_multi_gpu_env

    choice = next(c for c in fp8_plan.candidates if c.fits and c.config.engine == "fsdp")
    fp8_plan.model_copy(update={"choice": choice}).emit(tmp_path)
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(
        ["--config_file", str(tmp_path / "accelerate_config.yaml"), "train.py"]))
    for key, value in prepare_multi_gpu_env(args).items():
        if key.startswith("ACCELERATE_FP8_"):
            monkeypatch.setenv(key, value)
    config = AORecipeKwargs().config
    assert config.enable_fsdp_float8_all_gather and config.pad_inner_dim
    assert config.cast_config_weight.scaling_granularity.value == "tensorwise"


@pytest.mark.long
def test_llama_8b_on_8_h100s_weighs_fp8_where_torchao_is_installed(monkeypatch):
    """The issue's request: with torchao installed, auto plans fp8 beside bf16-mixed, within physics, and says what
    it changes (chosen) or what it would have run (lost)."""
    monkeypatch.setattr(planner.planning, "torchao_missing", lambda: None)
    p = plan("meta-llama/Llama-3.1-8B", 256, seq_len=8192, gpus_per_node=8, **H100)
    weighed = [c for c in p.candidates if c.config.precision == "fp8"]
    assert [c for c in weighed if c.fits] and not [c for c in p.candidates if c.verdict.kind == "invalid"]
    assert {"fp8-chosen", "fp8-lost"} & {n.kind for n in p.notes}


@pytest.mark.long
def test_the_fp8_note_compares_with_the_best_bf16_plan(monkeypatch):
    """Where --precision auto chooses fp8, its note weighs it against the bf16-mixed plan the search ranks first, not
    against its own configuration in bf16-mixed (which may be slower: fp8's smaller activations can take another
    micro-batch or checkpointing)."""
    monkeypatch.setattr(planner.planning, "torchao_missing", lambda: None)
    p = plan("meta-llama/Llama-3.1-8B", 8, seq_len=8192, gpus_per_node=8, engine="fsdp", zero_stage=3, compile="on",
             liger="off", **H100)
    if p.choice.config.precision != "fp8":
        pytest.skip(f"fp8 did not win here ({p.choice.config.label()})")
    note = next(n for n in p.notes if n.kind == "fp8-chosen")
    best = next(c for c in p.candidates if c.fits and c.config.precision == "bf16-mixed" and c.throughput)
    assert note["bf16_step_s"] == pytest.approx(best.throughput.step_time_s)
    assert note["bf16_label"] == best.config.label()
    same = p.choice.config.model_copy(update={"precision": "bf16-mixed"})
    assert note["bf16_step_s"] <= min((c.throughput.step_time_s for c in p.candidates
                                       if c.config == same and c.throughput), default=float("inf")) * 1.03
