"""What-if across GPUs: the same job planned on each GPU, side by side (`plan --compare-gpus`)."""

from __future__ import annotations

from typing import Callable

from pydantic import BaseModel, ConfigDict

from planner.errors import InputError, NoFitError
from planner.hardware import lookup_gpu
from planner.notes import Lever
from planner.planning import plan_request
from planner.request import PlanRequest, as_flags
from planner.types import Hardware, Plan


class GpuComparison(BaseModel):
    """One GPU's answer, as `plan --gpu GPU` gives it: its plan, or why nothing fits and what would (the same
    suggestions); the time and cost of `train_tokens` when asked."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    gpu: str
    plan: Plan | None = None
    #: the hardware the row was planned on (its host RAM and where that came from), fitting or not
    hardware: Hardware | None = None
    error: str = ""
    #: where nothing fits: what the smallest configuration needs per GPU, the budget, and what would fit
    least_peak: int | None = None
    budget: int | None = None
    levers: tuple[Lever, ...] = ()
    train_hours: float | None = None
    cost_usd: float | None = None

    @property
    def tokens_per_s(self) -> float | None:
        return self.plan.choice.throughput.tokens_per_s if self.plan else None

    @property
    def suggestions(self) -> list[str]:
        """The flags of each suggestion that makes the plan fit, in the order `plan` gives them."""
        return [as_flags(lever.changes) for lever in self.levers if lever.changes]

    @property
    def suggestion(self) -> str:
        return next(iter(self.suggestions), "")

    def to_json(self) -> dict:
        host = self.hardware
        return {"gpu": self.gpu, "choice": self.plan.choice.config.label() if self.plan else None,
                "tokens_per_s": self.tokens_per_s, "train_hours": self.train_hours, "cost_usd": self.cost_usd,
                "error": self.error or None, "least_peak_bytes": self.least_peak, "budget_bytes": self.budget,
                "suggestion": self.suggestion or None, "suggestions": self.suggestions,
                "host_memory_bytes": host.host_memory_bytes if host else None,
                "host_memory_source": host.host_memory_source if host else None,
                "host_system": host.host_system if host else None,
                "plan": self.plan.to_json() if self.plan else None}


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
                 progress: Callable[[str], None] | None = None, detect: bool = True) -> list[GpuComparison]:
    """Plan the request on each GPU as `plan --gpu GPU` would (`detect`: a GPU that is this machine's is planned with
    its free memory and this machine's RAM, as plan does); with its `train_tokens`, the run's time (and cost, with
    `prices`). A GPU on which nothing fits is a row with the plan's reason and suggestions; a bad GPU name or bad input
    fails the whole comparison (InputError)."""
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
            result = plan_request(request.model_copy(update={"gpu": name}), detect=detect)
        except NoFitError as err:
            rows.append(_nothing_fits(name, err))
            continue
        rows.append(_priced(name, result, request.train_tokens, (prices or {}).get(name)))
    return rows


#: The suggestions that say what the smallest configuration needs (the first of a no-fit's levers).
SMALLEST = ("smallest", "pinned", "split")


def _nothing_fits(name: str, err: NoFitError) -> GpuComparison:
    """Why nothing fits on `name`, as plan says it: what the smallest configuration needs against the budget (the
    closest candidate's peak where no suggestion says it), and the suggestions."""
    hardware = err.plan.hardware if err.plan else None
    smallest = next((lever for lever in err.levers if lever.kind in SMALLEST), None)
    over = [c.verdict for c in (err.plan.candidates if err.plan else ()) if c.verdict.kind in ("over", "states-over")]
    least = smallest["peak"] if smallest else min((v.peak for v in over), default=None)
    return GpuComparison(gpu=name, hardware=hardware, error=err.message, least_peak=least,
                         budget=hardware.budget_bytes if hardware and least is not None else None,
                         levers=err.levers)


def _priced(name: str, result: Plan, train_tokens: float | None, price: float | None) -> GpuComparison:
    hours = train_tokens / result.choice.throughput.tokens_per_s / 3600 if train_tokens else None
    gpus = result.hardware.gpus_per_node * result.hardware.nodes
    cost = hours * gpus * price if hours is not None and price is not None else None
    return GpuComparison(gpu=name, plan=result, hardware=result.hardware, train_hours=hours, cost_usd=cost)
