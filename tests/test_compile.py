"""torch.compile as a planned knob: Inductor's fusion and partition read from the model's graph (checked against eager
PyTorch's kernels and Inductor's own metrics), compile time spread over the run, `--compile auto|on|off`, and the
emitted settings the libraries load."""

from __future__ import annotations

import json

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

from emit import emit
from planner import plan
from planner.errors import InputError
from planner.program.compiled import CompileEffect, graph_cost

F32 = 4


def _graph(fn, *shapes):
    return make_fx(fn, tracing_mode="fake")(*(torch.randn(*s) for s in shapes)).graph


class _EagerKernels(TorchDispatchMode):
    """What eager PyTorch runs: each op a kernel reading its tensor inputs and writing its output, the library calls
    (matmuls: MKL on the CPU, cuBLAS on a GPU) counted apart."""

    LIBRARY = {"mm", "addmm", "bmm"}

    def __init__(self):
        super().__init__()
        self.kernels = self.library = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.LIBRARY:
            self.library += 1
        else:
            self.kernels += 1
            tensors = [a for a in args if isinstance(a, torch.Tensor)] + [out]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


def _eager(fn, *shapes):
    args = [torch.randn(*s) for s in shapes]
    with _EagerKernels() as counted:
        fn(*args)
    return counted


def _inductor(fn, *shapes):
    """(kernels Inductor generates, bytes its generated kernels read and write, extern library calls) for `fn`,
    compiled on the CPU with Inductor's own metrics (`generated_kernel_count`; `count_bytes` per scheduler node,
    which Inductor computes when its `inductor_metrics` log is on), without its FX graph cache."""
    import torch._dynamo
    import torch._inductor.config
    import torch._inductor.metrics as metrics

    torch._dynamo.reset()
    metrics.reset()
    torch._logging.set_logs(inductor_metrics=True)
    try:
        with torch._inductor.config.patch(fx_graph_cache=False):
            torch.compile(fn, backend="inductor")(*(torch.randn(*s) for s in shapes))
    finally:
        torch._logging.set_logs()
        torch._dynamo.reset()
    nodes = [(type(node).__name__, elements) for node, elements in metrics.nodes_num_elem]
    generated = sum(elements for kind, elements in nodes if kind != "ExternKernelSchedulerNode") * F32
    extern = sum(1 for kind, _ in nodes if kind == "ExternKernelSchedulerNode")
    return metrics.generated_kernel_count, generated, extern


def test_fusion_groups_connected_ops_between_library_calls_and_counts_what_crosses_them():
    """Against what runs: eager PyTorch's kernels and bytes counted op by op, and Inductor's own kernel count and
    bytes for the same function compiled on the CPU (Inductor groups {mul, relu} and {add, sum} around the matmul)."""
    def step(x, w):
        c = torch.relu(x * 2) @ w
        return (c + 1).sum()

    cost = graph_cost(_graph(step, (4, 8), (8, 8)))
    eager = _eager(step, (4, 8), (8, 8))
    assert (cost.eager_kernels, cost.extern_kernels, cost.eager_bytes) == (eager.kernels, eager.library, eager.bytes)
    kernels, generated_bytes, extern = _inductor(step, (4, 8), (8, 8))
    assert (cost.fused_kernels, cost.extern_kernels, cost.fused_bytes) == (kernels, extern, generated_bytes)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="graph_cost counts 2 kernels for (a @ w) + a where "
                   "Inductor makes 1: it folds the add into the matmul's library call (addmm), on the CPU and an H200")
def test_a_value_used_after_a_library_call_starts_another_kernel():
    def step(x, w):
        a = x * 2
        return (a @ w) + a

    cost = graph_cost(_graph(step, (4, 8), (8, 8)))
    kernels, generated_bytes, extern = _inductor(step, (4, 8), (8, 8))
    assert (cost.fused_kernels, cost.extern_kernels) == (kernels, extern)


def _persistent_reduction_limit() -> int:
    """The longest inner reduction Inductor keeps on chip, read from the installed torch
    (torch/_inductor/choices.py `should_use_persistent_reduction`: {ReductionHint.INNER: 1024}, else 64)."""
    import inspect
    import re

    from torch._inductor.choices import InductorChoices

    source = inspect.getsource(InductorChoices.should_use_persistent_reduction)
    return int(re.search(r"ReductionHint\.INNER:\s*(\d+)", source).group(1))


def test_the_persistent_reduction_limit_is_inductors():
    from planner import facts

    assert facts.fact("inductor.persistent_reduction_max").value == _persistent_reduction_limit()


@pytest.mark.gpu
@pytest.mark.parametrize("times", [0.5, 2])
def test_a_norm_over_a_long_row_reads_it_twice(times):
    """Inductor's Triton kernel for a norm, on a GPU: a row up to the persistent-reduction limit is loaded once
    (`persistent_reduction`), a longer one in a looped reduction that loads it again to scale it; the graph cost's
    bytes are the rows its kernel loads plus the one it writes."""
    from torch._inductor.utils import run_and_get_code

    def norm(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))

    width = int(_persistent_reduction_limit() * times)
    torch._dynamo.reset()
    _, (code, *_) = run_and_get_code(torch.compile(norm), torch.randn(2, width, device="cuda"))
    loads = code.count("tl.load(in_ptr0")
    assert ("@triton_heuristics.persistent_reduction" in code) == (times < 1)
    cost = graph_cost(_graph(norm, (2, width)))
    row = 2 * width * F32
    assert cost.fused_kernels == 1 and cost.fused_bytes == loads * row + row


def _tiny_llama():
    from transformers import LlamaConfig

    from planner.models import resolve_model

    return resolve_model(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                     max_position_embeddings=128, architectures=["LlamaForCausalLM"]))


def test_the_effect_is_read_from_the_models_joint_graph_and_cached(tmp_path, monkeypatch):
    from planner.config import Config
    from planner.memory.estimate import Evaluation

    monkeypatch.setenv("TRAINPLAN_CACHE", str(tmp_path))
    evaluation = Evaluation(_tiny_llama(), seq_len=64, optimizer="adamw")
    cfg = Config.of(micro_batch=4, grad_accum=1, world_size=1, precision="bf16-mixed", checkpointing="none",
                    zero_stage=0, offload="none", compiled=True)
    effect = evaluation.workload.compile_effect(cfg)
    assert 0 < effect.saved_compiled < effect.saved_eager  # Inductor's partitioner recomputes instead of saving
    for phase in (effect.forward, effect.backward):
        assert phase.fused_kernels < phase.eager_kernels and phase.fused_bytes < phase.eager_bytes
    assert effect.ops_per_block > 0 and effect.compile_seconds(4) > effect.compile_seconds(2)
    assert CompileEffect.from_json(json.loads(json.dumps(effect.to_json()))) == effect
    assert effect.saved_less(4, 2) == 2 * effect.saved_less(4, 1) > effect.saved_less(2, 2) > 0
    # planned as eager: on the CPU the compiled peak fell by less than the partition's saving (compile_cpu.py)
    eager = cfg.model_copy(update={"compiled": False})
    assert evaluation.activations(cfg, "auto")[0] == evaluation.activations(eager, "auto")[0]
    assert cfg.compile_saves_activations() and not cfg.model_copy(
        update={"checkpointing": "full"}).compile_saves_activations()  # a checkpointed block saves its input


def test_a_compiled_step_fuses_kernels_and_spreads_its_compile_time_over_the_run():
    from planner.hardware import lookup_gpu
    from planner.hardware.efficiency_data import efficiency
    from planner.program.workload import Workload
    from planner.speed.kernels import micro_step
    from planner.speed.model import SpeedModel, speed_profile
    from planner.speed.step import compiled_profile

    resolved = _tiny_llama()
    gpu = lookup_gpu("H100-80GB")
    workload = Workload(resolved, seq_len=64, optimizer="adamw", gpu=gpu)
    cfg = plan(resolved, 8, gpu="H100-80GB", seq_len=64, compile="off").choice.config
    compiled = cfg.model_copy(update={"compiled": True})
    effect = workload.compile_effect(compiled)
    profile, _ = speed_profile(workload, cfg)
    fused = compiled_profile(profile, effect)
    assert set(fused.dispatch) == {"graph_kernels"}  # Inductor's wrapper launches every kernel
    assert sum(v[2] for v in fused.memory.values()) < sum(v[2] for v in profile.memory.values())
    eff = efficiency(gpu.name)
    assert micro_step(fused, 1, cfg.precision, gpu, eff).cpu_s < micro_step(profile, 1, cfg.precision, gpu, eff).cpu_s
    per_step = SpeedModel(workload, gpu, 1)(compiled)
    short_run = SpeedModel(workload, gpu, 1, train_steps=10)(compiled)
    assert per_step.parts.compile == 0 and per_step.parts.compile_once == pytest.approx(
        effect.compile_seconds(resolved.spec.layers))
    assert short_run.parts.compile == pytest.approx(effect.compile_seconds(resolved.spec.layers) / 10)
    assert short_run.step_time_s == pytest.approx(per_step.step_time_s + short_run.parts.compile)


@pytest.mark.long
def test_auto_weighs_compiling_only_with_the_runs_length():
    unknown = plan("gpt2", 8, gpu="A100-80GB", seq_len=256)
    assert not any(c.config.compiled for c in unknown.candidates)
    assert "compile-not-weighed" in {n.kind for n in unknown.notes}
    long = plan("gpt2", 2, gpu="H100-80GB", seq_len=128, train_steps=100_000)
    assert {c.config.compiled for c in long.candidates} == {False, True}
    assert long.choice.config.compiled  # a small step is host-bound eager: one launch per fused kernel pays
    compiled = next(n for n in long.notes if n.kind == "compiled")
    assert compiled["compiled_s"] < compiled["eager_s"] and compiled["repaid_steps"] < 100_000
    short = plan("gpt2", 2, gpu="H100-80GB", seq_len=128, train_steps=2)
    assert not short.choice.config.compiled  # two steps cannot repay the compile
    eager = next(n for n in short.notes if n.kind == "compile")
    assert eager["run_steps"] == 2 and eager["repaid_steps"] > 2  # two steps cannot repay the compile time
    # a device-bound step gains less than the residual the published compiled steps show (planner/program/compiled.py)
    bound = plan("gpt2", 8, gpu="A100-80GB", seq_len=256, train_steps=100_000)
    assert not bound.choice.config.compiled
    off = plan("gpt2", 8, gpu="A100-80GB", seq_len=256, train_steps=100_000, compile="off")
    assert not any(c.config.compiled for c in off.candidates)
    assert not {"compile", "compiled", "compile-not-weighed"} & {n.kind for n in off.notes}


def test_compile_on_is_emitted_for_the_trainer_and_accelerate(tmp_path):
    import transformers
    from accelerate.commands.config.config_args import load_config_from_file

    from planner import load_plan

    p = plan("gpt2", 8, gpu="A100-80GB", seq_len=256, compile="on")
    assert p.choice.config.compiled and "compiled" in p.choice.config.label()
    assert p.to_json()["choice"]["compiled"] is True
    emit(p, tmp_path / "run")
    args = json.loads((tmp_path / "run" / "training_args.json").read_text())
    assert args["torch_compile"] is True and args["torch_compile_backend"] == "inductor"
    targs = transformers.TrainingArguments(**{**args, "output_dir": str(tmp_path / "out"), "use_cpu": True})
    assert targs.torch_compile and targs.torch_compile_backend == "inductor"
    acc = load_config_from_file(str(tmp_path / "run" / "accelerate_config.yaml"))
    assert acc.dynamo_config == {"dynamo_backend": "INDUCTOR"}
    assert load_plan(tmp_path / "run").choice.config.compiled


def test_a_compiled_candidates_probe_gets_its_compile_time_on_top_of_a_probes_limit():
    from types import SimpleNamespace

    from probes.runner import _compile_allowance

    p = plan("gpt2", 2, gpu="H100-80GB", seq_len=128, compile="on")
    cfg = p.choice.config
    allowance = _compile_allowance(SimpleNamespace(plan=p), cfg)
    assert allowance == p.choice.throughput.parts.compile_once > 1  # seconds of Inductor before the first step
    assert _compile_allowance(SimpleNamespace(plan=p), cfg.model_copy(update={"compiled": False})) == 0
    assert _compile_allowance(SimpleNamespace(plan=None), cfg) == 0


def test_a_bad_compile_value_names_the_flag():
    with pytest.raises(InputError) as info:
        plan("gpt2", 8, gpu="A100-80GB", compile="sometimes")
    assert info.value.flag == "--compile"
    from typer.testing import CliRunner

    from planner.cli import app

    result = CliRunner().invoke(app, ["--model", "gpt2", "--batch", "8", "--gpu", "A100-80GB", "--compile", "maybe"])
    assert result.exit_code == 2 and "--compile" in result.output and "Traceback" not in result.output
