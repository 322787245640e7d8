"""The CLI's flags, validated into one typed request before anything heavy is imported."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from planner.errors import InputError
from planner.models.adapters import Adapter
from planner.vocab import (
    ADAPTER, AUTO, AUTO_METHOD, DEFAULT_OPTIMIZER, DEFAULT_SHARDING_ENGINE, NO_ADAPTER, PRECISION, SDPA, AdapterMethod,
    Attention, Checkpointing, CompileMode, LRScaling, MemoryMethod, Offload, Optimizer, ShardingEngine, TaskChoice,
)


@dataclass(frozen=True)
class Limits:
    """Sane upper bounds on sizes: beyond them a value is a typo, and planning it would take forever (the number of
    micro-batch splits grows with the batch's divisors; a 10^15 batch would be centuries per step)."""

    batch: int = 2**24              # 16.7M samples per optimizer step (real LLM batches are 10^3-10^4 samples)
    gpus_per_node: int = 128        # the largest NVLink domains (e.g. 72-GPU racks) fit
    nodes: int = 16_384
    world_size: int = 2**17         # 131,072 GPUs in all
    seq_len: int = 2**21            # 2M tokens
    lr_batch: int = 2**24
    host_memory_gb: float = 2**20   # 1 PB of RAM per node
    nic_gbps: float = 10_000.0      # per GPU; today's fastest NICs run 800 Gb/s


LIMITS = Limits()

#: pydantic field -> the flag a user types, for error messages
FLAGS = {"global_batch": "--batch", "lr_batch": "--lr-batch", "memory_method": "--memory-method",
         "host_memory_gb": "--host-memory", "double_quant": "--no-double-quant"}


class PlanRequest(BaseModel):
    """One `plan` invocation. Field docs are the flags' help."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(min_length=1, description="hub id, local folder with config.json, or preset")
    global_batch: int = Field(gt=0, le=LIMITS.batch, description="global batch size in samples")
    seq_len: int | None = Field(default=None, gt=0, le=LIMITS.seq_len)
    gpu: str | None = None
    gpus_per_node: int | None = Field(default=None, gt=0, le=LIMITS.gpus_per_node)
    nodes: int = Field(default=1, gt=0, le=LIMITS.nodes)
    optimizer: Optimizer = DEFAULT_OPTIMIZER
    precision: Literal[(AUTO, *PRECISION)] = AUTO  # type: ignore[valid-type]
    micro_batch: int | None = Field(default=None, gt=0, le=LIMITS.batch)
    checkpointing: Checkpointing | None = None
    zero_stage: int | None = Field(default=None, ge=0, le=3)
    attention: Attention = SDPA
    offload: bool | Offload = True                 # True: any; False: none; or the one to use
    headroom: float | None = Field(default=None, ge=0.0, lt=0.9)
    host_memory_gb: float | None = Field(default=None, gt=0, le=LIMITS.host_memory_gb, allow_inf_nan=False,
                                         description="host RAM per node in GB, for CPU offload")
    nic_gbps: float | None = Field(default=None, gt=0, le=LIMITS.nic_gbps, allow_inf_nan=False,
                                   description="inter-node bandwidth per GPU in Gb/s")
    lr: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    lr_batch: int | None = Field(default=None, gt=0, le=LIMITS.lr_batch)
    lr_scaling: LRScaling = AUTO
    memory_method: MemoryMethod = AUTO_METHOD
    engine: ShardingEngine = DEFAULT_SHARDING_ENGINE
    trust_remote_code: bool = False
    task: TaskChoice = AUTO
    num_labels: int | None = Field(default=None, gt=0, le=1_000_000)
    peft: AdapterMethod = NO_ADAPTER
    lora_rank: int | None = Field(default=None, gt=0, le=4096)
    lora_alpha: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    lora_targets: str | None = None
    lora_dropout: float | None = Field(default=None, ge=0.0, lt=1.0)
    double_quant: bool = True
    train_tokens: float | None = Field(default=None, gt=0, allow_inf_nan=False, description="tokens of the whole run")
    train_steps: int | None = Field(default=None, gt=0, le=LIMITS.batch, description="optimizer steps of the run")
    compile: CompileMode = AUTO

    @field_validator("model")
    @classmethod
    def _strip(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("empty model name")
        return value.strip()

    def adapter(self):
        """The LoRA / QLoRA adapter asked for (planner.models.adapters.Adapter), or None; LoRA flags without
        --peft are an InputError."""

        lora = {"--lora-rank": self.lora_rank, "--lora-alpha": self.lora_alpha, "--lora-targets": self.lora_targets,
                "--lora-dropout": self.lora_dropout, "--no-double-quant": None if self.double_quant else False}
        if self.peft == NO_ADAPTER:
            given = next((flag for flag, value in lora.items() if value is not None), None)
            if given:
                raise InputError("applies to adapters", flag=given, hint="Add --peft lora (or --peft qlora).")
            return None
        if not self.double_quant and not ADAPTER[self.peft].quantized_base:
            raise InputError("applies to QLoRA's 4-bit base", flag="--no-double-quant", hint="Add --peft qlora.")
        fields = {"rank": self.lora_rank, "alpha": self.lora_alpha, "dropout": self.lora_dropout,
                  "targets": Adapter.parse_targets(self.lora_targets) if self.lora_targets is not None else None}
        return Adapter(method=self.peft, double_quant=self.double_quant,
                       **{k: v for k, v in fields.items() if v is not None})

    def plan_kwargs(self) -> dict:
        adapter = self.adapter()
        data = self.model_dump(exclude={"peft", "lora_rank", "lora_alpha", "lora_targets", "lora_dropout",
                                        "double_quant"})
        model = data.pop("model")
        gb = data.pop("host_memory_gb")
        return {"model": model, **data, "host_memory": None if gb is None else int(gb * 1e9), "adapter": adapter}


def build_request(**flags) -> PlanRequest:
    """Validate flags; the first problem becomes an InputError naming its flag."""
    try:
        return PlanRequest(**flags)
    except ValidationError as err:
        first = err.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "input"
        flag = FLAGS.get(field, "--" + field.replace("_", "-"))
        raise InputError(first["msg"], flag=flag) from None
