"""What crosses the probe's process boundary: the request the parent writes and the worker validates, and the
result line the worker prints and the parent validates (`planner.types.Measurement`)."""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field

from planner.types import Measurement
from planner.vocab import Attention, Checkpointing, Optimizer, Precision

#: The worker's result line starts with this; anything else on stdout is the model's own chatter.
RESULT_PREFIX = "PROBE-RESULT "


class ProbeRequest(BaseModel):
    """One probe: a model (its config, or a local folder), one configuration, and how long to measure."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    config: dict | None = None            # the model's config.json contents
    model_dir: str | None = None          # or a local folder with config.json
    trust_remote_code: bool = False
    config_hash: str
    micro_batch: int = Field(gt=0)
    grad_accum: int = Field(gt=0)
    seq_len: int = Field(gt=0)
    precision: Precision
    checkpointing: Checkpointing
    attention: Attention
    optimizer: Optimizer
    device: str = "cuda"
    warmup: int = Field(default=1, ge=0)
    steps: int = Field(default=2, gt=0)
    deepspeed: dict | None = None         # the candidate's DeepSpeed config (ZeRO candidates)
    world_size: int = Field(default=1, gt=0)

    def cache_fields(self) -> dict:
        """What makes a measurement valid elsewhere: everything but where the model was read from."""
        return self.model_dump(exclude={"config", "model_dir"})


def result_line(result: Measurement) -> str:
    return RESULT_PREFIX + result.model_dump_json() + "\n"


def parse_result(stdout: str) -> Measurement | None:
    """The last result line of a worker's output, validated, or None."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return Measurement.model_validate(json.loads(line[len(RESULT_PREFIX):]))
    return None
