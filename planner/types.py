"""The planner's result types: what `plan()` returns and `plan --json` prints."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from planner.memory.estimate import MemoryEstimate


class Config(BaseModel):
    """One training configuration (a candidate)."""

    model_config = ConfigDict(frozen=True)

    micro_batch: int
    grad_accum: int
    world_size: int
    precision: str
    checkpointing: str
    zero_stage: int
    offload: str

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size

    @property
    def engine(self) -> str:
        return "deepspeed" if self.zero_stage > 0 else "torch"

    def complexity(self) -> int:
        """Moving parts, for tie-breaks: ZeRO, offload, recompute, loss scaling, accumulation."""
        return (self.zero_stage + {"none": 0, "optimizer": 2, "optimizer+params": 4}[self.offload]
                + {"none": 0, "selective": 1, "full": 2}[self.checkpointing]
                + (1 if self.precision == "fp16-mixed" else 0) + (1 if self.grad_accum > 1 else 0))

    def kind(self) -> tuple:
        """The configuration apart from its micro-batch split, with fp16 and bf16 autocast as one: they have the
        same bytes and speed, so views and probes treat them as one kind."""
        precision = "mixed" if self.precision in ("bf16-mixed", "fp16-mixed") else self.precision
        return precision, self.checkpointing, self.zero_stage, self.offload

    def label(self) -> str:
        zero = f"ZeRO-{self.zero_stage}" if self.zero_stage else ("DDP" if self.world_size > 1 else "single GPU")
        off = f" + offload {self.offload}" if self.offload != "none" else ""
        ck = "" if self.checkpointing == "none" else f", {self.checkpointing} ckpt"
        return f"mb {self.micro_batch} x N {self.grad_accum} x {self.world_size} GPU, {self.precision}{ck}, {zero}{off}"


class ThroughputInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    tokens_per_s: float
    samples_per_s: float
    mfu: float
    step_time_s: float
    source: str = "model"   # model | probe
    parts: dict[str, float] = {}


class Candidate(BaseModel):
    model_config = ConfigDict(frozen=True)

    config: Config
    memory: MemoryEstimate | None
    throughput: ThroughputInfo | None
    fits: bool
    reason: str
    learning_rate: float | None = None   # the LR this candidate would train with (None without --lr)
    lr_scaling: str | None = None

    def to_json(self) -> dict:
        data = _config_json(self.config)
        data.update(learning_rate=self.learning_rate, lr_scaling=self.lr_scaling,
                    memory=_memory_json(self.memory) if self.memory else None,
                    throughput=self.throughput.model_dump() if self.throughput else None,
                    fits=self.fits, reason=self.reason)
        return data


class Hardware(BaseModel):
    model_config = ConfigDict(frozen=True)

    gpu: str
    gpu_memory_bytes: int
    gpus_per_node: int
    nodes: int
    detected: bool
    budget_bytes: int      # what a candidate's peak must stay under: card (or free) memory minus headroom
    headroom: float
    host_memory_bytes: int = 0   # per node, for CPU offload: this machine's RAM when planning for it
    note: str = ""


class LearningRate(BaseModel):
    model_config = ConfigDict(frozen=True)

    learning_rate: float | None
    base_lr: float | None
    reference_batch: int
    scaling: str
    factor: float
    warmup_steps: int


class Plan(BaseModel):
    """The chosen configuration, why, and every candidate considered."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    model: dict
    hardware: Hardware
    seq_len: int
    optimizer: str
    attention: str
    choice: Candidate
    candidates: tuple[Candidate, ...]
    lr: LearningRate
    notes: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    probes: tuple[dict, ...] = ()
    calibration: dict[str, dict[str, float]] = {}  # per family: measured/predicted activations, slack

    def to_json(self) -> dict:
        choice = _config_json(self.choice.config)
        choice.update(learning_rate=self.lr.learning_rate, lr_scaling=self.lr.scaling,
                      lr_factor=self.lr.factor, warmup_steps=self.lr.warmup_steps)
        tp = self.choice.throughput
        return {
            "model": self.model,
            "hardware": self.hardware.model_dump(),
            "choice": choice,
            "memory": _memory_json(self.choice.memory),
            "throughput": {"tokens_per_s": tp.tokens_per_s, "samples_per_s": tp.samples_per_s, "mfu": tp.mfu,
                           "step_time_s": tp.step_time_s, "source": tp.source},
            "candidates": [c.to_json() for c in self.candidates],
            "notes": list(self.notes),
            "probes": list(self.probes),
            "calibration": self.calibration,
            "files": list(self.files),
        }

    # Config dicts for other launchers (no files): see planner/export.py
    def to_deepspeed(self) -> dict:
        from planner.export import deepspeed_config
        return deepspeed_config(self)

    def to_accelerate(self, **kwargs) -> dict:
        from planner.export import accelerate_config
        return accelerate_config(self, **kwargs)

    def to_training_args(self, **kwargs) -> dict:
        from planner.export import training_args
        return training_args(self, **kwargs)


def _config_json(c: Config) -> dict:
    return {"micro_batch": c.micro_batch, "grad_accum": c.grad_accum, "world_size": c.world_size,
            "global_batch": c.global_batch, "precision": c.precision, "checkpointing": c.checkpointing,
            "zero_stage": c.zero_stage, "offload": c.offload}


def _memory_json(m: MemoryEstimate) -> dict:
    return {"parameters": m.parameters, "gradients": m.gradients, "optimizer_states": m.optimizer_states,
            "activations": m.activations, "overhead": m.overhead, "peak_allocated": m.peak_allocated,
            "peak": m.peak, "cpu_offload_bytes": m.cpu_offload_bytes, "method": m.method, "terms": m.terms}
