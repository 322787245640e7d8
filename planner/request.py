"""The CLI's flags, validated into one typed request before anything heavy is imported."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from planner.errors import InputError

Precision = Literal["auto", "fp32", "fp16-mixed", "bf16-mixed", "bf16-true"]
Optimizer = Literal["adamw", "adam", "sgd", "sgd-momentum", "adafactor", "adamw-8bit", "lion"]

#: pydantic field -> the flag a user types, for error messages
FLAGS = {"global_batch": "--batch", "lr_batch": "--lr-batch", "memory_method": "--memory-method"}


class PlanRequest(BaseModel):
    """One `plan` invocation. Field docs are the flags' help."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(min_length=1, description="hub id, local folder with config.json, or preset")
    global_batch: int = Field(gt=0, description="global batch size in samples")
    seq_len: int | None = Field(default=None, gt=0)
    gpu: str | None = None
    gpus_per_node: int | None = Field(default=None, gt=0, le=1024)
    nodes: int = Field(default=1, gt=0, le=100_000)
    optimizer: Optimizer = "adamw"
    precision: Precision = "auto"
    micro_batch: int | None = Field(default=None, gt=0)
    checkpointing: Literal["none", "selective", "full"] | None = None
    zero_stage: int | None = Field(default=None, ge=0, le=3)
    attention: Literal["eager", "sdpa", "flash"] = "sdpa"
    offload: bool = True
    headroom: float | None = Field(default=None, ge=0.0, lt=0.9)
    lr: float | None = Field(default=None, gt=0)
    lr_batch: int | None = Field(default=None, gt=0)
    lr_scaling: Literal["auto", "sqrt", "linear", "none"] = "auto"
    memory_method: Literal["auto", "trace", "analytic"] = "auto"
    trust_remote_code: bool = False

    @field_validator("model")
    @classmethod
    def _strip(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("empty model name")
        return value.strip()

    def plan_kwargs(self) -> dict:
        data = self.model_dump()
        model = data.pop("model")
        return {"model": model, **data}


def build_request(**flags) -> PlanRequest:
    """Validate flags; the first problem becomes an InputError naming its flag."""
    try:
        return PlanRequest(**flags)
    except ValidationError as err:
        first = err.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "input"
        flag = FLAGS.get(field, "--" + field.replace("_", "-"))
        raise InputError(first["msg"], flag=flag) from None
