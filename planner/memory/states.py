"""Model states per GPU: parameters, gradients, optimizer states. Pure functions, bytes.

Every engine's bytes per parameter is a fact (planner/facts/engines.json) with where it comes from (ZeRO paper arXiv
1910.02054, Fig. 1 and section 3; DeepSpeed 0.19.8 `estimate_zero{2,3}_model_states_mem_needs`; FSDP2 `fully_shard`).
The per-value facts (bytes per state element, weight widths) are in `planner.vocab`'s tables; `Config` derives
the widths of one configuration.

Three engines hold model states differently:
* torch (ZeRO stage 0: one GPU or DDP). Parameters stay in their storage dtype (fp32, or bf16 for
  bf16-true); torch.autocast casts copies inside the forward, which we count as activations because
  that is where they live and die. Gradients have the parameters' dtype.
* DeepSpeed (ZeRO 1-3). Mixed precision keeps 16-bit parameters and gradients plus an fp32 master copy
  and an fp32 gradient partition in the optimizer: "18 = 2 grads16 + 4 grads32 + 4 params32 + 8 optim32"
  (+2 params16) = 20 B/param before sharding, which is exactly DeepSpeed's estimator
  (ZeRO-2: 2Ψ + 18Ψ/N, the 16-bit gradients sharded too; ZeRO-3: 4·largest_layer + 18Ψ/N). ZeRO-1
  keeps the full 16-bit gradients (2Ψ + 2Ψ + 16Ψ/N); it has no DeepSpeed estimator. Reduce buckets are
  counted as overhead (estimate.py).
* FSDP2 (stages 2 and 3 in ZeRO numbering): fp32 shards of parameters, gradients and optimizer states, and an
  all-gathered 16-bit working copy per block (`_fsdp_states`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner import facts
from planner.config import FP32_BYTES, Config
from planner.vocab import FSDP, NO_CHECKPOINTING, NO_OFFLOAD, OFFLOAD, OPTIMIZER

@dataclass(frozen=True)
class ModelStates:
    """Bytes per GPU, plus what offload keeps in host memory: `cpu_bytes` as DeepSpeed's estimators reserve it per
    node (pinned buffers included), `host_tensors` the tensors one rank keeps there."""

    parameters: int
    gradients: int
    optimizer_states: int
    cpu_bytes: int = 0
    host_tensors: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states


def validate_choice(precision: str, optimizer: str, zero_stage: int, offload: str, engine: str | None = None) -> None:
    """Raise ValueError naming the bad value or combination (callers turn it into an InputError)."""
    if optimizer not in OPTIMIZER:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER)}")
    Config.of(micro_batch=1, grad_accum=1, world_size=1, precision=precision, checkpointing=NO_CHECKPOINTING,
              zero_stage=zero_stage, offload=offload, engine=engine)


def optimizer_state_bytes(optimizer: str, trainable: int, adafactor_elements: int, state_bytes: int = FP32_BYTES) -> int:
    """Optimizer state bytes for `trainable` parameters whose states are `state_bytes` wide."""
    info = OPTIMIZER[optimizer]
    elements = adafactor_elements if info.factored else trainable
    per_param = FP32_BYTES if info.factored else info.state_bytes
    if not info.follows_weights:  # quantised states do not follow the parameter dtype
        return per_param * elements
    return per_param * elements * state_bytes // FP32_BYTES


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


@dataclass(frozen=True)
class ParameterCounts:
    """What a model's states are sized by: its parameters and the trainable share, the largest layer (ZeRO-3
    gathers it whole), one block's parameters (FSDP gathers block by block), Adafactor's factored state elements,
    and `frozen_bytes`: the frozen parameters' bytes as stored when adapters train (a 16-bit or 4-bit base,
    `ModelSpec.frozen_bytes`), None where every parameter is in the working width."""

    parameters: int
    trainable: int
    largest_layer: int = 0
    block_parameters: int = 0
    adafactor_elements: int = 0
    frozen_bytes: int | None = None


def model_states(parameters: int, trainable: int, *, optimizer: str, gpus_per_node: int | None = None,
                 largest_layer: int = 0, adafactor_elements: int = 0, block_parameters: int = 0,
                 **choice) -> ModelStates:
    """Per-GPU model states by keyword (see `states_for`); `choice` holds `Config` fields (precision, zero_stage,
    offload, world_size, engine). Raises ValueError naming a bad value or combination."""
    choice = {"world_size": 1, "zero_stage": 0, "offload": NO_OFFLOAD, **choice}
    validate_choice(choice.get("precision"), optimizer, choice["zero_stage"], choice["offload"], choice.get("engine"))
    cfg = Config(micro_batch=1, grad_accum=1, checkpointing=NO_CHECKPOINTING, **choice)
    counts = ParameterCounts(parameters, trainable, largest_layer=largest_layer, block_parameters=block_parameters,
                             adafactor_elements=adafactor_elements)
    return states_for(cfg, counts, optimizer, gpus_per_node=gpus_per_node)


def states_for(cfg: Config, counts: ParameterCounts, optimizer: str, *, gpus_per_node: int | None = None
               ) -> ModelStates:
    """Per-GPU model states of `cfg` (see the module docstring for each engine). With adapters (`frozen_bytes`
    given) the adapters are fp32 whatever the precision (peft's `autocast_adapter_dtype`,
    planner/models/adapters.py `cast_mixed`); DeepSpeed keeps all weights 16-bit either way."""
    parameters, trainable, frozen_bytes = counts.parameters, counts.trainable, counts.frozen_bytes
    adapters = not cfg.sharded and frozen_bytes is not None  # peft keeps the trainable parameters in fp32
    optim = optimizer_state_bytes(optimizer, trainable, counts.adafactor_elements,
                                  FP32_BYTES if adapters else cfg.state_width())
    if adapters:
        return ModelStates(parameters=FP32_BYTES * trainable + frozen_bytes, gradients=FP32_BYTES * trainable,
                           optimizer_states=optim)
    if not cfg.sharded:
        return ModelStates(parameters=parameters * cfg.weight_bytes(), gradients=trainable * cfg.grad_bytes(),
                           optimizer_states=optim)
    per_node = gpus_per_node or cfg.world_size
    if cfg.engine == FSDP:
        return _fsdp_states(cfg, counts, optim, per_node)
    return _deepspeed_states(cfg, parameters, trainable, optim, per_node, counts.largest_layer)


def _deepspeed_states(cfg: Config, parameters, trainable, optim_fp32, per_node, largest_layer) -> ModelStates:
    world, width = cfg.world_size, cfg.weight_bytes()
    optim_total = optim_fp32 + cfg.master_bytes() * trainable
    offload = OFFLOAD[cfg.offload]
    nodes = max(1, math.ceil(world / per_node))
    if cfg.zero_stage < 3:
        params = parameters * width
        if offload.optimizer_on_cpu:  # gradients stream to the CPU optimizer; only the 16-bit weights stay
            grads, optim = 0, 0
        else:
            grad32 = facts.get("deepspeed.grad32_bytes") * trainable if cfg.master_bytes() else 0
            grads16 = trainable * width // (world if cfg.zero_stage == 2 else 1)
            grads = grads16 + grad32 // world
            optim = optim_total // world
        cpu = host = 0
        if offload.optimizer_on_cpu:  # fp32 master, optimizer states and fp32 gradient partition of what trains
            cpu = trainable * max(4 * world, 16) * facts.get("deepspeed.cpu_buffer_factor")
            host = (optim_total + facts.get("deepspeed.grad32_bytes") * trainable) // world
            host += facts.get("deepspeed.cpu_accumulation_bytes") * trainable if cfg.grad_accum > 1 else 0
    else:
        gathered = facts.get("deepspeed.z3_gathered_layer_bytes") * largest_layer
        params = gathered + (0 if offload.params_on_cpu else parameters * width // world)
        grads = optim = cpu = host = 0
        if not offload.optimizer_on_cpu:
            grads = (facts.get("deepspeed.z3_grad_bytes") if cfg.master_bytes() else FP32_BYTES) * trainable // world
            optim = optim_total // world
        else:  # host memory with zero.Init (zero3_init_flag, as we emit): 18 or 16 B/param over the nodes
            per_param_cpu = 18 if offload.params_on_cpu else 16
            frozen = (parameters - trainable) * (width if offload.params_on_cpu else 0)  # only its 16-bit copy
            cpu = (trainable * per_param_cpu + frozen) / nodes * facts.get("deepspeed.cpu_buffer_factor")
            host = (optim_total + facts.get("deepspeed.grad32_bytes") * trainable) // world
        host += parameters * width // world if offload.params_on_cpu else 0
    return ModelStates(parameters=int(params), gradients=int(grads), optimizer_states=int(optim), cpu_bytes=int(cpu),
                       host_tensors=int(host))


def _fsdp_states(cfg: Config, counts: ParameterCounts, optim_fp32: int, per_node: int) -> ModelStates:
    """FSDP2 (`fully_shard`): each rank keeps its shard of the fp32 parameters, of their gradients and of the
    optimizer states; the working copy (16-bit under a MixedPrecisionPolicy) is all-gathered per block. FULL_SHARD
    (stage 3) frees a block's gathered weights after its forward and backward, so about two blocks live
    (prefetch); SHARD_GRAD_OP (stage 2, reshard_after_forward=False) keeps every gathered weight from the forward
    to the backward. CPU offload (CPUOffloadPolicy) keeps the shards and the optimizer step in host memory
    (torch/distributed/fsdp/_fully_shard/_fully_shard.py, `fully_shard` docstring)."""
    world, width = cfg.world_size, cfg.weight_bytes()
    parameters, trainable, block = counts.parameters, counts.trainable, counts.block_parameters or counts.largest_layer
    stored = FP32_BYTES * parameters if counts.frozen_bytes is None else FP32_BYTES * trainable + counts.frozen_bytes
    shard = stored // world
    # FSDP gathers over the data-parallel ranks only: a tensor-parallel rank holds 1/tp of every gathered weight
    gathered = (facts.get("fsdp.gathered_blocks") * block * width if cfg.zero_stage == 3 else parameters * width) // (
        cfg.tensor_parallel)
    grads = FP32_BYTES * trainable // world
    optim = optim_fp32 // world
    if OFFLOAD[cfg.offload].params_on_cpu:
        ranks_here = min(per_node, world)
        host = shard + grads + optim
        return ModelStates(parameters=int(gathered), gradients=0, optimizer_states=0, cpu_bytes=int(host * ranks_here),
                           host_tensors=int(host))
    return ModelStates(parameters=int(shard + gathered), gradients=int(grads), optimizer_states=int(optim))
