"""What the planner tells the user, as typed records: a kind and its numbers. The sentences are written by
planner/render.py; the JSON carries both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict

from planner.vocab import ADAMW_8BIT

Value = int | float | str | bool | None


class _Record(BaseModel):
    """A kind and the numbers (and names) its sentence is made of; subclasses type `kind` by their table."""

    model_config = ConfigDict(frozen=True)

    kind: str
    values: dict[str, Value] = {}

    def __getitem__(self, name: str) -> Value:
        return self.values[name]


@dataclass(frozen=True)
class NoteInfo:
    doc: str
    actionable: bool   # it changes what the user should do: the default view shows it; `--explain` shows all


#: Every kind of note a plan carries.
NOTE: dict[str, NoteInfo] = {
    "reference-gpu": NoteInfo("no GPU detected and none given: planned for the reference GPU", True),
    "no-bf16": NoteInfo("the GPU has no bf16: mixed precision is fp16 with loss scaling", False),
    "tf32-gain": NoteInfo("fp32 was asked for on a GPU with TF32: what --precision tf32 would gain", True),
    "no-tp-plan": NoteInfo("the model has no tensor-parallel plan in this transformers", False),
    "no-tp-size": NoteInfo("no tensor-parallel size divides the model's key/value heads", False),
    "tensor-parallel": NoteInfo("the plan uses tensor parallelism: how to load the model for it", True),
    "sequence-split": NoteInfo("the plan splits each sequence across GPUs: why, and what the run must keep", True),
    "no-pipeline": NoteInfo("pipeline parallelism is not planned", False),
    "preset-variant": NoteInfo("a fine-tuned variant's name, planned with its base preset's architecture", True),
    "simpler": NoteInfo("a configuration with more moving parts was predicted faster, by less than the model can tell",
                        True),
    "host-assumed": NoteInfo("offload was checked against assumed host RAM", True),
    "host-measured": NoteInfo("the host's eager PyTorch costs were measured on this machine, with its GPU", True),
    "host-range": NoteInfo("the host's eager PyTorch costs are the usual system's: the step time on known hosts", False),
    "moe-zero3": NoteInfo("a mixture of experts under ZeRO-3: prepare marks its expert blocks as leaves", True),
    "lora-fused-parameters": NoteInfo("peft adapts fused expert weights as parameters, without dropout", True),
    "qlora-16bit-experts": NoteInfo("QLoRA: bitsandbytes leaves fused expert weights 16-bit", True),
    "liger": NoteInfo("the plan runs Liger-Kernel's patches: which, and what is traced as the model's own", True),
    "liger-available": NoteInfo("Liger-Kernel patches the model but is not installed here: not weighed", False),
    "fp8-chosen": NoteInfo("float8 against the best bf16-mixed plan (or the chosen one in bf16-mixed where none was "
                           "weighed): layers converted, step time, peak", True),
    "fp8-lost": NoteInfo("fp8 was weighed and lost: its fastest configuration, and compiled where it ran eager", True),
    "fp8-available": NoteInfo("the GPU trains in FP8 but torchao is not installed here: fp8 not weighed", False),
    "fp8-not-planned": NoteInfo("the GPU trains in FP8, but not with this configuration (engine, adapters, TP)", False),
    "qlora-ddp-only": NoteInfo("QLoRA is planned on one GPU or DDP only", False),
    "qlora-prepare": NoteInfo("QLoRA: load with bnb_config() and prepare(), not prepare_model_for_kbit_training", True),
    "compile-not-weighed": NoteInfo("torch.compile was not weighed: the run's length is unknown", False),
    "compile-not-captured": NoteInfo("the model's graph could not be captured: compiled is timed as eager", False),
    "compile": NoteInfo("torch.compile against eager on the chosen configuration", False),
    "compiled": NoteInfo("the plan compiles: its gain, compile time and shapes to keep fixed", True),
    "loss-normalised": NoteInfo("the Trainer normalises the loss by the step's tokens", False),
    "loss-averaged": NoteInfo("the model takes no num_items_in_batch: the loss is averaged per micro-batch", True),
    "fp16-loss-scaling": NoteInfo("fp16's dynamic loss scaling policy", False),
    "optimizer-not-implemented": NoteInfo("no library here implements the optimizer: planned, not emitted", True),
    "optimizer-client": NoteInfo("the Trainer has no name for the optimizer: the script builds it", True),
    "qlora-not-probed": NoteInfo("QLoRA plans are not probed", False),
    "receipts": NoteInfo("speeds calibrated on receipts of earlier runs on this GPU", True),
    "receipts-memory": NoteInfo("memory of the chosen family calibrated on receipts of earlier runs on this GPU", True),
    "receipts-choice": NoteInfo("receipts of earlier runs changed the chosen configuration", True),
    "receipts-unnamed": NoteInfo("receipts that name no device were taken as run on the GPU they were planned for",
                                 True),
    "receipts-unused": NoteInfo("receipts that taught this plan nothing: other runs on this GPU, other devices, "
                                "unreadable files", True),
    "probes": NoteInfo("what the probes measured and how the rest was re-timed", False),
    "missing-package": NoteInfo("the plan needs a package that does not import here", True),
    "dataset-truncated": NoteInfo("samples longer than --max-length are cut", True),
    "padding": NoteInfo("how the chosen batching strategy is run", True),
    "packing-unavailable": NoteInfo("packed and padding-free rows would attend across samples here", False),
    "no-lr": NoteInfo("no --lr: the Trainer's default learning rate, no warmup", False),
    "lr-warmup": NoteInfo("the LR was scaled up: warm up", True),
    "batchnorm": NoteInfo("BatchNorm statistics see only the micro-batch", True),
}
NoteKind = Literal[tuple(NOTE)]  # type: ignore[valid-type]


class Note(_Record):
    """One note: its kind and the numbers (and names) its sentence is made of."""

    kind: NoteKind
    #: where the sentence offers flags: the request's fields that, changed so, plan what it says (re-planned by
    #: tests/test_hints_replan.py); {} for a statement
    changes: dict[str, Value] = {}

    @property
    def actionable(self) -> bool:
        return NOTE[self.kind].actionable


def note(kind: str, changes: dict[str, Value] | None = None, **values: Value) -> Note:
    return Note(kind=kind, values=values, changes=changes or {})


#: Why a candidate fits or not.
VERDICT: dict[str, str] = {
    "fits": "its peak is within the budget",
    "over": "its peak is over the budget (how sure: the estimate's method)",
    "states-over": "its model states alone are over the budget",
    "host-over": "its offload needs more host RAM than a node has",
    "hardware": "the GPU cannot run its precision or kernel",
    "probe-oom": "a probe ran out of memory",
    "invalid": "an internal error: its numbers break physics (`violations` says which rule and by how much)",
}
VerdictKind = Literal[tuple(VERDICT)]  # type: ignore[valid-type]

#: The physics every candidate's numbers obey (planner/invariants.py checks them before ranking).
INVARIANT: dict[str, str] = {
    "negative": "a memory part or term below zero",
    "below-states": "a peak below the model states it holds",
    "peak-order": "peaks out of order: allocated <= reserved <= process <= what must fit",
    "flops": "the step's executed FLOPs at the predicted speed above the GPU's dense peak",
    "step-tokens": "tokens/s x step time is not the tokens of a step",
    "step-samples": "samples/s x step time is not the samples of a step",
    "micro-batch": "memory falls as the micro-batch grows",
    "checkpointing": "less recomputation keeps less activation memory (none against full, full against selective)",
}
InvariantKind = Literal[tuple(INVARIANT)]  # type: ignore[valid-type]


class Violation(_Record):
    """One broken invariant: its kind and the numbers that break it."""

    kind: InvariantKind


def violation(kind: str, **values: Value) -> Violation:
    return Violation(kind=kind, values=values)


class Verdict(BaseModel):
    """A candidate's verdict: its kind, the peak against the budget and how that peak was had (`vocab.ESTIMATE`), or
    the bytes needed against what there is, or the problem in words."""

    model_config = ConfigDict(frozen=True)

    kind: VerdictKind
    peak: int = 0
    budget: int = 0
    method: str = ""
    problem: str = ""
    violations: tuple[Violation, ...] = ()

    @property
    def fits(self) -> bool:
        return self.kind == "fits"

    @classmethod
    def of_peak(cls, peak: int, budget: int, method: str) -> Verdict:
        """Fits or not: a peak against the budget, and how the peak was had (render.py says how sure that is)."""
        return cls(kind="fits" if peak <= budget else "over", peak=peak, budget=budget, method=method)


#: What would fit when nothing does.
LEVER: dict[str, str] = {
    "pinned": "the smallest configuration fits: the pinned choices rule it out",
    "smallest": "what the smallest configuration needs",
    "split": "each sequence split across more of these GPUs (or split at all) fits",
    "more-gpus": "more GPUs with ZeRO-3",
    "larger-gpu": "a larger GPU",
    "offload-short": "full offload is still over the budget",
    "offload-host": "full offload fits the GPU but not the host",
    "offload": "full offload fits",
    ADAMW_8BIT: "8-bit AdamW fits",
    "adapters": "LoRA or QLoRA instead of full fine-tuning",
    "adapters-short": "adapters do not fit either",
    "shorter-sequence": "a shorter sequence fits",
    "offload-shorter-sequence": "full offload and a shorter sequence fit",
}
LeverKind = Literal[tuple(LEVER)]  # type: ignore[valid-type]


class Lever(_Record):
    """One suggestion of what would fit: its kind and numbers."""

    kind: LeverKind
    #: the request's fields that, changed so, make the plan fit (re-planned by the tests); {} for a statement
    changes: dict[str, Value] = {}


def lever(kind: str, changes: dict[str, Value] | None = None, **values: Value) -> Lever:
    return Lever(kind=kind, values=values, changes=changes or {})
