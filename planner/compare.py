"""What-if across GPUs: the same job planned on each GPU, side by side (`plan --compare-gpus`)."""

from __future__ import annotations

from typing import Callable

from pydantic import BaseModel, ConfigDict

from planner.errors import InputError, NoFitError
from planner.hardware import lookup_gpu
from planner.planning import plan_request
from planner.request import PlanRequest, as_flags
from planner.types import Plan


class GpuComparison(BaseModel):
    """One GPU's answer: its plan, or why nothing fits; the time and cost of `train_tokens` when asked."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    gpu: str
    plan: Plan | None = None
    error: str = ""
    #: where nothing fits: the least any candidate needs per GPU, the budget, and the first suggestion's flags
    least_peak: int | None = None
    budget: int | None = None
    suggestion: str = ""
    train_hours: float | None = None
    cost_usd: float | None = None

    @property
    def tokens_per_s(self) -> float | None:
        return self.plan.choice.throughput.tokens_per_s if self.plan else None

    def to_json(self) -> dict:
        return {"gpu": self.gpu, "choice": self.plan.choice.config.label() if self.plan else None,
                "tokens_per_s": self.tokens_per_s, "train_hours": self.train_hours, "cost_usd": self.cost_usd,
                "error": self.error or None, "least_peak_bytes": self.least_peak, "budget_bytes": self.budget,
                "suggestion": self.suggestion or None, "plan": self.plan.to_json() if self.plan else None}


def parse_prices(items: list[str]) -> dict[str, float]:
    """`GPU=USD_PER_HOUR` pairs (per GPU); GPU names as the catalog spells them or any alias."""

    prices = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        if not sep or not name.strip() or not price >= 0 or price == float("inf"):
            raise InputError(f"{item!r} is not GPU=USD_PER_HOUR", flag="--price",
                             hint="e.g. --price H100-80GB=2.5 (US dollars per GPU-hour)")
        prices[lookup_gpu(name.strip()).name] = price
    return prices


def compare_gpus(request: PlanRequest, gpus: list[str], *, prices: dict[str, float] | None = None,
                 progress: Callable[[str], None] | None = None) -> list[GpuComparison]:
    """Plan the request on each GPU (its gpus_per_node and nodes, per GPU kind), the local GPU ignored; with its
    `train_tokens`, the run's time (and cost, with `prices`). A GPU on which nothing fits is a row with its reason; a
    bad GPU name or bad input fails the whole comparison (InputError)."""
    names = [lookup_gpu(g).name for g in gpus]  # unknown names fail fast, before any planning
    if len(set(names)) != len(names) or not names:
        raise InputError("name each GPU once", flag="--compare-gpus", hint="e.g. A100-80GB,H100-80GB,L40S-48GB")
    unknown = set(prices or {}) - set(names)
    if unknown:
        raise InputError(f"a price for {', '.join(sorted(unknown))}, which is not compared", flag="--price")
    rows = []
    for name in names:
        if progress:
            progress(name)
        try:
            result = plan_request(request.model_copy(update={"gpu": name}), detect=False)
        except NoFitError as err:
            rows.append(_nothing_fits(name, err))
            continue
        rows.append(_priced(name, result, request.train_tokens, (prices or {}).get(name)))
    return rows


def _nothing_fits(name: str, err: NoFitError) -> GpuComparison:
    """Why nothing fits on `name`: the least a candidate needs against the budget, and what would fit."""
    over = [c.verdict for c in (err.plan.candidates if err.plan else ()) if c.verdict.kind in ("over", "states-over")]
    least = min(over, key=lambda v: v.peak) if over else None
    flags = next((as_flags(lever.changes) for lever in err.levers if lever.changes), "")
    return GpuComparison(gpu=name, error=err.message, least_peak=least.peak if least else None,
                         budget=least.budget if least else None, suggestion=flags)


def _priced(name: str, result: Plan, train_tokens: float | None, price: float | None) -> GpuComparison:
    hours = train_tokens / result.choice.throughput.tokens_per_s / 3600 if train_tokens else None
    gpus = result.hardware.gpus_per_node * result.hardware.nodes
    cost = hours * gpus * price if hours is not None and price is not None else None
    return GpuComparison(gpu=name, plan=result, train_hours=hours, cost_usd=cost)
