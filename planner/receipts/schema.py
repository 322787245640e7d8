"""receipt.json, schema 2: one run as every measurement trainplan holds or takes is kept (docs/receipts.md).

A receipt names the configuration that ran (Liger, padding, adapter, precision, splits, world and GPUs per node), the
device that really ran it, the stack, the prediction made for it before the run by the planner (the model's own
figures and the figures the plan printed, with the planner's source tree that made them) and what the run
measured. Runs of the Trainer callback, the shipped scripts, the probes, the GPU validation and published runs
converted from benchmarks/data are all receipts; the accuracy report, the error bars, the memory margin and the next
plan's calibration read nothing else. Schema-1 receipts (no model figures, no device check) are read too.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from planner.config import Config
from planner.vocab import NO_ADAPTER, OK, TRAINER, AdapterMethod, Program

SCHEMA = 2
#: Schemas read: 1 (before the run's configuration, device and the model's own figures were recorded) and 2.
READS = (1, 2)
#: A receipt whose measured over predicted figure falls outside this range is refused as corrupt: no model error
#: seen on any row of benchmarks/results comes near it.
RATIO_RANGE = (0.1, 10.0)
#: The memory figures, the one a plan's budget is checked against first (what nvidia-smi shows), then the allocator's.
MEMORY_FIGURES = ("peak_process", "peak_reserved", "peak_allocated")
STEP_TIME = "step_time_s"

#: A measured or predicted quantity: a finite number above zero (a string, NaN, infinity, zero or a negative refuses
#: the receipt).
Amount = Annotated[float, Field(gt=0, allow_inf_nan=False, strict=True)]


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)


class Figures(_Strict):
    """What a run measured, or what was predicted for it: bytes per GPU, seconds per optimizer step, tokens per second
    of the whole run; None where not known."""

    peak_allocated: Amount | None = None   # torch.cuda.max_memory_allocated
    peak_reserved: Amount | None = None    # torch.cuda.max_memory_reserved
    peak_process: Amount | None = None     # the process's device memory (nvidia-smi)
    peak: Amount | None = None             # predicted only: what must fit (peak_process and the plan's margin)
    activations: Amount | None = None      # predicted only: the activations the peak holds (what the margin scales)
    host_peak: Amount | None = None        # the process's resident memory (the host side of offload)
    step_time_s: Amount | None = None
    tokens_per_s: Amount | None = None
    real_tokens_per_s: Amount | None = None

    def get(self, quantity: str) -> float | None:
        return getattr(self, quantity)


class Hardware(_Strict):
    """What the plan was made for."""

    gpu: str
    gpus_per_node: int = Field(1, gt=0)
    nodes: int = Field(1, gt=0)
    gpu_memory_bytes: Amount | None = None
    budget_bytes: Amount | None = None


class RunPlan(_Strict):
    """The configuration that ran, as the planner names it. `request`: the keyword arguments of `planner.plan` that
    plan this very configuration again (pinned), where known, so that today's planner can predict it anew."""

    model: str
    seq_len: int = Field(gt=0)
    adapter: AdapterMethod = NO_ADAPTER
    task: str | None = None
    choice: Config
    hardware: Hardware
    optimizer: str | None = None
    attention: str | None = None
    program: Program = TRAINER
    request: dict[str, Any] | None = None

    @field_validator("choice", mode="before")
    @classmethod
    def _choice(cls, value: Any) -> Any:
        """The configuration's fields strictly typed as well (a micro-batch of "2" refuses the receipt)."""
        return Config.model_validate_json(json.dumps(value), strict=True) if isinstance(value, dict) else value

    @property
    def label(self) -> str:
        return self.choice.label()


class Device(_Strict):
    """The device that ran the steps: its kind and name as torch reports it, the catalog's GPU of that name (None: no
    catalog GPU, or a receipt that does not say), how many, and the host's processor."""

    kind: Literal["cuda", "cpu"]
    name: str | None = None
    gpu: str | None = None
    count: int | None = Field(None, ge=0)
    host: str | None = None


class Prediction(_Strict):
    """The prediction made for the run before it ran: the model's own figures (`model`) and what the plan printed
    (`printed`: the model corrected by error bars or earlier receipts; the model's where nothing corrected it), and
    the planner that made it: `tree`, the git tree hash of its planner/ folder, which names the commit it was made at
    (planner/receipts/source.py), and the facts it read, in all and for each kind of figure."""

    model: Figures = Figures()
    printed: Figures = Figures()
    tree: str | None = None
    version: str | None = None
    facts: tuple[str, ...] = ()
    #: the facts each figure's prediction read, by kind ("memory", "throughput"), where a benchmark recorded them
    figure_facts: dict[str, tuple[str, ...]] = {}


class Receipt(_Strict):
    """One measured run (schema 2)."""

    model_config = ConfigDict(frozen=True, extra="ignore", strict=True, populate_by_name=True)

    schema_: Literal[2] = Field(SCHEMA, alias="schema")
    id: str = Field(min_length=1)
    created: str = ""
    #: where the measurement comes from: "this run" for a run's own receipt, else the published source it cites
    source: str = "this run"
    #: the repository file its measurement was first written to (a benchmarks/data table, an earlier results file);
    #: "" where the receipt itself is that record
    data_file: str = ""
    #: how the prediction is made again: "plan" (`planner.plan` with `plan.request`), else the benchmarks module that
    #: predicts the program a published run ran, which no plan runs (its own loop, objective or optimizer kernel)
    predictor: str = "plan"
    plan: RunPlan
    device: Device
    versions: dict[str, str | None] = {}
    predicted: Prediction
    measured: Figures
    error_bars: dict[str, Any] | None = None
    steps: int = Field(0, ge=0)
    warmup: int = Field(0, ge=0)
    status: str = OK
    checks: tuple[str, ...] = ()
    note: str = ""

    def to_json(self) -> dict:
        return self.model_dump(mode="json", by_alias=True)

    def memory_figure(self, predicted: Figures | None = None) -> str | None:
        """The run's one memory figure: the first of MEMORY_FIGURES it measured that `predicted` (default: the model's
        own prediction) holds."""
        against = self.predicted.model if predicted is None else predicted
        return next((q for q in MEMORY_FIGURES if self.measured.get(q) and against.get(q)), None)

    def ratio(self, quantity: str, predicted: Figures | None = None) -> float | None:
        """Measured over predicted `quantity` (against the model's own figures unless `predicted` is given), None
        where either is unknown."""
        against = self.predicted.model if predicted is None else predicted
        measured, expected = self.measured.get(quantity), against.get(quantity)
        return measured / expected if measured and expected else None

    def problem(self) -> str | None:
        """Why the receipt cannot be believed, or None: a run that did not end well, or a GPU run with a figure whose
        measured over predicted ratio lies outside RATIO_RANGE (a CPU trial of a GPU plan measures another device)."""
        if self.status != OK:
            return f"the run ended {self.status}"
        if self.device.kind != "cuda":
            return None
        low, high = RATIO_RANGE
        for quantity in (*MEMORY_FIGURES, STEP_TIME):
            for figures in (self.predicted.model, self.predicted.printed):
                ratio = self.ratio(quantity, figures)
                if ratio is not None and not low <= ratio <= high:
                    return f"its measured {quantity} is {ratio:.3g}x the prediction (believed within {low:g}-{high:g}x)"
        return None


def parse(data: Any, *, believed: bool = True) -> Receipt:
    """A receipt from its JSON (schema 2, or schema 1 upgraded); ValueError naming what is wrong. With `believed`, a
    receipt whose figures are off their prediction by more than RATIO_RANGE, or whose run failed, is wrong too (what
    a plan reads from others; a benchmark's own run is kept whatever it measured)."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    schema = data.get("schema")
    if isinstance(schema, bool) or schema not in READS:
        raise ValueError(f"not a receipt (schema {schema!r}; this trainplan reads {', '.join(map(str, READS))})")
    try:  # JSON mode: strict about types, as JSON has them (an array is a tuple's, a string never a number)
        receipt = Receipt.model_validate_json(json.dumps(data if schema == SCHEMA else _upgraded(data)))
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ValueError(f"{where}: {first['msg']}") from None
    problem = receipt.problem() if believed else None
    if problem:
        raise ValueError(problem)
    return receipt


def _upgraded(data: dict) -> dict:
    """A schema-1 receipt in schema 2's shape: what it predicted was what its plan printed (the model's own figures
    were not recorded), its device unnamed unless it says."""
    plan = data.get("plan") if isinstance(data.get("plan"), dict) else {}
    created = data.get("created") if isinstance(data.get("created"), str) else ""
    return {**data, "schema": SCHEMA, "id": f"schema-1 receipt {created}".strip(), "created": created,
            "plan": {key: plan.get(key) for key in ("model", "seq_len", "adapter", "choice", "hardware")
                     if plan.get(key) is not None},
            "predicted": {"printed": data.get("predicted")}}


__all__ = ["Amount", "Device", "Figures", "Hardware", "MEMORY_FIGURES", "Prediction", "RATIO_RANGE", "READS",
           "Receipt", "RunPlan", "SCHEMA", "STEP_TIME", "parse"]
