"""The optimizer step's time: the bytes and kernels of the implementation that runs it (fused, foreach or a Python
loop), against the host's time issuing them; CPU Adam under offload."""

from __future__ import annotations

import math

from planner import facts
from planner.config import Config
from planner.hardware import GPU
from planner.hardware.efficiency_data import Efficiency
from planner.models.spec import ModelSpec
from planner.speed.kernels import MicroStep, bandwidth, host_link
from planner.vocab import ADAM_STEP, DEEPSPEED, FUSED_STEP, OFFLOAD, OPTIMIZER, OPTIMIZER_STEP, PRECISION, AdamStep

#: the torch.optim classes (`vocab.OPTIMIZER` torch_class) whose step `vocab.ADAM_STEP` describes
ADAM_CLASSES = ("Adam", "AdamW")


def trainable_tensors(spec: ModelSpec) -> tuple[int, int]:
    """The matrices (2-D or more) and vectors among the parameter tensors the optimizer steps; where the shapes are
    unknown, one matrix."""
    ndims = spec.tensor_ndims or (2,) * len(spec.tensor_sizes)
    trained = [dims for size, dims in zip(spec.tensor_sizes, ndims) if size > 0]
    if not trained:
        return 1, 0
    vectors = sum(1 for dims in trained if dims <= 1)
    return len(trained) - vectors, vectors


def optimizer_step(spec: ModelSpec, cfg: Config, optimizer: str, gpu: GPU, eff: Efficiency, per_node: int,
                   adam_step: AdamStep = FUSED_STEP) -> MicroStep:
    """The optimizer step, gradient clipping and fp16's gradient unscaling included: the bytes they stream through
    HBM and the kernels they launch (or CPU Adam under offload, with the gradients down and the weights up over
    PCIe), beside what the host spends issuing them. The step runs the program `vocab.ADAM_STEP` (for Adam:
    `adam_step` under the torch engine, the emitted files' fused kernel by default; torch's default for CUDA
    tensors is foreach; DeepSpeed always runs its FusedAdam) or `vocab.OPTIMIZER_STEP` describes; an optimizer
    neither counts streams each state once each way, with no host cost."""
    trainable = spec.trainable_parameters / (cfg.world_size if cfg.sharded else 1)
    info = OPTIMIZER[optimizer]
    if OFFLOAD[cfg.offload].optimizer_on_cpu:
        ranks = min(cfg.world_size, per_node)
        return MicroStep(gpu_s=trainable / (facts.get("optimizer.cpu_adam_params_per_s") / ranks)
                         + trainable * 2 * cfg.weight_bytes() / host_link(gpu, eff), cpu_s=0.0)
    state = cfg.state_width() if info.follows_weights else 1
    states = info.state_bytes // 4 if info.follows_weights else info.state_bytes
    program = ADAM_STEP[FUSED_STEP if cfg.engine == DEEPSPEED else adam_step] \
        if info.torch_class in ADAM_CLASSES else OPTIMIZER_STEP.get(optimizer)
    launches = cpu_us = 0.0
    if program is not None:
        per_param = program.weight * cfg.weight_bytes() + program.grad * cfg.grad_bytes() + program.state * state
        matrices, vectors = trainable_tensors(spec)
        looped = program.matrix_kernels * matrices + program.vector_kernels * vectors
        per_launch = facts.get("optimizer.foreach_launch_elements")  # a multi-tensor kernel's most elements
        launches = looped + program.foreach_ops * math.ceil(trainable / per_launch)
        cpu_us = ((looped + program.foreach_ops) * eff.dispatch_us
                  + program.host_ops_per_tensor * (matrices + vectors) * eff.python_op_us)
    else:
        per_param = 2 * cfg.weight_bytes() + cfg.grad_bytes() + facts.get("optimizer.state_passes") * states * state
    per_param += info.norm_passes * cfg.weight_bytes()  # LAMB: the weights' and the update's norms per layer
    per_param += 2 * cfg.grad_bytes()  # clip_grad_norm_: the norm reads the gradients, the scale rewrites them
    if PRECISION[cfg.precision].loss_scaling:  # unscaling reads and rewrites every gradient, checking for inf/NaN
        per_param += 2 * cfg.grad_bytes()  # (torch/amp/grad_scaler.py `_amp_foreach_non_finite_check_and_unscale_`)
    if cfg.engine == DEEPSPEED:  # the fp32 master steps, then is copied into the 16-bit weights
        per_param += 2 * cfg.master_bytes() + cfg.weight_bytes()
    return MicroStep(gpu_s=trainable * per_param / bandwidth(gpu, eff) + launches * eff.launch_us * 1e-6,
                     cpu_s=cpu_us * 1e-6)


def optimizer_seconds(spec: ModelSpec, cfg: Config, optimizer: str, gpu: GPU, eff: Efficiency, per_node: int,
                      adam_step: AdamStep = FUSED_STEP) -> float:
    """The optimizer step's time (`optimizer_step`): the host issues it while the GPU runs it, the longer wins."""
    return optimizer_step(spec, cfg, optimizer, gpu, eff, per_node, adam_step).seconds
