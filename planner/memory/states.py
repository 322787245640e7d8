"""Model states per GPU: parameters, gradients, optimizer states. Pure functions, bytes.

Every bytes-per-parameter constant is named here once with where it comes from
(`reference.md`; ZeRO paper arXiv 1910.02054; DeepSpeed 0.19.8 `estimate_zero{2,3}_model_states_mem_needs`).

Two engines hold model states differently:
* torch (ZeRO stage 0: one GPU or DDP). Parameters stay in their storage dtype (fp32, or bf16 for
  bf16-true); torch.autocast casts copies inside the forward, which we count as activations because
  that is where they live and die. Gradients have the parameters' dtype.
* DeepSpeed (ZeRO 1-3). Mixed precision keeps 16-bit parameters and gradients plus an fp32 master copy
  and an fp32 gradient partition in the optimizer: "18 = 2 grads16 + 4 grads32 + 4 params32 + 8 optim32"
  (+2 params16) = 20 B/param before sharding, which is exactly DeepSpeed's estimator
  (ZeRO-2: 2Ψ + 18Ψ/N, the 16-bit gradients sharded too; ZeRO-3: 4·largest_layer + 18Ψ/N). ZeRO-1
  keeps the full 16-bit gradients (2Ψ + 2Ψ + 16Ψ/N); it has no DeepSpeed estimator. Reduce buckets are
  counted as overhead (estimate.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PRECISIONS = ("fp32", "fp16-mixed", "bf16-mixed", "bf16-true")
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adafactor", "adamw-8bit", "lion")
OFFLOADS = ("none", "optimizer", "optimizer+params")

FP32_BYTES = 4
HALF_BYTES = 2  # fp16 / bf16

#: Optimizer state bytes per trainable parameter when states are fp32.
#: adam/adamw: exp_avg + exp_avg_sq, 4 + 4. sgd-momentum: momentum_buffer, 4. lion: exp_avg, 4 (Chen et al. 2023).
#: adamw-8bit: two uint8 states (bitsandbytes, blockwise quantisation; the per-block fp32 absmax adds
#: 2 x 4 B per 2048-element block = 0.004 B/param, below counting). sgd: none.
#: adafactor is shape-dependent (factored second moment), see `adafactor_state_elements`.
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd": 0, "sgd-momentum": 4, "lion": 4, "adamw-8bit": 2}

#: DeepSpeed mixed precision: fp32 master weights (4) and the fp32 gradient partition (4) the optimizer
#: steps on, held by the ZeRO optimizer next to the Adam states (DeepSpeed stage_1_and_2.py).
DS_MASTER_BYTES = 4
DS_GRAD32_BYTES = 4
#: DeepSpeed ZeRO-3 counts 18 B/param with Adam: 2 params16 + 4 gradient bytes (16-bit partition and its
#: fp32 upcast) + 12 optimizer (master + m + v). Its largest layer is gathered whole, counted at 4 B/param.
DS_Z3_GRAD_BYTES = 4
DS_Z3_GATHERED_LAYER_BYTES = 4
#: DeepSpeed's estimators multiply CPU memory by this for pinned buffers (additional_buffer_factor).
DS_CPU_BUFFER_FACTOR = 1.5


@dataclass(frozen=True)
class ModelStates:
    """Bytes per GPU, plus what offload keeps in host memory (per node)."""

    parameters: int
    gradients: int
    optimizer_states: int
    cpu_bytes: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states


def validate_choice(precision: str, optimizer: str, zero_stage: int, offload: str) -> None:
    """Raise ValueError naming the bad combination (callers turn it into an InputError)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError("zero_stage must be 0, 1, 2 or 3")
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {', '.join(OFFLOADS)}")
    if offload != "none" and zero_stage == 0:
        raise ValueError("offload needs DeepSpeed ZeRO (zero_stage >= 1)")
    if offload == "optimizer+params" and zero_stage != 3:
        raise ValueError("offloading parameters needs ZeRO stage 3")
    if precision == "bf16-true" and zero_stage > 0:
        raise ValueError("bf16-true is a torch-native mode; DeepSpeed keeps fp32 master weights (use bf16-mixed)")


def optimizer_state_bytes(optimizer: str, trainable: int, adafactor_elements: int, state_bytes: int = FP32_BYTES) -> int:
    """Optimizer state bytes for `trainable` parameters whose states are `state_bytes` wide."""
    if optimizer == "adafactor":
        return adafactor_elements * state_bytes
    per_param = OPTIMIZER_STATE_BYTES[optimizer]
    if optimizer == "adamw-8bit":  # quantised states do not follow the parameter dtype
        return per_param * trainable
    return per_param * trainable * state_bytes // FP32_BYTES


def adafactor_state_elements(shapes) -> int:
    """Factored second moment: rows + cols per matrix (batched over leading dims), full for vectors.

    Adafactor (Shazeer & Stern 2018) with beta1=None keeps no first moment (torch and transformers default).
    """
    total = 0
    for shape in shapes:
        if len(shape) >= 2:
            total += math.prod(shape[:-2]) * (shape[-2] + shape[-1])
        else:
            total += math.prod(shape)
    return total


def model_states(
    parameters: int, trainable: int, *, precision: str, optimizer: str, zero_stage: int = 0,
    offload: str = "none", world_size: int = 1, gpus_per_node: int | None = None,
    largest_layer: int = 0, adafactor_elements: int = 0,
) -> ModelStates:
    """Per-GPU model states for one configuration (see the module docstring for both engines)."""
    validate_choice(precision, optimizer, zero_stage, offload)
    if zero_stage == 0:
        return _torch_states(parameters, trainable, precision, optimizer, adafactor_elements)
    return _deepspeed_states(parameters, trainable, precision, optimizer, zero_stage, offload, world_size,
                             gpus_per_node or world_size, largest_layer, adafactor_elements)


def _torch_states(parameters, trainable, precision, optimizer, adafactor_elements) -> ModelStates:
    width = HALF_BYTES if precision == "bf16-true" else FP32_BYTES
    return ModelStates(
        parameters=parameters * width,
        gradients=trainable * width,
        optimizer_states=optimizer_state_bytes(optimizer, trainable, adafactor_elements, width),
    )


def _deepspeed_states(parameters, trainable, precision, optimizer, stage, offload, world, per_node,
                      largest_layer, adafactor_elements) -> ModelStates:
    mixed = precision != "fp32"
    width = HALF_BYTES if mixed else FP32_BYTES
    master = DS_MASTER_BYTES if mixed else 0
    optim_total = optimizer_state_bytes(optimizer, trainable, adafactor_elements) + master * trainable
    offload_opt = offload in ("optimizer", "optimizer+params")
    nodes = max(1, math.ceil(world / per_node))
    if stage < 3:
        params = parameters * width
        if offload_opt:  # gradients stream to the CPU optimizer; only the 16-bit weights stay
            grads, optim = 0, 0
        else:
            grad32 = DS_GRAD32_BYTES * trainable if mixed else 0
            grads16 = trainable * width // (world if stage == 2 else 1)
            grads = grads16 + grad32 // world
            optim = optim_total // world
        cpu = parameters * max(4 * world, 16) * DS_CPU_BUFFER_FACTOR if offload_opt else 0
    else:
        gathered = DS_Z3_GATHERED_LAYER_BYTES * largest_layer
        params = gathered + (0 if offload == "optimizer+params" else parameters * width // world)
        grads = 0 if offload_opt else (DS_Z3_GRAD_BYTES if mixed else FP32_BYTES) * trainable // world
        optim = 0 if offload_opt else optim_total // world
        # host memory with zero.Init (zero3_init_flag, as we emit): 18 or 16 B/param over the nodes
        per_param_cpu = 18 if offload == "optimizer+params" else 16
        cpu = parameters * per_param_cpu / nodes * DS_CPU_BUFFER_FACTOR if offload_opt else 0
    return ModelStates(parameters=int(params), gradients=int(grads), optimizer_states=int(optim), cpu_bytes=int(cpu))
