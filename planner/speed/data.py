"""Step time on a user's data: each configuration's micro-batches cost the tokens its padding strategy computes
(planner/dataset.py), and count the tokens of data among them."""

from __future__ import annotations

from planner.config import Config
from planner.dataset import (
    Histogram, grouped_tokens_per_batch, mean_length, packing_waste, padded_tokens_per_batch,
)
from planner.speed.step import StepSize, ThroughputInfo
from planner.vocab import GROUPED, LONGEST, PACKING, PADDING_FREE


class DataSpeed:
    """`speed` (a SpeedModel, which times rows of `seq_len` tokens) for samples of the lengths in `histogram`
    (clipped to `seq_len`); `packed`, the one that times packed rows, where they are longer. The GPU's time scales with
    the tokens a micro-batch computes (a shorter padded row is timed as that share of a full one: its attention's
    quadratic part is over-counted, the safe side); the host's dispatch does not change; the rest of the step
    (optimizer, communication) is the full row's."""

    def __init__(self, speed, histogram: Histogram, seq_len: int, packed=None):
        self.speed, self.histogram, self.seq_len = speed, histogram, seq_len
        self.packed = packed or speed
        self.mean = mean_length(histogram)
        self._full: dict[Config, ThroughputInfo] = {}
        self._grouped: dict[tuple[int, int], float] = {}

    @property
    def workload(self):
        return self.speed.workload

    def prefetch(self, configs) -> None:
        self.speed.prefetch([c for c in configs if c.padding != PACKING])
        if self.packed is not self.speed:
            self.packed.prefetch([c for c in configs if c.padding == PACKING])

    def row_length(self, cfg: Config) -> int:
        return self.packed.workload.seq_len if cfg.padding == PACKING else self.seq_len

    def tokens(self, cfg: Config) -> tuple[float, float]:
        """(tokens computed, tokens of data) per micro-batch of `cfg`'s padding strategy."""
        b = cfg.micro_batch
        if cfg.padding == PACKING:
            row = self.row_length(cfg)
            return b * row, b * row * (1 - packing_waste(self.histogram, row))
        if cfg.padding == PADDING_FREE:
            return b * self.mean, b * self.mean
        if cfg.padding == GROUPED:
            key = (b, cfg.grad_accum)
            if key not in self._grouped:
                self._grouped[key] = grouped_tokens_per_batch(self.histogram, b, None, grad_accum=cfg.grad_accum)
            return self._grouped[key], b * self.mean
        if cfg.padding != LONGEST:
            raise ValueError(f"no padding strategy on {cfg.label()}")
        return padded_tokens_per_batch(self.histogram, b), b * self.mean

    def step_size(self, cfg: Config) -> StepSize:
        """A step's micro-batches: the tokens they compute, the tokens of data among them, and the samples those are
        (a packed row holds several)."""
        padded, real = self.tokens(cfg)
        micro_batches = cfg.grad_accum * cfg.data_parallel
        return StepSize(samples=real * micro_batches / self.mean, tokens=padded * micro_batches,
                        real_tokens=real * micro_batches)

    def attention_length(self, cfg: Config) -> float:
        """The mean sample's length: a padded row's tokens attend over at least it, a packed sample's over itself."""
        return self.mean

    def __call__(self, cfg: Config) -> ThroughputInfo:
        packed = cfg.padding == PACKING and self.packed is not self.speed
        key = (cfg.model_copy(update={"padding": None}), packed)
        if key not in self._full:
            self._full[key] = (self.packed if packed else self.speed)(key[0])
        full, row = self._full[key], self.row_length(cfg)
        size = self.step_size(cfg)
        computed = size.tokens / (cfg.grad_accum * cfg.data_parallel)
        parts = full.parts
        share = min(1.0, computed / (cfg.micro_batch * row))
        parts = parts.model_copy(update={"compute": cfg.grad_accum * (max(parts.micro_gpu * share, parts.micro_cpu)
                                                                     + parts.micro_wait)})
        step = parts.total
        full_tokens = cfg.global_batch * row  # what `full` timed: every row full
        return ThroughputInfo(tokens_per_s=size.tokens / step, real_tokens_per_s=size.real_tokens / step,
                              samples_per_s=size.samples / step,
                              mfu=full.mfu * size.real_tokens / full_tokens * full.step_time_s / step,
                              hfu=full.hfu * size.tokens / full_tokens * full.step_time_s / step,
                              step_time_s=step, parts=parts)
