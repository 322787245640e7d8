"""A run's receipt in the making: `StepClock` times optimizer steps after a warm-up (the one timing core of the
receipt `Meter` and the probes' StepMeter), `Meter` measures peak memory (torch.cuda's counters and NVML on a GPU; the
process's high-water RSS on the host) and step time, checks them against the plan's error bars (one logged line when
a figure is outside), and writes receipt.json (schema 2, planner/receipts/schema.py) into the run folder and the
user's cache, where the next `plan` reads it. A receipt holds no data, and no path.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from planner.cache import cache_dir
from planner.config import Config
from planner.hardware import match_gpu
from planner.hardware.host import cpu_name
from planner.receipts.schema import SCHEMA, Device, Figures, Hardware, Prediction, Receipt, RunPlan
from planner.vocab import NO_ADAPTER, OK, PACKAGE, TRAINER

log = logging.getLogger("planner")

RECEIPT = "receipt.json"
CACHE_KIND = "receipts"
#: optimizer steps left out of the measurement (compilation, allocator growth, the first optimizer states)
DEFAULT_WARMUP = 3
#: measured steps after the warm-up before the run is checked against its plan
CHECK_AFTER = 5
#: the stack a receipt records: distributions, by the name `importlib.metadata` knows them (a plan's optional
#: packages among them)
STACK = ("torch", "transformers", "accelerate", "trainplan", *PACKAGE)
GiB = 2**30


@dataclass(frozen=True)
class StepTime:
    """One measured optimizer step: its micro-steps (forward and backward, all of them), its optimizer step, and the
    whole step, in seconds."""

    micro_steps: float
    optimizer: float
    whole: float


class StepClock:
    """Optimizer steps timed after `warmup` of them. The peaks are reset when the warm-up ends (`reset`: CUDA's
    counters, or a tracker's), then each step is timed from its begin (or the previous step's end) to its end, split
    at the optimizer step where the caller marks it. On CUDA each mark waits for the GPU (torch.cuda.synchronize), so
    a step's kernels count in the step that launched them."""

    def __init__(self, warmup: int, cuda: bool, reset: Callable[[], None] | None = None):
        self.warmup, self.cuda, self._reset = warmup, cuda, reset
        self.steps = 0
        self.times: list[StepTime] = []
        self._marks: dict[str, float] = {}

    def now(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def start(self) -> None:
        """The run begins (with no warm-up, the peaks are reset here)."""
        self._marks = {"begin": self.now()}
        if self.warmup == 0:
            self.reset_peaks()

    def begin(self) -> None:
        self._marks = {"begin": self.now()}

    def mark(self, name: str) -> None:
        """`optimizer-begin` where the optimizer step begins, `optimizer-end` where it ends."""
        self._marks[name] = self.now()

    def end(self) -> bool:
        """An optimizer step ended; True where it was measured (past the warm-up)."""
        end = self.now()
        begin = self._marks.get("begin", end)
        optimizer, optimized = self._marks.get("optimizer-begin", end), self._marks.get("optimizer-end", end)
        self.steps += 1
        measured = self.steps > self.warmup
        if measured:
            self.times.append(StepTime(micro_steps=optimizer - begin, optimizer=optimized - optimizer, whole=end - begin))
        elif self.steps == self.warmup:
            self.reset_peaks()
        self._marks = {"begin": end}
        return measured

    def reset_peaks(self) -> None:
        if self._reset is not None:
            self._reset()
        elif self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()

    def median(self) -> StepTime | None:
        """The median of each part over the measured steps."""
        if not self.times:
            return None
        return StepTime(micro_steps=statistics.median(t.micro_steps for t in self.times),
                        optimizer=statistics.median(t.optimizer for t in self.times),
                        whole=statistics.median(t.whole for t in self.times))


# --- what the plan said ---------------------------------------------------------------------------------------------
def prediction(data: dict) -> Prediction:
    """What plan.json `data` predicted per GPU (memory, bytes) and for the whole run (step time, tokens/s): the
    figures it printed, the model's own beneath them, and the planner that made them."""
    memory, speed = data["memory"], data["throughput"]
    process = memory["peak"] - ((memory.get("terms") or {}).get("error_margin") or 0)  # what nvidia-smi would show
    printed = Figures.model_validate(
        {"peak_allocated": memory["peak_allocated"], "peak_reserved": memory["peak_reserved"],
         "peak_process": process, "peak": memory["peak"], "activations": memory.get("activations") or None,
         "host_peak": memory.get("cpu_offload_bytes") or None, "step_time_s": speed["step_time_s"],
         "tokens_per_s": speed["tokens_per_s"], "real_tokens_per_s": speed.get("real_tokens_per_s")}, strict=False)
    model = {**(memory.get("model") or {}), **(speed.get("model") or {})}
    planner = data.get("planner") or {}
    return Prediction(model=Figures.model_validate(model, strict=False) if model else printed, printed=printed,
                      tree=planner.get("tree"), version=planner.get("version"))


def run_plan(data: dict) -> RunPlan:
    """The configuration plan.json `data` runs, without paths (a local model by its folder's name)."""
    model = data["model"]
    name = Path(model["name"]).name if model.get("source") == "folder" else model["name"]
    hardware = data["hardware"]
    return RunPlan(model=name, seq_len=model["seq_len"], adapter=(model.get("adapter") or {}).get("method", NO_ADAPTER),
                   task=model.get("task"), choice=Config.model_validate({k: data["choice"][k] for k in Config.model_fields}),
                   hardware=Hardware.model_validate({k: hardware.get(k) for k in Hardware.model_fields}, strict=False),
                   optimizer=data["optimizer"], attention=data["attention"], program=TRAINER,
                   request=data.get("request"))


# --- where the run measured -----------------------------------------------------------------------------------------
def versions() -> dict[str, str | None]:
    """The stack the run measured: Python, CUDA, the driver, and each of `STACK`'s distributions (None: not
    installed), read from their metadata."""
    import torch

    found: dict[str, str | None] = {"python": platform.python_version(), "cuda": torch.version.cuda, "driver": None}
    for name in STACK:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    if torch.cuda.is_available():
        try:
            import pynvml

            pynvml.nvmlInit()
            found["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # noqa: BLE001 - NVML missing or refusing (containers): the driver is unknown
            pass
    return found


def device() -> Device:
    """Where the run measured: the CUDA device's name and the catalog GPU of that name, else this machine's
    processor."""
    import torch

    host = cpu_name()
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return Device(kind="cuda", name=name, gpu=match_gpu(name), count=torch.cuda.device_count(), host=host)
    return Device(kind="cpu", name=host, count=os.cpu_count(), host=host)


def host_peak() -> int:
    """The process's high-water resident memory in bytes (getrusage; Linux counts kibibytes, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def process_memory() -> int:
    """Device memory the driver counts for this process (what nvidia-smi lists: the CUDA context plus every
    segment the caching allocator holds, which it keeps after the peak), or 0 where NVML cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
        for index in range(pynvml.nvmlDeviceGetCount()):  # NVML numbers devices regardless of CUDA_VISIBLE_DEVICES
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory:
                    return int(proc.usedGpuMemory)
    except Exception:  # noqa: BLE001 - NVML missing or refusing (containers): the figure is unknown
        return 0
    return 0


class Meter:
    """A run's receipt in the making: call `step()` at the end of each optimizer step, `write()` at the end.

    `data`: the plan's JSON; `folder`: where receipt.json goes (None: only the cache); `tokens_per_step`: the tokens
    one optimizer step trains on all ranks (default: the plan's)."""

    def __init__(self, data: dict, folder=None, *, warmup: int = DEFAULT_WARMUP, tokens_per_step: float | None = None,
                 cache: bool = True):
        import torch

        self.data, self.folder, self.cache = data, Path(folder) if folder else None, cache
        self.clock = StepClock(warmup, torch.cuda.is_available())
        self.tokens_per_step = tokens_per_step or data["choice"].get("tokens_per_step")
        self.predicted = prediction(data)
        self.plan = run_plan(data)
        self.real_tokens: list[float] = []
        self.checks: list[str] = []
        self.status = OK
        self.path: Path | None = None   # receipt.json once written
        self._checked = False
        self.clock.start()

    @property
    def warmup(self) -> int:
        return self.clock.warmup

    def __enter__(self) -> Meter:
        self.clock.start()
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None or self.clock.times:  # a failed run's receipt says how far it got
            self.status = OK if kind is None else f"failed: {kind.__name__}"
            self.path = self.write()

    def ran(self, **changes) -> None:
        """What the run changed of the planned configuration (the Trainer's `use_liger_kernel`, say): the receipt
        records the configuration that ran."""
        choice = self.plan.choice.model_copy(update=changes)
        if choice != self.plan.choice:
            self.plan = self.plan.model_copy(update={"choice": choice})

    def step(self, real_tokens: float | None = None) -> None:
        """One optimizer step ended; `real_tokens`: the non-pad tokens it trained on all ranks, where known."""
        if self.clock.end() and real_tokens is not None:
            self.real_tokens.append(real_tokens)
        if not self._checked and len(self.clock.times) >= CHECK_AFTER:
            self._checked = True
            self.checks = check(self.measured(), self.predicted.printed, self.data)
            for line in self.checks:
                log.warning(line)

    def measured(self) -> Figures:
        """What the run measured so far (None where not known)."""
        median = self.clock.median()
        step = median.whole if median and median.whole > 0 else None
        found = {"host_peak": host_peak(), "step_time_s": step,
                 "tokens_per_s": self.tokens_per_step / step if step and self.tokens_per_step else None,
                 "real_tokens_per_s": (statistics.median(self.real_tokens) / step
                                       if step and self.real_tokens and self.real_tokens[0] else None)}
        if self.clock.cuda:
            import torch

            found.update(peak_allocated=torch.cuda.max_memory_allocated() or None,
                         peak_reserved=torch.cuda.max_memory_reserved() or None, peak_process=process_memory() or None)
        return Figures.model_validate(found, strict=False)

    def receipt(self) -> Receipt:
        """The receipt (schema 2): the run's configuration and device, predicted and measured side by side, the
        error bars, the stack."""
        created = datetime.now(timezone.utc)
        return Receipt(id=f"run-{created.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}",
                       created=created.isoformat(timespec="seconds"), plan=self.plan, device=device(),
                       versions=versions(), predicted=self.predicted, measured=self.measured(),
                       error_bars={"memory": self.data["memory"].get("error"),
                                   "throughput": self.data["throughput"].get("error")},
                       steps=len(self.clock.times), warmup=self.warmup, status=self.status, checks=tuple(self.checks))

    def write(self) -> Path | None:
        """receipt.json in the run folder (and a copy in the cache); None where no step was measured."""
        if not self.clock.times:
            log.warning("no receipt: the run ended before %d optimizer steps (warm-up %d)", self.warmup + 1,
                        self.warmup)
            return None
        receipt = self.receipt()
        text = json.dumps(receipt.to_json(), indent=1, sort_keys=True)
        written = None
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            written = self.folder / RECEIPT
            written.write_text(text)
        if self.cache:
            store = cache_dir(CACHE_KIND)
            try:
                store.mkdir(parents=True, exist_ok=True)
                (store / f"{receipt.id}.json").write_text(text)
            except OSError:  # a read-only home is no reason to fail a run
                pass
        return written


def check(measured: Figures, printed: Figures, data: dict) -> list[str]:
    """The figures of a GPU run outside the plan's error bars, a sentence each (none on a CPU: the plan is a GPU's)."""
    if measured.peak_reserved is None:
        return []
    lines = []
    bars = {"memory": data["memory"].get("error") or {}, "throughput": data["throughput"].get("error") or {}}
    peak, planned = measured.peak_reserved, printed.peak_reserved
    high = bars["memory"].get("high") or 1.0
    if peak and planned and peak > planned * high:
        budget = data["hardware"]["budget_bytes"]
        lines.append(f"peak {peak / GiB:.1f} GiB is {peak / planned - 1:.0%} above the plan's {planned / GiB:.1f} GiB "
                     f"(bar: +{high - 1:.0%}); {(budget - peak) / GiB:.1f} GiB of the {budget / GiB:.1f} GiB budget "
                     f"left, and the longest batches may be still to come: see {RECEIPT}")
    step, planned_step = measured.step_time_s, printed.step_time_s
    slow = bars["throughput"].get("high") or 1.0
    if step and planned_step and step > planned_step * slow:
        lines.append(f"steps take {step:.3g} s, {step / planned_step - 1:.0%} longer than the plan's "
                     f"{planned_step:.3g} s (bar: +{slow - 1:.0%}): see {RECEIPT}")
    return lines


__all__ = ["CHECK_AFTER", "DEFAULT_WARMUP", "Meter", "RECEIPT", "SCHEMA", "StepClock", "StepTime", "check", "device",
           "host_peak", "prediction", "process_memory", "run_plan", "versions"]
