"""The runs every accuracy benchmark holds, as receipts (planner/receipts, schema 2), in the files the report reads:
benchmarks/results/receipts/<benchmark>.json.

A benchmark turns each measured run (a lent GPU's step, a published table's row, a team's receipt) into a receipt:
the configuration that ran, the device, the measurement with its source, and the prediction of that very
configuration made by `planner.plan` pinned to it (`plan_prediction`: the plan's own path, Liger and all, never a
second estimator), with the facts it read and the planner tree that made it. A receipt's prediction is kept as first
made while it is first-look (benchmarks/provenance.py), so a run scored before anyone saw it keeps that score; other
receipts are predicted again each time their benchmark runs, and every receipt is predicted again with today's
planner by `python -m benchmarks.report` (benchmarks/rescore.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from planner import facts
from planner.receipts import Device, Figures, Prediction, Receipt, planner_tree, planner_version

ROOT = Path(__file__).resolve().parents[1]
RECEIPTS = ROOT / "benchmarks" / "results" / "receipts"
FORMAT = "trainplan-receipts-1"


@dataclass(frozen=True)
class Benchmark:
    """A receipts file: the benchmark's name, what its measurements are, the stack they ran on, what it cannot show,
    the command that writes it, and its receipts."""

    name: str
    metric: str
    stack: str
    cannot_show: str
    command: str
    receipts: tuple[Receipt, ...]

    @property
    def path(self) -> str:
        """The file's path in the repository."""
        return f"benchmarks/results/receipts/{self.name}.json"


def load(folder: Path = RECEIPTS) -> list[Benchmark]:
    """Every receipts file, by name."""
    out = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            continue
        out.append(Benchmark(name=data["benchmark"], metric=data["metric"], stack=data["stack"],
                             cannot_show=data["cannot_show"], command=data["command"],
                             receipts=tuple(Receipt.model_validate(r, strict=False) for r in data["receipts"])))
    return out


def write(bench: Benchmark, folder: Path = RECEIPTS) -> Path:
    """The receipts file, sorted by id; a receipt already there whose prediction is first-look keeps that
    prediction (`benchmarks.provenance.label`), a new or development one takes the prediction just made."""
    from benchmarks.provenance import History, label  # lazy: git, only when writing

    path = folder / f"{bench.name}.json"
    kept = {}
    if path.exists():
        history = History()
        for receipt in load_file(path):
            if label(receipt, bench.path, history).first_look:
                kept[receipt.id] = receipt.predicted
    receipts = sorted((r.model_copy(update={"predicted": kept[r.id]}) if r.id in kept else r for r in bench.receipts),
                      key=lambda r: r.id)
    ids = [r.id for r in receipts]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{bench.name}: receipt ids repeat")
    data = {"format": FORMAT, "benchmark": bench.name, "metric": bench.metric, "stack": bench.stack,
            "cannot_show": bench.cannot_show, "command": bench.command,
            "receipts": [r.to_json() for r in receipts]}
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def load_file(path: Path) -> list[Receipt]:
    return [Receipt.model_validate(r, strict=False) for r in json.loads(path.read_text())["receipts"]]


# --- predictions through the plan ---------------------------------------------------------------------------------
def candidate_figures(cand) -> tuple[Figures, Figures]:
    """A plan candidate's figures: the model's own (memory before any correction, the modelled step) and those the
    plan shows (its corrected or measured figures, the peak with its margin)."""
    mem, tp = cand.memory, cand.throughput
    model, printed = {}, {}
    if mem is not None:
        own = mem.modelled()
        model.update(peak_allocated=own.peak_allocated, peak_reserved=own.peak_reserved,
                     peak_process=own.peak_process, activations=own.activations or None)
        printed.update(peak_allocated=mem.peak_allocated, peak_reserved=mem.peak_reserved,
                       peak_process=mem.peak_process, peak=mem.peak, activations=mem.activations or None)
    if tp is not None:
        ratio = tp.step_time_s / tp.modelled_step_time_s
        model.update(step_time_s=tp.modelled_step_time_s, tokens_per_s=tp.tokens_per_s * ratio)
        printed.update(step_time_s=tp.step_time_s, tokens_per_s=tp.tokens_per_s,
                       real_tokens_per_s=tp.real_tokens_per_s)
    positive = lambda figures: {k: v for k, v in figures.items() if v}  # noqa: E731 - zero is "not predicted"
    return (Figures.model_validate(positive(model), strict=False),
            Figures.model_validate(positive(printed), strict=False))


def pinned(request: dict):
    """The plan `planner.plan(**request)` makes of the configuration the request pins (where it says it does not fit,
    the plan its no-fit answer carries, whose choice is that configuration with its estimate), offline, without the
    cache's receipts."""
    from planner import plan
    from planner.errors import NoFitError

    fields = {k: v for k, v in request.items() if k not in ("model", "global_batch")}
    try:
        return plan(model_of(request["model"]), request["global_batch"], detect=False, use_receipts=False, **fields)
    except NoFitError as err:
        return err.plan


def model_of(model):
    """A request's model: a name, or a transformers config given as its dict (a published run of another stack's
    model code, rebuilt as the HF architecture of its shapes)."""
    if isinstance(model, dict):
        import transformers  # lazy: only for such rows

        return transformers.AutoConfig.for_model(**model)
    return model


def plan_prediction(request: dict) -> tuple[Prediction, object]:
    """The prediction of the configuration `request` pins, made by the plan itself (`pinned`), with the facts it read
    (in all, and those the memory and the step time of that configuration read apart) and the planner that made it;
    and the plan."""
    with facts.recording() as used:
        draft = pinned(request)
    model, printed = candidate_figures(draft.choice)
    return Prediction(model=model, printed=printed, tree=planner_tree(), version=planner_version(),
                      facts=tuple(sorted(used)), figure_facts=figure_facts(request, draft.choice.config)), draft


def figure_facts(request: dict, cfg) -> dict[str, tuple[str, ...]]:
    """The facts the memory and the step time of `cfg` read, each apart, as the plan of `request` computes them
    (its job's memory evaluator and speed model: cached, so each reads what its result was made from)."""
    from planner.planning import resolve_hardware, resolve_job  # lazy: the planner's pipeline, for its parts
    from planner.request import PlanRequest

    fields = {k: v for k, v in request.items() if k not in ("model", "global_batch")}
    plan_request = PlanRequest.of(model=model_of(request["model"]), global_batch=request["global_batch"],
                                  use_receipts=False, **fields)
    job = resolve_job(plan_request, resolve_hardware(plan_request, detect=False))
    found = {}
    for kind, compute in (("memory", job.evaluator.estimate), ("throughput", job.speed)):
        with facts.recording() as used:
            compute(cfg)
        found[kind] = tuple(sorted(used))
    return found


def receipt_of(*, id: str, source: str, data_file: str, request: dict, measured: dict, device: Device,
               program: str = "trainer", note: str = "", created: str = "") -> Receipt:
    """A measured run as a receipt: the configuration `request` pins (every choice the run made: what it leaves to
    the search, the search picks), planned and predicted by the plan (`plan_prediction`), beside what the run
    measured (`measured`: Figures' fields, None where not measured). The receipt keeps the request with every field
    of the planned configuration pinned, so that it is planned again exactly."""
    from planner.receipts import Hardware, RunPlan

    prediction, draft = plan_prediction(request)
    request = {**request, **draft.choice.config.request_fields()}  # planned again, exactly this configuration
    hardware = draft.hardware
    name = request["model"] if isinstance(request["model"], str) else draft.model.name
    plan = RunPlan(model=name, seq_len=draft.seq_len, adapter=draft.model.adapter["method"] if draft.model.adapter
                   else "none", task=draft.model.task, choice=draft.choice.config,
                   hardware=Hardware(gpu=hardware.gpu, gpus_per_node=hardware.gpus_per_node, nodes=hardware.nodes,
                                     gpu_memory_bytes=hardware.gpu_memory_bytes, budget_bytes=hardware.budget_bytes),
                   optimizer=draft.optimizer, attention=draft.attention, program=program, request=request)
    figures = Figures.model_validate({k: v for k, v in measured.items() if v}, strict=False)
    verdict = "" if draft.choice.fits else f"the plan says it does not fit ({draft.choice.reason}), yet it ran"
    return Receipt(id=id, created=created, source=source, data_file=data_file, plan=plan, device=device,
                   predicted=prediction, measured=figures, note="; ".join(filter(None, (note, verdict))))


def published_device(gpu: str, count: int) -> Device:
    """The device of a published run: the catalog GPU its source names (its own words are in the receipt's source)."""
    return Device(kind="cuda", name=gpu, gpu=gpu, count=count)


__all__ = ["Benchmark", "FORMAT", "RECEIPTS", "candidate_figures", "load", "load_file", "model_of", "pinned",
           "plan_prediction", "published_device", "receipt_of", "write"]
