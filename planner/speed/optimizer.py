"""The optimizer step's time: the bytes and kernels of the implementation that runs it (fused, foreach or a Python
loop), against the host's time issuing them; CPU Adam under offload."""

from __future__ import annotations

import math

from planner.config import Config
from planner.hardware import GPU
from planner.hardware.efficiency_data import Efficiency
from planner.models.spec import ModelSpec
from planner.speed.kernels import MicroStep, bandwidth, host_link
from planner.vocab import ADAM_STEP, DEEPSPEED, FUSED_STEP, OFFLOAD, OPTIMIZER, OPTIMIZER_STEP, PRECISION, AdamStep

#: Bytes an optimizer whose step is not counted (bitsandbytes' 8-bit AdamW, Lion, LAMB) streams per trainable
#: parameter per state byte width, beyond the weight and gradient it reads: it reads and writes each state once.
#: The others count their accesses per program (`vocab.ADAM_STEP`, `vocab.OPTIMIZER_STEP`).
STATE_PASSES = 2


#: the torch.optim classes (`vocab.OPTIMIZER` torch_class) whose step `vocab.ADAM_STEP` describes
ADAM_CLASSES = ("Adam", "AdamW")


#: DeepSpeed's CPU Adam, parameters per second per node (ZeRO-Offload, arXiv 2101.06840, Fig. 7: ~1.5B params/s on a
#: dual-socket host with AVX512; DeepSpeed PR #735: an 11.6B-parameter step in 8.2 s, 1.4B/s), shared by the node's
#: ranks. Newer hosts with more cores step faster; a probe measures the user's.
CPU_ADAM_PARAMS_PER_S = 1.5e9


#: Elements one multi-tensor kernel launch covers at most: 320 blocks of 65536-element chunks
#: (aten/src/ATen/native/cuda/MultiTensorApply.cuh `kChunkSize`, `depth_to_max_blocks`; CUDA 13 builds allow 7x more).
FOREACH_LAUNCH_ELEMENTS = 65536 * 320


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
        return MicroStep(gpu_s=trainable / (CPU_ADAM_PARAMS_PER_S / ranks)
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
        launches = looped + program.foreach_ops * math.ceil(trainable / FOREACH_LAUNCH_ELEMENTS)
        cpu_us = ((looped + program.foreach_ops) * eff.dispatch_us
                  + program.host_ops_per_tensor * (matrices + vectors) * eff.python_op_us)
    else:
        per_param = 2 * cfg.weight_bytes() + cfg.grad_bytes() + STATE_PASSES * states * state
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
