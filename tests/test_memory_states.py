"""Model states: equal to DeepSpeed's own estimators, the ZeRO paper, real optimizer steps (torch's, transformers'
Adafactor), a real DeepSpeed ZeRO-3 partition, and monotone in the ZeRO stage."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.memory.states import adafactor_state_elements, model_states, validate_choice
from planner.vocab import OPTIMIZER

BLOOM_560M = 559_214_592
BLOOM_LARGEST_LAYER = 256_901_120  # the 250880 x 1024 embedding


@pytest.mark.parametrize("precision", ["fp16-mixed", "bf16-mixed"])
@pytest.mark.parametrize("gpus_per_node,nodes", [(1, 1), (8, 1), (8, 4)])
@pytest.mark.parametrize("offload", [False, True])
def test_equal_to_deepspeed_estimators(gpus_per_node, nodes, offload, precision):
    """BLOOM-560m's model states per GPU and host bytes against DeepSpeed's own estimators (which assume 16-bit mixed
    precision, fp16 or bf16 alike): on one GPU, ZeRO-2 10.42 GiB (1.04 with optimizer offload) and ZeRO-3 10.33 GiB
    (0.96 with optimizer and parameter offload)."""
    ds2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    ds3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    world = gpus_per_node * nodes
    kwargs = dict(precision=precision, optimizer="adamw", world_size=world, gpus_per_node=gpus_per_node)
    cpu3, gpu3, _ = ds3.estimate_zero3_model_states_mem_needs(BLOOM_560M, BLOOM_LARGEST_LAYER, gpus_per_node, nodes,
                                                             cpu_offload=offload, cpu_offload_params=offload,
                                                             zero_init=True)
    ours3 = model_states(BLOOM_560M, BLOOM_560M, zero_stage=3, largest_layer=BLOOM_LARGEST_LAYER,
                         offload="optimizer+params" if offload else "none", **kwargs)
    assert ours3.total == gpu3
    assert ours3.cpu_bytes == pytest.approx(cpu3 if offload else 0)
    cpu2, gpu2 = ds2.estimate_zero2_model_states_mem_needs(BLOOM_560M, gpus_per_node, nodes, cpu_offload=offload)
    ours2 = model_states(BLOOM_560M, BLOOM_560M, zero_stage=2, offload="optimizer" if offload else "none", **kwargs)
    assert ours2.total == gpu2
    if offload:
        assert ours2.cpu_bytes == pytest.approx(cpu2)


def test_zero_paper_worked_example():
    """ZeRO paper Fig. 1: 7.5B params, 64 GPUs, K=12 -> 120 / 31.4 / 16.6 / 1.9 GB. DeepSpeed adds a 4-byte fp32
    gradient partition (K=16) and counts 18 B/param for stage 3, so stages 1-3 sit slightly above the paper."""
    psi, n = 7_500_000_000, 64
    states = [model_states(psi, psi, precision="fp16-mixed", optimizer="adamw", zero_stage=z, world_size=n).total / 1e9
              for z in range(4)]
    baseline_torch_amp = model_states(psi, psi, precision="fp16-mixed", optimizer="adamw").total / 1e9
    assert baseline_torch_amp == pytest.approx(120.0)
    assert states[1] == pytest.approx(31.4 + 4 * psi / n / 1e9, rel=0.01)
    assert states[2] == pytest.approx(16.6 + 4 * psi / n / 1e9, rel=0.01)
    assert states[3] == pytest.approx(1.9 + 2 * psi / n / 1e9, rel=0.05)


def _real_step_bytes(make, shapes, dtype=torch.float32) -> tuple[int, int, int]:
    """(weights, gradients, optimizer states) in bytes after one real CPU step of the optimizer `make` builds over
    tensors of `shapes` in `dtype`. A state's 0-d tensors (torch's `step` counter, transformers' `RMS`) are one per
    tensor, not per parameter: what the bytes-per-parameter tables leave out, so left out here."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = make(params)
    opt.step()
    states = sum(v.nbytes for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.dim())
    return sum(p.nbytes for p in params), sum(p.grad.nbytes for p in params), states


def _adafactor(params):
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=1e-3, scale_parameter=False, relative_step=False)  # the Trainer's arguments


#: The optimizers torch and transformers implement, as the planner's names say they are built (vocab.OPTIMIZER)
REAL_OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
}
MILLION = [(1000, 1000)]


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16-true", torch.bfloat16)])
@pytest.mark.parametrize("optimizer", list(REAL_OPTIMIZERS))
def test_states_are_what_a_real_optimizer_step_keeps(optimizer, precision, dtype):
    """Weights, gradients and optimizer states of one real CPU step of torch's optimizer on a 1M-parameter tensor, in
    the precision's storage dtype (bf16-true: torch keeps Adam's states in the parameters' dtype)."""
    weights, grads, states = _real_step_bytes(REAL_OPTIMIZERS[optimizer], MILLION, dtype)
    ours = model_states(10**6, 10**6, precision=precision, optimizer=optimizer)
    assert (ours.parameters, ours.gradients, ours.optimizer_states) == (weights, grads, states)


def test_lion_and_8_bit_adam_keep_what_their_papers_say():
    """No torch implementation of either here: Lion 'only keeps track of the momentum' (Chen et al. 2023, arXiv
    2302.06675, abstract), one buffer like SGD's momentum; 8-bit Adam keeps Adam's two statistics in 8 bits instead of
    32 (Dettmers et al. 2021, arXiv 2110.02861: 'optimizers that use 8-bit statistics'), a quarter of AdamW's fp32
    states. Both measured against real torch steps on the same tensor."""
    _, _, momentum = _real_step_bytes(REAL_OPTIMIZERS["sgd-momentum"], MILLION)
    _, _, adam = _real_step_bytes(REAL_OPTIMIZERS["adamw"], MILLION)
    assert model_states(10**6, 10**6, precision="fp32", optimizer="lion").optimizer_states == momentum
    assert model_states(10**6, 10**6, precision="fp32", optimizer="adamw-8bit").optimizer_states == adam * 8 // 32


@pytest.mark.gpu
def test_8_bit_adam_keeps_two_uint8_states_per_parameter():
    """bitsandbytes' AdamW8bit on a CUDA tensor: its two uint8 statistics, per parameter (its per-block absmax
    constants are fp32 tensors apart)."""
    bnb = pytest.importorskip("bitsandbytes")
    p = torch.nn.Parameter(torch.randn(1000, 1000, device="cuda"))
    p.grad = torch.randn_like(p)
    opt = bnb.optim.AdamW8bit([p], lr=1e-3)
    opt.step()
    uint8 = sum(v.nbytes for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.dtype == torch.uint8)
    assert model_states(10**6, 10**6, precision="fp32", optimizer="adamw-8bit").optimizer_states == uint8


@settings(max_examples=100, deadline=None)
@given(trainable=st.integers(1, 10**10), frozen=st.integers(0, 10**11),
       precision=st.sampled_from(["fp32", "fp16-mixed", "bf16-mixed", "bf16-true"]),
       optimizer=st.sampled_from(["adamw", "sgd", "sgd-momentum", "lion", "adamw-8bit"]))
def test_frozen_parameters_have_no_gradients_or_states(trainable, frozen, precision, optimizer):
    """Frozen parameters add their weights and nothing else: gradients and optimizer states are those of the trainable
    ones alone, and the weights grow linearly in the frozen count. (Measured: the LoRA CPU steps of
    tests/test_adapters.py `test_real_lora_steps_on_the_cpu_match_the_estimate`.)"""
    def states(f):
        return model_states(trainable + f, trainable, precision=precision, optimizer=optimizer)

    alone, with_frozen, twice = states(0), states(frozen), states(2 * frozen)
    assert (with_frozen.gradients, with_frozen.optimizer_states) == (alone.gradients, alone.optimizer_states)
    assert twice.parameters - with_frozen.parameters == with_frozen.parameters - alone.parameters


ADAFACTOR_SHAPES = [(1024, 4096), (4096,), (8, 16, 32)]


def test_adafactor_factors_matrices():
    """transformers' Adafactor (the Trainer's `optim="adafactor"`) after one real CPU step: its factored row and column
    statistics per matrix (batched over leading dimensions) and a full second moment per vector, no first moment."""
    from transformers.optimization import Adafactor

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in ADAFACTOR_SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = Adafactor(params, lr=1e-3, scale_parameter=False, relative_step=False)
    opt.step()
    elements = sum(opt.state[p][k].numel() for p in params for k in ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq")
                   if k in opt.state[p])
    assert adafactor_state_elements(ADAFACTOR_SHAPES) == elements
    n = sum(p.numel() for p in params)
    _, _, states = _real_step_bytes(_adafactor, ADAFACTOR_SHAPES)
    ours = model_states(n, n, precision="fp32", optimizer="adafactor",
                        adafactor_elements=adafactor_state_elements(ADAFACTOR_SHAPES))
    assert ours.optimizer_states == states


@pytest.mark.parametrize("kwargs,match", [
    (dict(precision="int4"), "precision"), (dict(optimizer="rmsprop"), "optimizer"), (dict(zero_stage=4), "zero"),
    (dict(offload="optimizer"), "ZeRO"), (dict(zero_stage=2, offload="optimizer+params"), "stage 3"),
    (dict(zero_stage=1, precision="bf16-true"), "bf16-true"),
])
def test_invalid_combinations(kwargs, match):
    args = dict(precision="bf16-mixed", optimizer="adamw", zero_stage=0, offload="none")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        validate_choice(**args)


@settings(max_examples=200, deadline=None)
@given(params=st.integers(1_000, 10**12), frac=st.floats(0.01, 1.0), world=st.integers(1, 4096),
       precision=st.sampled_from(["fp32", "fp16-mixed", "bf16-mixed"]), optimizer=st.sampled_from(list(OPTIMIZER)),
       largest=st.floats(0.0, 0.2))
def test_higher_zero_stages_never_raise_model_states(params, frac, world, precision, optimizer, largest):
    trainable = max(1, int(params * frac))
    kw = dict(precision=precision, optimizer=optimizer, world_size=world, largest_layer=int(params * largest / 8),
              adafactor_elements=trainable // 100)
    totals = [model_states(params, trainable, zero_stage=z, **kw).total for z in (1, 2, 3)]
    assert totals[0] >= totals[1]
    # ZeRO-3 gathers the largest layer whole; with it no larger than a stage-2 rank's params it never costs more
    if 4 * kw["largest_layer"] <= 2 * params - 2 * params // world:
        assert totals[1] >= totals[2]
    offloaded = model_states(params, trainable, zero_stage=3, offload="optimizer+params", **kw).total
    assert offloaded <= totals[2]


def test_offload_host_memory_counts_what_trains():
    """DeepSpeed offloads the optimizer's parameters, which with adapters are the trainable ones: LoRA on 7.66B
    parameters (40M trainable) once needed 171 GiB of host RAM by the full-model estimator's count."""
    total, trainable = 7_660_000_000, 40_000_000
    for stage, offload in ((2, "optimizer"), (3, "optimizer")):
        lora = model_states(total, trainable, precision="bf16-mixed", optimizer="adamw", zero_stage=stage,
                            offload=offload)
        full = model_states(trainable, trainable, precision="bf16-mixed", optimizer="adamw", zero_stage=stage,
                            offload=offload)
        assert lora.cpu_bytes == full.cpu_bytes  # the frozen 7.62B stay on the GPU in 16 bits


_DS_FROZEN_PARTITIONS = r'''
import json, os
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29533"), RANK="0", LOCAL_RANK="0",
                  WORLD_SIZE="1")
import torch, transformers, peft, deepspeed
config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
          "zero_force_ds_cpu_optimizer": False}
deepspeed.init_distributed(dist_backend="gloo")
with deepspeed.zero.Init(config_dict_or_path=config):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=300))
model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
frozen = [p for p in engine.module.parameters() if not p.requires_grad]
print(json.dumps({"frozen": sum(p.ds_numel for p in frozen),
                  "host_bytes": sum(p.ds_tensor.nbytes for p in frozen if p.ds_tensor.device.type == "cpu")}))
'''


def test_offloaded_frozen_parameters_cost_the_host_their_16_bit_partition():
    """ZeRO-3 with parameter offload: the trainable part of the host memory is DeepSpeed's own estimator's, and each
    frozen parameter adds what a real DeepSpeed ZeRO-3 run keeps of it in host memory (its partition, `ds_tensor`,
    in a subprocess on the CPU with a peft LoRA model) times the estimator's pinned-buffer factor (its
    `additional_buffer_factor` default)."""
    import inspect
    import json
    import os
    import subprocess
    import sys

    ds3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    pytest.importorskip("peft")
    total, trainable = 7_660_000_000, 40_000_000
    kwargs = dict(precision="bf16-mixed", optimizer="adamw", zero_stage=3, offload="optimizer+params")
    alone = model_states(trainable, trainable, **kwargs)
    cpu, _, _ = ds3.estimate_zero3_model_states_mem_needs(trainable, 0, 1, 1, cpu_offload=True, cpu_offload_params=True,
                                                          zero_init=True)
    assert alone.cpu_bytes == pytest.approx(cpu)
    done = subprocess.run([sys.executable, "-c", _DS_FROZEN_PARTITIONS], capture_output=True, text=True,  # noqa: S603
                          timeout=300, env={**os.environ, "PORT": str(29500 + os.getpid() % 400)})
    assert done.returncode == 0, done.stderr[-3000:]
    real = json.loads(done.stdout.strip().splitlines()[-1])
    factor = inspect.signature(ds3.estimate_zero3_model_states_mem_needs).parameters["additional_buffer_factor"].default
    both = model_states(total, trainable, **kwargs)
    assert both.cpu_bytes - alone.cpu_bytes == pytest.approx(
        (total - trainable) * real["host_bytes"] / real["frozen"] * factor)
