"""How sure a prediction is: how far predictions like it were from measured runs, drawn from the stratum that describes
the plan, and the memory margin sized to a stated risk.

A stratum names what a run was (`DIMENSIONS`): the program that ran it, the GPU family, the scale, the engine, the
adapters, Liger-Kernel, torch.compile and the precision family, each read from the configuration that ran (its
receipt, planner/receipts). benchmarks/report.py writes, for every stratum measured runs fall in, their measured /
predicted ratios, one per run, over the runs no fitted constant was derived from (planner/facts/errors.json). A
plan's bar comes from its own stratum when it holds `MIN_RUNS` runs; otherwise dimensions are pooled one at a time in
`POOLED_IN_ORDER`, each pooled dimension widening a percentile range (`WIDEN_PER_POOLED`) but never beyond the most
extreme ratio some pooled run measured. `NEVER_POOLED` dimensions are not borrowed: a plan at a scale, with Liger or in
a precision no run measured is "not measured".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner import facts
from planner.vocab import DEEPSPEED, NO_ADAPTER, TRAINER

DIMENSIONS = ("program", "gpu", "scale", "engine", "adapter", "liger", "compiled", "precision")
#: Pooled first to last when a stratum holds too few runs (the program last: another program's runs stand for a
#: Trainer plan only in a stratum that says it pooled them).
POOLED_IN_ORDER = ("compiled", "gpu", "engine", "adapter", "program")
#: Never pooled: what no run measured is "not measured", not borrowed from runs unlike it (fp32 steps ran 0.9x their
#: prediction where bf16 ones ran 1.3-1.8x on the same H200: one precision's runs say nothing of another's).
NEVER_POOLED = ("scale", "liger", "precision")
POOLED = "*"
#: A stratum's bar needs this many runs; a 10th-90th percentile range needs P90_RUNS (fewer: the median and the
#: extremes).
MIN_RUNS = 5
P90_RUNS = 20
#: Each pooled dimension widens both sides of a percentile range by this share of their (log) distance from the
#: median, up to the pooled runs' extremes.
WIDEN_PER_POOLED = 0.5
#: The share of runs like the plan whose peak the memory margin covers (a 95th percentile needs P90_RUNS runs).
MARGIN_COVERAGE = 0.95
#: Facts that size the margin a plan holds back, which no predicted peak (allocated, reserved, process) contains.
MARGIN_FACTS = ("memory.activation_margin",)
ERROR_PREFIX = "error."


@dataclass(frozen=True)
class Stratum:
    """What a measured run or a plan was, dimension by dimension (`DIMENSIONS`); "*" where pooled."""

    program: str = TRAINER
    gpu: str = POOLED          # the GPU family (`gpu_family`)
    scale: str = "1-gpu"       # 1-gpu | 1-node | nodes
    engine: str = "single"     # single | ddp | zero | fsdp | tp | split-sequence
    adapter: str = NO_ADAPTER  # `vocab.ADAPTER`: none | lora | qlora
    liger: str = "no-liger"    # liger | no-liger
    compiled: str = "not-compiled"  # compiled | not-compiled
    precision: str = "mixed"   # `Config.precision_family`: mixed | fp32 | tf32 | bf16-true | fp8

    @classmethod
    def of_config(cls, cfg, gpu: str | None, gpus_per_node: int, adapter: str = NO_ADAPTER,
                  program: str = TRAINER) -> "Stratum":
        """The stratum of a run of `cfg` (a planner.config.Config) on `gpu` (a catalog name; None: any),
        `gpus_per_node` to a node, training `adapter` (`vocab.ADAPTER`) in `program`."""
        world = cfg.world_size
        scale = "1-gpu" if world == 1 else "1-node" if world <= gpus_per_node else "nodes"
        kind = "tp" if cfg.tensor_parallel > 1 else "split-sequence" if cfg.sequence_split > 1 else (
            "single" if world == 1 else "ddp") if not cfg.sharded else "zero" if cfg.engine == DEEPSPEED else "fsdp"
        return cls(program=program, gpu=gpu_family(gpu or POOLED), scale=scale, engine=kind, adapter=adapter,
                   liger="liger" if cfg.liger else "no-liger", compiled="compiled" if cfg.compiled else "not-compiled",
                   precision=cfg.precision_family())

    @classmethod
    def from_json(cls, group: dict) -> "Stratum":
        return cls(**{name: str(group[name]) for name in DIMENSIONS if group.get(name) is not None})

    def to_json(self) -> dict:
        return {name: getattr(self, name) for name in DIMENSIONS}

    @property
    def key(self) -> str:
        return ":".join(getattr(self, name) for name in DIMENSIONS)

    def pooled(self, count: int) -> "Stratum":
        """This stratum with the first `count` dimensions of `POOLED_IN_ORDER` pooled."""
        return replace(self, **{name: POOLED for name in POOLED_IN_ORDER[:count]})

    def ladder(self) -> list[tuple["Stratum", tuple[str, ...]]]:
        """This stratum, then pooled one more dimension at a time, each with the dimensions it pooled."""
        return [(self.pooled(n), POOLED_IN_ORDER[:n]) for n in range(len(POOLED_IN_ORDER) + 1)]


def gpu_family(name: str) -> str:
    """A catalog GPU's family: its name less the memory size (A100-40GB and A100-80GB are one: A100)."""
    if name == POOLED:
        return name
    head, _, tail = name.rpartition("-")
    return head if head and tail.upper().endswith("GB") else name


@dataclass(frozen=True)
class Spread:
    """The distribution of measured / predicted over a stratum's runs: `n` runs (`first_look` of them first-look),
    its 10th, 50th, 90th and 95th percentiles (nearest rank) and its extremes."""

    n: int
    first_look: int
    p10: float
    median: float
    p90: float
    p95: float
    low: float
    high: float

    @classmethod
    def of(cls, ratios: list[float], first_look: int = 0) -> "Spread":
        values = sorted(ratios)
        return cls(n=len(values), first_look=first_look, p10=quantile(values, 0.10), median=quantile(values, 0.5),
                   p90=quantile(values, 0.90), p95=quantile(values, MARGIN_COVERAGE), low=values[0], high=values[-1])


def quantile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank q-quantile of values already sorted."""
    rank = max(1, -(-int(round(q * 1000)) * len(sorted_values) // 1000))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def fact_key(kind: str, stratum: Stratum) -> str:
    return f"{ERROR_PREFIX}{kind}:{stratum.key}"


@dataclass(frozen=True)
class Bar:
    """The error bar of one kind of prediction (memory | throughput) for a stratum: the spread found, the stratum
    it was found in and the dimensions pooled to reach it (None spread: not measured), and the range of measured /
    predicted it gives: the 10th-90th percentile with P90_RUNS runs or more (widened per pooled dimension, up to the
    runs' extremes), else the extremes themselves."""

    kind: str
    stratum: Stratum
    pooled: tuple[str, ...]
    spread: Spread | None
    source: str = ""

    @property
    def measured(self) -> bool:
        return self.spread is not None

    def widened(self, value: float) -> float:
        """A quantile of measured / predicted moved away from the median, in ratio (log) terms, by WIDEN_PER_POOLED
        of its distance for each pooled dimension, never past the most extreme run: a bias stays, a ratio stays
        positive, and no range claims an error no run measured."""
        s = self.spread
        moved = s.median * (value / s.median) ** (1 + WIDEN_PER_POOLED * len(self.pooled))
        return min(max(moved, s.low), s.high)

    @property
    def range(self) -> tuple[float, float]:
        """(low, high) multipliers of a prediction: measured values of runs like it fell within them."""
        s = self.spread
        return (self.widened(s.p10), self.widened(s.p90)) if s.n >= P90_RUNS else (s.low, s.high)

    @property
    def covers(self) -> float:
        """The share of runs the range is drawn to cover (0.8 between the 10th and 90th percentiles; all runs where
        too few for percentiles)."""
        return 0.8 if self.spread.n >= P90_RUNS else 1.0


def bar_for(kind: str, stratum: Stratum) -> Bar:
    """The nearest stratum up `stratum.ladder()` with MIN_RUNS runs in planner/facts/errors.json; not measured where
    none has."""
    for candidate, pooled in stratum.ladder():
        key = fact_key(kind, candidate)
        found = facts.find(key)
        if found is None:
            continue
        value = facts.get(key)
        if value["n"] >= MIN_RUNS:
            spread = Spread(**{name: value[name] for name in Spread.__dataclass_fields__})
            return Bar(kind=kind, stratum=candidate, pooled=pooled, spread=spread, source=found.source)
    return Bar(kind=kind, stratum=stratum, pooled=(), spread=None)


#: How a margin was sized (`Margin.basis`).
BY_ROWS, BY_ACTIVATIONS, NO_MARGIN = "rows", "activations", "no-margin"


@dataclass(frozen=True)
class Margin:
    """What a plan holds back for the model's error on memory: `bytes`, and how it was sized: BY_ROWS (the
    MARGIN_COVERAGE quantile of measured / predicted peaks over `n` runs like it), BY_ACTIVATIONS (the activation
    margin, where fewer than P90_RUNS runs are like it), or NO_MARGIN (a measured peak, a bound, a CPU estimate)."""

    bytes: int
    basis: str
    n: int = 0
    coverage: float = MARGIN_COVERAGE


def margin_for(bar: Bar, predicted_peak: int, activations: int) -> Margin:
    """The margin beyond `predicted_peak`: enough for MARGIN_COVERAGE of the runs like it where P90_RUNS runs say so
    (their quantile widened for what was pooled, up to the worst run; none where they were all over-predicted);
    otherwise the activation margin (`memory.activation_margin`: the published HF-code runs' 90th percentile of
    measured over predicted activations)."""
    if bar.measured and bar.spread.n >= P90_RUNS:
        return Margin(bytes=int(predicted_peak * max(0.0, bar.widened(bar.spread.p95) - 1)), basis=BY_ROWS,
                      n=bar.spread.n)
    return Margin(bytes=int(facts.get("memory.activation_margin") * activations), basis=BY_ACTIVATIONS,
                  n=bar.spread.n if bar.measured else 0)
