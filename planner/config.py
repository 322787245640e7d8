"""`Config`: one training configuration, and every rule derived from it, as methods (litgpt's `Config` habit).

Memory, speed, search, probes, emitters and views ask a `Config` rather than re-deriving from its strings:
byte widths, the traced program's family, the probing family, the engine's limits, the label.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from planner.vocab import (
    ADAPTER, CHECKPOINTING, DEEPSPEED, DEFAULT_SHARDING_ENGINE, ENGINE, FSDP, NO_CHECKPOINTING, OFFLOAD, OPTIMIZER,
    PADDING, PRECISION, SPLIT_OFF, UNSHARDED_ENGINE, Checkpointing, Engine, Offload, Padding, Precision,
)
from planner.vocab import activation_family as family_for

FP32_BYTES = 4


class Config(BaseModel):
    """One candidate: how a global batch is split and which memory/speed techniques it uses."""

    model_config = ConfigDict(frozen=True)

    micro_batch: int = Field(gt=0, description="samples per GPU per forward/backward")
    grad_accum: int = Field(gt=0, description="micro-batches accumulated per optimizer step (N)")
    world_size: int = Field(gt=0, description="data-parallel GPUs")
    precision: Precision
    checkpointing: Checkpointing
    zero_stage: int = Field(ge=0, le=3, description="sharding stage in ZeRO numbering (0: none)")
    offload: Offload
    engine: Engine = Field(default=None, validate_default=False,  # type: ignore[assignment]
                           description="torch at stage 0; the sharding engine (default deepspeed) above")
    tensor_parallel: int = Field(default=1, ge=1, description="GPUs each layer is split across (within a node)")
    context_parallel: int = Field(default=1, ge=1, description="GPUs each sequence is split across by torch's ring "
                                                               "attention (accelerate's cp_size, FSDP2)")
    sequence_parallel: int = Field(default=1, ge=1, description="GPUs each sequence is split across by DeepSpeed's "
                                                                "Ulysses all-to-alls (accelerate's sp_size)")
    compiled: bool = Field(default=False, description="the model runs under torch.compile (TorchInductor)")
    liger: bool = Field(default=False, description="Liger-Kernel's Triton kernels patch the model (the Trainer's "
                                                   "use_liger_kernel): planner/program/liger.py")
    padding: Padding | None = Field(default=None, description="how a dataset's samples become micro-batches "
                                                              "(`vocab.PADDING`); None: every sample fills its row")

    @model_validator(mode="before")
    @classmethod
    def _default_engine(cls, data):
        if isinstance(data, dict) and data.get("engine") is None:
            data = {**data, "engine": DEFAULT_SHARDING_ENGINE if data.get("zero_stage") else UNSHARDED_ENGINE}
        return data

    @model_validator(mode="after")
    def _engine_can_run_it(self) -> "Config":
        problem = self.problem()
        if problem:
            raise ValueError(problem)
        return self

    @classmethod
    def of(cls, **fields) -> "Config":
        """A validated Config; a bad field or combination raises ValueError naming it in one line."""
        try:
            return cls(**fields)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            message = first["msg"].removeprefix("Value error, ")
            raise ValueError(f"{where}: {message}" if where else message) from None

    @classmethod
    def problem_of(cls, **fields) -> str | None:
        """`problem` of a combination (engine, stage, offload, precision, world size, ...) before its batch split."""
        split = dict(micro_batch=1, grad_accum=1, checkpointing=NO_CHECKPOINTING, tensor_parallel=1, compiled=False)
        return cls.model_construct(**{**split, **fields}).problem()

    @staticmethod
    def sharding_redundant(world_size: int, zero_stage: int, offload: str) -> str | None:
        """Why sharding is not worth planning here, or None: on one GPU there is nothing to shard across, so ZeRO
        only helps by moving the optimizer to the host."""
        if world_size == 1 and zero_stage > 0 and not OFFLOAD[offload].optimizer_on_cpu:
            return "ZeRO on one GPU only helps with offload"
        return None

    def problem(self) -> str | None:
        """Why this combination cannot run, or None."""
        engine = ENGINE[self.engine]
        offload = OFFLOAD[self.offload]
        if offload.optimizer_on_cpu and not self.sharded:
            return "offload needs a ZeRO engine (ZeRO stage >= 1)"
        if offload.params_on_cpu and self.zero_stage != 3:
            return "offloading parameters needs ZeRO stage 3"
        if self.zero_stage not in engine.zero_stages:
            stages = ", ".join(map(str, engine.zero_stages))
            return f"the {self.engine} engine runs ZeRO stage {stages}, not {self.zero_stage}"
        if self.offload not in engine.offloads[self.zero_stage]:
            return (f"the {self.engine} engine cannot offload {self.offload} at stage {self.zero_stage} "
                    f"(it can: {', '.join(engine.offloads[self.zero_stage])})")
        if self.tensor_parallel > 1 and (self.engine != FSDP or self.world_size % self.tensor_parallel):
            return ("tensor parallelism runs through accelerate's ParallelismConfig with FSDP2 (tp_size x "
                    "dp_shard_size = the GPUs)")
        if self.zero_stage and not PRECISION[self.precision].zero_engines:
            return f"{self.precision} runs on the torch engine only (ZeRO engines keep fp32 master weights)"
        return self._sequence_split_problem() or self._float8_problem()

    def _sequence_split_problem(self) -> str | None:
        """accelerate's rules for splitting the sequence (accelerate/parallelism_config.py, accelerate/state.py)."""
        cp, sp = self.context_parallel, self.sequence_parallel
        if cp == sp == 1:
            return None
        if cp > 1 and sp > 1:  # parallelism_config.py:328-334
            return "context parallelism and sequence parallelism are mutually exclusive"
        if self.tensor_parallel > 1:
            return "a split sequence is not planned beside tensor parallelism"
        if self.world_size % (cp * sp):
            return f"{cp * sp} sequence shards do not divide {self.world_size} GPUs"
        if cp > 1 and self.engine != FSDP:  # state.py:996-1009
            return "context parallelism (cp_size) needs FSDP2"
        if sp > 1 and self.engine != DEEPSPEED:  # accelerator.py:2395-2405
            return "sequence parallelism (sp_size, Ulysses) runs through DeepSpeed"
        return None

    def _float8_problem(self) -> str | None:
        if not PRECISION[self.precision].float8:
            return None
        if self.engine == DEEPSPEED:  # accelerate/accelerator.py:599-601: DeepSpeed's state is always bf16
            return "fp8 runs through accelerate's AO backend on DDP or FSDP2; under DeepSpeed accelerate trains in bf16"
        if self.tensor_parallel > 1:
            return ("fp8 is not planned with tensor parallelism: torchao's float8 TP needs its own parallel styles "
                    "(torchao/float8/float8_tensor_parallel.py), which transformers' tp_plan does not apply")
        return None

    def optimizer_problem(self, optimizer: str) -> str | None:
        """Why this configuration cannot train with `optimizer`, or None: DeepSpeed's offload steps on the CPU with
        its own optimizers only (deepspeed/runtime/engine.py `_configure_zero_optimizer`: ZeRO-Offload needs
        DeepSpeedCPUAdam unless zero_force_ds_cpu_optimizer is off), and FSDP's CPU offload steps with a torch
        optimizer on the host."""
        info, offload = OPTIMIZER[optimizer], OFFLOAD[self.offload]
        if info.client is not None and self.sharded:  # LAMB: its trust ratio is per layer
            return (f"{optimizer} is built by the script (plan.create_optimizer) for unsharded training: ZeRO and FSDP "
                    "hand an optimizer flattened or DTensor shards, over which a per-layer trust ratio is not LAMB's "
                    "(DeepSpeed's own Lamb also needs fp16 dynamic loss scaling, deepspeed/runtime/engine.py)")
        if not offload.optimizer_on_cpu:
            return None
        if self.engine == DEEPSPEED and info.deepspeed is None:
            return f"DeepSpeed offloads only its own optimizers (Adam, AdamW, Lion), not {optimizer}"
        if self.engine == FSDP and info.torch_class is None:
            return f"FSDP's CPU offload steps a torch optimizer on the host; {optimizer} runs on the GPU only"
        return None

    def adapter_problem(self, adapter: str) -> str | None:
        """Why this configuration cannot train `adapter` (`vocab.ADAPTER`), or None."""
        info = ADAPTER[adapter]
        if info.trains_adapters and PRECISION[self.precision].float8:
            return ("fp8 is planned for full training: with adapters the frozen base's linears are peft-wrapped, and "
                    "no published float8 measurement covers them")
        if info.quantized_base and self.half_dtype() is None:
            return "QLoRA computes in 16 bits (bnb_4bit_compute_dtype): use fp16-mixed, bf16-mixed or bf16-true"
        if info.quantized_base and self.sharded:
            return ("QLoRA is planned on one GPU or DDP: sharding a 4-bit base (DeepSpeed ZeRO-3, FSDP) needs "
                    "bitsandbytes to store it in the compute dtype (bnb_4bit_quant_storage), which trainplan does not "
                    "plan; DeepSpeed's ZeRO-1/2 optimizers expect floating-point parameters")
        return None

    # --- sizes
    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.data_parallel

    @property
    def data_parallel(self) -> int:
        """GPUs that see different samples: all of them, divided by the tensor-parallel group and by the GPUs a
        sequence is split across (the Trainer's dp_world_size, transformers/trainer.py:2565-2581)."""
        return self.world_size // (self.tensor_parallel * self.sequence_split)

    @property
    def sequence_split(self) -> int:
        """GPUs each sequence is split across (context or sequence parallel): each holds 1/n of its tokens."""
        return self.context_parallel * self.sequence_parallel

    @property
    def shard_ranks(self) -> int:
        """GPUs that shard the model states and reduce the gradients: every data-parallel rank and every rank a
        sequence is split across (FSDP2 over dp_shard x cp, parallelism_config.py:135-143; ZeRO over the Ulysses
        sequence x data group, deepspeed/runtime/sequence_parallel/parallel_state_sp.py:11-12)."""
        return self.world_size // self.tensor_parallel

    def unsplit(self) -> "Config":
        """This configuration with each sequence whole on one GPU (what a split one's shards are a share of)."""
        return self.model_copy(update={"context_parallel": 1, "sequence_parallel": 1})

    @property
    def sharded(self) -> bool:
        return self.zero_stage > 0

    def weight_bytes(self) -> int:
        """Bytes per parameter of the working weights the GPU computes with."""
        info = PRECISION[self.precision]
        return info.zero_weight_bytes if self.sharded else info.weight_bytes

    def grad_bytes(self) -> int:
        """Bytes per trainable parameter of the gradients autograd produces (the weights' dtype)."""
        return self.weight_bytes()

    def half_dtype(self) -> str | None:
        """The 16-bit dtype (a `torch` attribute name) of the computation: autocast's, or bf16 for a 16-bit model;
        None for fp32. Adapters keep the frozen base in it (planner/models/adapters.py)."""
        info = PRECISION[self.precision]
        return info.autocast or ("bfloat16" if info.weight_bytes < FP32_BYTES else None)

    def frozen_weight_bytes(self) -> int:
        """Bytes per frozen parameter when adapters train: the 16-bit compute dtype where there is one (peft's
        `cast_mixed_precision_params`, peft/utils/other.py), fp32 otherwise."""
        return 2 if self.half_dtype() else FP32_BYTES

    def master_bytes(self) -> int:
        """Bytes per trainable parameter a ZeRO engine adds for fp32 master weights (0 without)."""
        return FP32_BYTES if self.sharded and PRECISION[self.precision].zero_master else 0

    def state_width(self) -> int:
        """Bytes per element of optimizer states that follow the parameters' dtype."""
        return PRECISION[self.precision].weight_bytes if not self.sharded else FP32_BYTES

    # --- families
    def activation_family(self) -> str:
        """The traced program's weights and autocast: fp32; mixed (autocast over fp32 weights); half (a 16-bit
        model without autocast: bf16-true, and DeepSpeed's 16-bit working copy); half+autocast (FSDP's 16-bit
        working copy under accelerate's autocast)."""
        info, engine = PRECISION[self.precision], ENGINE[self.engine]
        if info.autocast is None:
            return family_for(half_weights=info.weight_bytes < FP32_BYTES, autocast=False)
        return family_for(half_weights=engine.half_working_copy, autocast=engine.autocast)

    def trace_family(self) -> tuple[str, ...]:
        """Candidates whose activations come from the same traced program (and calibrate each other)."""
        return (self.activation_family(), self.checkpointing) + (("liger",) if self.liger else ())

    def compile_saves_activations(self) -> bool:
        """Whether compiling changes what the step saves: Inductor's partitioner recomputes cheap values instead of
        saving them, but a checkpointed block saves only its input either way (planner/program/compiled.py)."""
        return self.compiled and not CHECKPOINTING[self.checkpointing].enabled

    def precision_family(self) -> str:
        """The precision with fp16 and bf16 autocast as one ("mixed"): they have the same bytes and speed (on the
        lent H100, BLOOM-560m's fp16-mixed and bf16-mixed steps measured within 3 % of each other,
        benchmarks/data/gpu_measured_h100.json)."""
        info = PRECISION[self.precision]
        return "mixed" if info.autocast and not info.float8 else self.precision

    def family(self) -> tuple:
        """The configuration apart from its micro-batch split, with fp16 and bf16 autocast as one
        (`precision_family`), so views, probes and probe calibration treat them as one family."""
        tp = tuple(f"{name}{n}" for name, n in (("tp", self.tensor_parallel), ("cp", self.context_parallel),
                                                 ("sp", self.sequence_parallel)) if n > 1)
        return (self.precision_family(), self.checkpointing, self.zero_stage, self.offload, self.engine) + tp + (
            ("compiled",) if self.compiled else ()) + (("liger",) if self.liger else ()) + (
            (self.padding,) if self.padding else ())

    @staticmethod
    def family_text(family: tuple) -> str:
        """A family as text (the key of a plan's calibration table)."""
        return " / ".join(str(x) for x in family)

    def request_fields(self) -> dict:
        """The `PlanRequest` fields that pin this configuration (`planner.plan(..., **fields)` plans it again): its
        split, precision, checkpointing, sharding, offload, tensor and sequence splits, compile and Liger switches."""
        switch = {True: "on", False: "off"}
        split = {n: (str(n) if n > 1 else SPLIT_OFF)
                 for n in (self.tensor_parallel, self.context_parallel, self.sequence_parallel)}
        fields = {"micro_batch": self.micro_batch, "precision": self.precision, "checkpointing": self.checkpointing,
                  "zero_stage": self.zero_stage, "offload": self.offload, "compile": switch[self.compiled],
                  "liger": switch[self.liger], "tensor_parallel": split[self.tensor_parallel],
                  "context_parallel": split[self.context_parallel], "sequence_parallel": split[self.sequence_parallel]}
        return {**fields, "engine": self.engine} if self.sharded else fields

    # --- ranking and display
    def structure(self) -> int:
        """Moving parts of the training program's structure: a sharding engine over DDP, offload, tensor
        parallelism, a split sequence (what `search.rank` prefers fewer of unless the speed model can tell them
        apart)."""
        return int(self.sharded) + OFFLOAD[self.offload].moving_parts + int(self.tensor_parallel > 1) + int(
            self.sequence_split > 1)

    def complexity(self) -> int:
        """Moving parts, for tie-breaks: sharding, offload, recompute, loss scaling, accumulation, TP, split
        sequences, compilation, Liger, packing."""
        return (self.zero_stage + OFFLOAD[self.offload].moving_parts + CHECKPOINTING[self.checkpointing].moving_parts
                + int(PRECISION[self.precision].loss_scaling) + int(self.grad_accum > 1)
                + 2 * (self.tensor_parallel > 1) + 2 * (self.sequence_split > 1) + int(self.compiled) + int(self.liger)
                + int(self.padding is not None and not PADDING[self.padding].padded))

    def parallelism_label(self) -> str:
        if self.world_size == 1 and not self.sharded:
            return "single GPU"
        name = ENGINE[self.engine].stage_names[self.zero_stage]
        if self.context_parallel > 1:
            return f"CP {self.context_parallel} x {name}"
        if self.sequence_parallel > 1:
            return f"Ulysses SP {self.sequence_parallel} x {name}"
        return f"TP {self.tensor_parallel} x {name} {self.data_parallel}" if self.tensor_parallel > 1 else name

    def label(self) -> str:
        off = f" + offload {self.offload}" if OFFLOAD[self.offload].optimizer_on_cpu else ""
        ck = f", {self.checkpointing} ckpt" if CHECKPOINTING[self.checkpointing].enabled else ""
        compiled = (", compiled" if self.compiled else "") + (", Liger" if self.liger else "") + (
            f", {self.padding}" if self.padding else "")
        return (f"mb {self.micro_batch} x N {self.grad_accum} x {self.world_size} GPU, {self.precision}{ck}{compiled}, "
                f"{self.parallelism_label()}{off}")
