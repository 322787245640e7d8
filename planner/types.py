"""The planner's result types: what `plan()` returns and `plan --json` prints, and what a measurement reports."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from emit.files import EmitOptions
from emit.files import emit as write_files
from planner.config import Config
from planner.errors import InputError
from planner.export import DEEPSPEED_ARG, accelerate_config, deepspeed_config, loss_scaling, peft_config, training_args
from planner.hardware import GPU
from planner.memory.estimate import MemoryEstimate
from planner.notes import Note, Verdict
from planner.prepare import LoadedPlan
from planner.receipts import planner_tree, planner_version
from planner.render import note_text, render_plan, verdict_text
from planner.speed.step import ThroughputInfo
from planner.vocab import MeasurementStatus

__all__ = ["Config", "Candidate", "ThroughputInfo", "Hardware", "LearningRate", "ModelInfo", "Measurement",
           "ProbeRecord", "FamilyCalibration", "SpeedCalibration", "SpeedCorrection", "ErrorBar", "Requirement", "Plan"]


class Candidate(BaseModel):
    model_config = ConfigDict(frozen=True)

    config: Config
    memory: MemoryEstimate | None
    throughput: ThroughputInfo | None
    verdict: Verdict
    learning_rate: float | None = None   # the LR this candidate would train with (None without --lr)
    lr_scaling: str | None = None

    @property
    def fits(self) -> bool:
        return self.verdict.fits

    @property
    def reason(self) -> str:
        """The verdict in words."""
        return verdict_text(self.verdict)

    def to_json(self) -> dict:
        data = _config_json(self.config)
        data.update(_step_json(self.throughput))
        data.update(learning_rate=self.learning_rate, lr_scaling=self.lr_scaling,
                    memory=_memory_json(self.memory) if self.memory else None,
                    throughput=self.throughput.model_dump(mode="json") if self.throughput else None,
                    fits=self.fits, reason=self.reason, verdict=self.verdict.model_dump())
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
    host_memory_source: Literal["given", "this machine", "assumed"] = "assumed"
    host_system: str = ""        # the usual system of the GPU whose host RAM was assumed (planner/hardware/systems.json)
    #: inter-node bandwidth per GPU (Gb/s per direction) the plan's collectives across nodes run at, and whose it is:
    #: "given" (--nic-gbps) or the system efficiency.json has it from (planner/hardware/efficiency_data.py)
    network_Gbps: float = 0.0
    network_source: str = ""
    reference: bool = False      # no GPU detected and none named: planned for the reference GPU
    entry: GPU | None = Field(default=None, exclude=True)   # the catalog entry the plan was made for


class LearningRate(BaseModel):
    model_config = ConfigDict(frozen=True)

    learning_rate: float | None
    base_lr: float | None
    reference_batch: int
    scaling: str
    factor: float
    warmup_steps: int
    run_steps: int | None = None   # optimizer steps of the whole run, when its length was given


class ModelInfo(BaseModel):
    """The model as a plan reports it: a typed view of `ModelSpec` at the planned sequence length."""

    model_config = ConfigDict(frozen=True)

    name: str
    parameters: int
    trainable_parameters: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    seq_len: int
    architecture: str
    source: str
    task: str
    has_batchnorm: bool
    layer_class: str
    num_labels: int = 0
    model_type: str = ""     # the config's model_type (what Liger-Kernel's patches are chosen by)
    #: LoRA / QLoRA settings (planner.models.adapters.Adapter.to_json()); None: every parameter trains
    adapter: dict | None = None

    @classmethod
    def of(cls, spec, seq_len: int, adapter=None) -> "ModelInfo":
        fields = {name: getattr(spec, name) for name in cls.model_fields if name not in ("seq_len", "adapter")}
        return cls(seq_len=seq_len, adapter=adapter.to_json() if adapter is not None else None, **fields)


class Measurement(BaseModel):
    """What measuring one candidate reports (`plan(..., measure=...)`'s callable returns one)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    status: MeasurementStatus
    peak_allocated: int = 0          # bytes, torch.cuda.max_memory_allocated (the live-tensor peak on CPU)
    peak_reserved: int = 0           # bytes, torch.cuda.max_memory_reserved
    process_memory: int = 0          # bytes the driver counts for the process at the end (nvidia-smi; 0: unknown)
    micro_step_s: float = 0.0        # one forward + backward
    optimizer_step_s: float = 0.0    # the optimizer step
    step_time_s: float = 0.0         # grad_accum micro-steps + one optimizer step
    tokens_per_s: float = 0.0        # per process
    processes: int = 1               # ranks the measurement ran with
    grad_accum: int = 0              # micro-steps per optimizer step in the run (0: not said)
    micro_batch: int = 0             # samples per micro-step in the run (0: not said)
    engine: str = ""
    reason: str = ""                 # why skipped, or the error
    losses: tuple[float, ...] = ()   # the training loss of each step (the run's own check that it trained)
    cached: bool = False
    seconds: float = 0.0             # wall time the measurement took
    budget_s: float = 0.0            # the time a timed-out measurement was given


class ProbeRecord(BaseModel):
    """One probe as the plan records it: the candidate, what the model predicted, what was measured."""

    model_config = ConfigDict(frozen=True)

    config: str
    micro_batch: int
    world_size: int = 1               # the candidate's ranks (a probe may run fewer; every rank runs alike)
    predicted_peak_allocated: int | None
    predicted_tokens_per_s: float | None
    measurement: Measurement


class FamilyCalibration(BaseModel):
    """Per probed family: measured / predicted activations, and the allocator's measured slack per activation
    byte (the cautious, larger value over the family's probes)."""

    model_config = ConfigDict(frozen=True)

    activation_ratio: float
    allocator_slack: float
    runs: int = 1     # the probes or receipts it is from
    #: bytes the runs measured outside the caching allocator (NVML's process total less max_memory_reserved: the CUDA
    #: context, NCCL's buffers), the largest; None where they did not measure it (probes)
    outside: int | None = None


class SpeedCalibration(BaseModel):
    """Measured / modelled time of the micro-step and of the optimizer step, over the successful probes of one
    precision family (`Config.precision_family`) on this GPU (their median); unprobed candidates of that family are
    re-timed with them, those of another keep the model's times: a ratio is the GPU's rate for that precision's
    kernels, and carried across precisions it did worse than no calibration (benchmarks/probe_calibration.py)."""

    model_config = ConfigDict(frozen=True)

    micro_step: float
    optimizer_step: float
    probes: int     # the runs it is the median of
    precision: str  # the precision family it re-times
    source: Literal["probes", "receipts"] = "probes"   # this plan's probes, or receipts of earlier runs on the GPU
    low: float | None = None    # receipts: the least and the most measured / predicted step time among the runs
    high: float | None = None


class SpeedCorrection(BaseModel):
    """What every modelled step time of a plan was multiplied by: the median measured / predicted step time (`factor`)
    of the `n` runs like its fastest fitting candidate (the stratum `stratum`, reached by pooling `pooled`), so that
    the figures it shows are what runs like it measured, on one basis for every candidate."""

    model_config = ConfigDict(frozen=True)

    factor: float
    stratum: str
    pooled: tuple[str, ...] = ()
    n: int = 0


class ErrorBar(BaseModel):
    """How far predictions like this one have been from measurements (planner/uncertainty.py): measured / predicted
    (`unit`) over `n` runs (`first_look` of them first-look) of the stratum `stratum`, reached by pooling the
    dimensions in `pooled`; its 10th, 50th and 90th percentiles, and the range of multipliers of a prediction (`low`,
    `high`) that `covers` of such runs fell within. "not measured": no run is like the plan."""

    model_config = ConfigDict(frozen=True)

    status: Literal["measured", "not measured"]
    stratum: str
    pooled: tuple[str, ...] = ()
    n: int = 0
    first_look: int = 0
    p10: float | None = None
    median: float | None = None
    p90: float | None = None
    low: float | None = None
    high: float | None = None
    covers: float | None = None
    source: str = ""
    unit: str = ""

    @classmethod
    def of(cls, bar) -> "ErrorBar":
        """The plan's record of a planner.uncertainty.Bar."""
        unit = ERROR_UNITS.get(bar.kind, "measured / predicted")
        if not bar.measured:
            return cls(status="not measured", stratum=bar.stratum.key, unit=unit)
        s, (low, high) = bar.spread, bar.range
        return cls(status="measured", stratum=bar.stratum.key, pooled=bar.pooled, n=s.n, first_look=s.first_look,
                   p10=s.p10, median=s.median, p90=s.p90, low=low, high=high, covers=bar.covers, source=bar.source,
                   unit=unit)

    @property
    def measured(self) -> bool:
        return self.status == "measured"

    def bounds(self, value: float, rate: bool = False) -> tuple[float, float]:
        """The measured values a prediction `value` stands for: `value` times the range; for a rate (tokens/s) of a
        quantity the rows measured as a time, divided by it."""
        return (value / self.high, value / self.low) if rate else (value * self.low, value * self.high)


#: What an error bar's ratios are of.
ERROR_UNITS = {"memory": "measured / predicted peak memory, one figure per run (the process's device memory, else the "
                         "allocator's reserved, else its allocated peak)",
               "throughput": "measured / predicted step time, one per run"}


class DatasetSummary(BaseModel):
    """The user's dataset as the plan saw it: samples and tokens (estimated from a sample where `sampled` < samples),
    length percentiles before truncation, the samples cut at `max_length`, the row length memory was planned at, and
    each batching strategy's share of padding at the chosen micro-batch."""

    model_config = ConfigDict(frozen=True)

    samples: int
    tokens: int
    p50: int
    p90: int
    p99: int
    max: int
    truncated: int
    sampled: int
    max_length: int
    row_length: int
    padding_waste: dict[str, float] = {}
    steps_per_epoch: int = 0   # optimizer steps of the chosen configuration in one pass over the samples
    source: str | None = None      # --dataset as given, and the column and tokenizer its lengths were read with
    text_field: str | None = None
    tokenizer: str | None = None


class Requirement(BaseModel):
    """A package the chosen configuration needs beyond the base install, and whether it imports here."""

    model_config = ConfigDict(frozen=True)

    package: str
    installed: bool
    install: str


class ReceiptCheck(BaseModel):
    """One quantity an earlier run on this plan's GPU measured (planner/receipts.py): what its plan predicted then,
    what the planner predicts today for the same configuration, and the measurement."""

    model_config = ConfigDict(frozen=True)

    run: int            # which receipt, counted from 1
    label: str          # the configuration it ran
    quantity: str       # a receipts.QUANTITIES name
    predicted_then: float | None
    predicted: float
    measured: float


class Plan(BaseModel):
    """The chosen configuration, why, and every candidate considered."""

    model_config = ConfigDict(frozen=True)

    model: ModelInfo
    hardware: Hardware
    seq_len: int
    optimizer: str
    attention: str
    choice: Candidate
    candidates: tuple[Candidate, ...]
    lr: LearningRate
    notes: tuple[Note, ...] = ()
    requirements: tuple[Requirement, ...] = ()
    dataset: DatasetSummary | None = None      # with --dataset
    memory_error: ErrorBar | None = None       # the peak's error on rows like this plan (None: none measured)
    throughput_error: ErrorBar | None = None   # the speed's
    files: tuple[str, ...] = ()
    probes: tuple[ProbeRecord, ...] = ()
    calibration: dict[str, FamilyCalibration] = {}
    speed_calibration: SpeedCalibration | None = None  # the choice's precision family's (None: not probed)
    speed_calibrations: tuple[SpeedCalibration, ...] = ()  # every probed precision family's
    receipt_checks: tuple[ReceiptCheck, ...] = ()  # earlier runs of this model on this GPU against today's model
    speed_correction: SpeedCorrection | None = None   # what every modelled step time was multiplied by
    #: `planner.plan`'s keyword arguments besides a configuration's own that predict as this plan did (None: a model
    #: object, a local folder or a dataset, which a receipt cannot name): receipts keep it, pinned to what ran
    request: dict | None = None

    def explain(self, width: int = 100) -> str:
        """The plan as `plan` prints it (the choice, why the alternatives lost, the notes), as plain text."""
        import io

        from rich.console import Console

        out = io.StringIO()
        render_plan(self, Console(file=out, width=width, highlight=False, color_system=None, force_terminal=False),
                    explain=True)
        return out.getvalue()

    def to_json(self) -> dict:
        choice = _config_json(self.choice.config)
        choice.update(_step_json(self.choice.throughput))
        choice.update(learning_rate=self.lr.learning_rate, lr_scaling=self.lr.scaling,
                      lr_factor=self.lr.factor, warmup_steps=self.lr.warmup_steps,
                      max_length=self.dataset.row_length if self.dataset else None)
        tp = self.choice.throughput
        return {
            "planner": {"version": planner_version(), "tree": planner_tree()},
            "request": self.pinned_request(),
            "fits": self.choice.fits,  # false: nothing fits, and `choice` is the closest configuration
            "model": self.model.model_dump(),
            "optimizer": self.optimizer,
            "attention": self.attention,
            "hardware": self.hardware.model_dump(),
            "choice": choice,
            "memory": {**_memory_json(self.choice.memory), "error": _error_json(self.memory_error)},
            "throughput": {"tokens_per_s": tp.tokens_per_s, "samples_per_s": tp.samples_per_s, "mfu": tp.mfu,
                           "hfu": tp.hfu,
                           "step_time_s": tp.step_time_s, "source": tp.source,
                           "step_time_fast_host_s": tp.step_time_fast_host_s,
                           "step_time_slow_host_s": tp.step_time_slow_host_s,
                           "real_tokens_per_s": tp.real_tokens_per_s,
                           "parts": {**tp.parts.model_dump(), "bound": tp.parts.bound()},
                           "model": _model_speed_json(tp),
                           "error": self._speed_error_json()},
            "dataset": self.dataset.model_dump() if self.dataset else None,
            "candidates": [c.to_json() for c in self.candidates],
            "notes": [note_text(n) for n in self.notes],
            "advice": [n.model_dump() for n in self.notes],
            "requirements": [r.model_dump() for r in self.requirements],
            "loss_scaling": self.loss_scaling(),
            "probes": [p.model_dump(mode="json") for p in self.probes],
            "calibration": {k: v.model_dump() for k, v in self.calibration.items()},
            "speed_calibration": self.speed_calibration.model_dump() if self.speed_calibration else None,
            "speed_calibrations": [c.model_dump() for c in self.speed_calibrations],
            "receipt_checks": [c.model_dump() for c in self.receipt_checks],
            "files": list(self.files),
        }

    def pinned_request(self) -> dict | None:
        """`planner.plan`'s keyword arguments that plan the chosen configuration again, pinned, for the GPU it was
        planned for (None where the model cannot be named again: `request`)."""
        if self.request is None:
            return None
        hardware = self.hardware
        return {**self.request, "gpu": hardware.gpu, "gpus_per_node": hardware.gpus_per_node,
                "nodes": hardware.nodes, **self.choice.config.request_fields()}

    def _speed_error_json(self) -> dict | None:
        """The speed's error bar, with what it was applied to: the correction every modelled step time took."""
        tp = self.choice.throughput
        if tp.source not in ("model", "corrected") or self.throughput_error is None:
            return None
        corrected = self.speed_correction if tp.source == "corrected" else None
        return {**_error_json(self.throughput_error), "correction": corrected.factor if corrected else None,
                "applied_to": ("every candidate's modelled step time, times the median of the runs like the chosen "
                               f"one ({corrected.stratum})") if corrected else None}

    # --- the plan applied in the user's own training script, without files (as load_plan(folder) does with them)
    def prepare(self, model):
        """`model` as the plan trains it: what Trainer arguments cannot say (selective checkpointing's policy, the
        parameter dtype, LoRA / QLoRA adapters, the attention implementation); see planner/prepare.py."""
        return self._loaded().prepare(model)

    def training_arguments(self, **overrides):
        """A transformers.TrainingArguments for the plan (`overrides` applied), the DeepSpeed config given as a dict."""
        return self._loaded().training_arguments(**overrides)

    def from_pretrained_kwargs(self) -> dict:
        """What `from_pretrained` needs for the plan: the BitsAndBytesConfig for QLoRA, tp_plan for TP."""
        return self._loaded().from_pretrained_kwargs()

    def sft_config(self, **overrides):
        """TRL's SFTConfig for the plan (`LoadedPlan.sft_config`): with a dataset, its max_length and batching."""
        return self._loaded().sft_config(**overrides)

    def callback(self, folder=None, **options):
        """A TrainerCallback writing the run's receipt.json into `folder` (default: the Trainer's output_dir);
        `options`: warmup, cache (docs/receipts.md)."""
        return self._loaded().callback(folder, **options)

    def receipt(self, folder=None, **options):
        """`with plan.receipt(folder) as meter:` for a loop without the Trainer: `meter.step()` per optimizer step."""
        return self._loaded().receipt(folder, **options)

    def report(self, path, **options) -> str:
        """Write the plan as one self-contained HTML page of charts (docs/report.md; needs the report extra).
        `options`: comparison, receipts, force. Returns the path written."""
        from emit.report import write_report  # lazy: matplotlib loads only when a page is asked for

        return write_report(self, path, **options)

    def emit(self, folder, **options) -> list[str]:
        """Write the plan's files into `folder` (what `plan --emit` writes); `options` are emit.EmitOptions' fields
        (force, main_process_ip, launcher, image, volume, ...). Returns the paths written; a folder holding them
        already raises InputError unless force=True."""
        try:
            return write_files(self, folder, EmitOptions(**options))
        except InputError as err:
            if err.flag != "--emit":
                raise
            raise InputError(err.message, flag=err.flag, keyword="folder",
                             hint="Pass force=True to overwrite them, or choose another folder.") from None

    def _loaded(self) -> LoadedPlan:
        args = training_args(self)
        if DEEPSPEED_ARG in args:
            args[DEEPSPEED_ARG] = deepspeed_config(self)
        return LoadedPlan(self.to_json(), None, args)

    # Config dicts for other launchers (no files): see planner/export.py
    def to_deepspeed(self) -> dict:
        return deepspeed_config(self)

    def to_accelerate(self, **kwargs) -> dict:
        return accelerate_config(self, **kwargs)

    def to_training_args(self, **kwargs) -> dict:
        return training_args(self, **kwargs)

    def loss_scaling(self) -> dict | None:
        return loss_scaling(self)

    def to_peft(self) -> dict | None:
        return peft_config(self)


def _model_speed_json(tp: ThroughputInfo) -> dict:
    """The speed model's own figures for a step whose shown figures were corrected or measured."""
    ratio = tp.step_time_s / tp.modelled_step_time_s if tp.modelled_step_time_s > 0 else 1.0
    return {"step_time_s": tp.modelled_step_time_s, "tokens_per_s": tp.tokens_per_s * ratio, "mfu": tp.mfu * ratio}


def _error_json(error: ErrorBar | None) -> dict | None:
    return None if error is None else {**error.model_dump(), "pooled": list(error.pooled)}


def _step_json(tp: ThroughputInfo | None) -> dict:
    """What one optimizer step trains (rates x step time: a packed row holds several samples)."""
    if tp is None:
        return {"samples_per_step": None, "tokens_per_step": None}
    return {"samples_per_step": tp.samples_per_s * tp.step_time_s, "tokens_per_step": tp.tokens_per_s * tp.step_time_s}


def _config_json(c: Config) -> dict:
    return {"micro_batch": c.micro_batch, "grad_accum": c.grad_accum, "world_size": c.world_size,
            "global_batch": c.global_batch, "precision": c.precision, "checkpointing": c.checkpointing,
            "zero_stage": c.zero_stage, "offload": c.offload, "engine": c.engine,
            "tensor_parallel": c.tensor_parallel, "context_parallel": c.context_parallel,
            "sequence_parallel": c.sequence_parallel, "data_parallel": c.data_parallel, "compiled": c.compiled,
            "liger": c.liger, "padding": c.padding}


def _memory_json(m: MemoryEstimate) -> dict:
    return {"parameters": m.parameters, "gradients": m.gradients, "optimizer_states": m.optimizer_states,
            "activations": m.activations, "overhead": m.overhead, "peak_allocated": m.peak_allocated,
            "peak_reserved": m.peak_reserved, "peak": m.peak, "cpu_offload_bytes": m.cpu_offload_bytes,
            "method": m.method, "device": m.device, "terms": m.terms.model_dump(),
            "margin": {"bytes": m.margin, "basis": m.margin_basis, "rows": m.margin_rows},
            "model": m.modelled().model_dump()}
