"""Receipts: what a run measured beside what its plan predicted (receipt.json, schema 1, docs/receipts.md).

A `Meter` watches the optimizer steps of a run; after the warm-up it measures peak memory (torch.cuda's counters and
NVML on a GPU; the process's high-water RSS on the host) and step time, checks them against the plan's error bars
(one logged line when a figure is outside), and writes the receipt into the run folder and the user's cache, where
the next `plan` on that GPU reads it (`receipt_speeds`). A receipt holds no data, and no path but the run folder's.
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
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from planner.cache import cache_dir
from planner.config import Config
from planner.errors import InputError
from planner.vocab import NO_ADAPTER

log = logging.getLogger("planner")

SCHEMA = 1
RECEIPT = "receipt.json"
CACHE_KIND = "receipts"
#: optimizer steps left out of the measurement (compilation, allocator growth, the first optimizer states)
DEFAULT_WARMUP = 3
#: measured steps after the warm-up before the run is checked against its plan
CHECK_AFTER = 5
#: the quantities a receipt records, predicted and measured alike (None where not known)
QUANTITIES = ("peak_allocated", "peak_reserved", "peak_process", "host_peak", "step_time_s", "tokens_per_s",
              "real_tokens_per_s")
GiB = 2**30


def predicted(data: dict) -> dict:
    """What plan.json `data` predicted per GPU (memory, bytes) and for the whole run (step time, tokens/s)."""
    memory, speed = data["memory"], data["throughput"]
    process = memory["peak"] - ((memory.get("terms") or {}).get("error_margin") or 0)  # what nvidia-smi would show
    return {"peak_allocated": memory["peak_allocated"], "peak_reserved": memory["peak_reserved"],
            "peak_process": process, "host_peak": memory.get("cpu_offload_bytes") or None,
            "step_time_s": speed["step_time_s"], "tokens_per_s": speed["tokens_per_s"],
            "real_tokens_per_s": speed.get("real_tokens_per_s")}


def plan_summary(data: dict) -> dict:
    """The plan a receipt checks: its configuration, hardware and model, without paths (a local model by its
    folder's name)."""
    model = data["model"]
    name = Path(model["name"]).name if model.get("source") == "folder" else model["name"]
    config = {key: data["choice"][key] for key in Config.model_fields}
    adapter = (model.get("adapter") or {}).get("method", NO_ADAPTER)
    return {"model": name, "seq_len": model.get("seq_len"), "adapter": adapter, "choice": config,
            "label": Config.model_validate(config).label(),
            "hardware": {key: data["hardware"][key] for key in ("gpu", "gpus_per_node", "nodes", "gpu_memory_bytes",
                                                                "budget_bytes")}}


def versions() -> dict:
    """The stack the run measured: Python, torch, transformers, CUDA and the driver where there is one."""
    import torch
    import transformers

    found = {"python": platform.python_version(), "torch": torch.__version__,
             "transformers": transformers.__version__, "cuda": torch.version.cuda, "driver": None}
    try:
        found["trainplan"] = metadata.version("trainplan")
    except metadata.PackageNotFoundError:
        found["trainplan"] = None
    if torch.cuda.is_available():
        try:
            import pynvml

            pynvml.nvmlInit()
            found["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # noqa: BLE001 - NVML missing or refusing (containers): the driver is unknown
            pass
    return found


def device() -> dict:
    """Where the run measured: the CUDA device's name, else this machine's processor."""
    import torch

    if torch.cuda.is_available():
        return {"kind": "cuda", "name": torch.cuda.get_device_name(), "count": torch.cuda.device_count()}
    return {"kind": "cpu", "name": platform.processor() or platform.machine(), "count": os.cpu_count()}


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

        self.data, self.folder, self.warmup, self.cache = data, Path(folder) if folder else None, warmup, cache
        self.cuda = torch.cuda.is_available()
        self.tokens_per_step = tokens_per_step or data["choice"].get("tokens_per_step")
        self.predicted = predicted(data)
        self.times: list[float] = []
        self.real_tokens: list[float] = []
        self.checks: list[str] = []
        self.steps = 0
        self.status = "ok"
        self.path: Path | None = None   # receipt.json once written
        self._last = time.perf_counter()
        self._checked = False

    def __enter__(self) -> Meter:
        self._last = time.perf_counter()
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None or self.times:  # a failed run's receipt says how far it got
            self.status = "ok" if kind is None else f"failed: {kind.__name__}"
            self.path = self.write()

    def step(self, real_tokens: float | None = None) -> None:
        """One optimizer step ended; `real_tokens`: the non-pad tokens it trained on all ranks, where known."""
        now = time.perf_counter()
        self.steps += 1
        if self.steps == self.warmup:
            self._reset_peaks()
        elif self.steps > self.warmup:
            self.times.append(now - self._last)
            if real_tokens is not None:
                self.real_tokens.append(real_tokens)
        self._last = now
        if not self._checked and len(self.times) >= CHECK_AFTER:
            self._checked = True
            self.checks = check(self.measured(), self.predicted, self.data)
            for line in self.checks:
                log.warning(line)

    def _reset_peaks(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()

    def measured(self) -> dict:
        """What the run measured so far (None where not known)."""
        step = statistics.median(self.times) if self.times else None
        got = dict.fromkeys(QUANTITIES)
        got.update(host_peak=host_peak(), step_time_s=step,
                   tokens_per_s=self.tokens_per_step / step if step and self.tokens_per_step else None,
                   real_tokens_per_s=(statistics.median(self.real_tokens) / step
                                      if step and self.real_tokens and self.real_tokens[0] else None))
        if self.cuda:
            import torch

            got.update(peak_allocated=torch.cuda.max_memory_allocated(), peak_reserved=torch.cuda.max_memory_reserved(),
                       peak_process=process_memory() or None)
        return got

    def receipt(self) -> dict:
        """The receipt (schema 1): the plan, predicted and measured side by side, the error bars, the stack."""
        return {"schema": SCHEMA, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "plan": plan_summary(self.data), "predicted": self.predicted, "measured": self.measured(),
                "error_bars": {"memory": self.data["memory"].get("error"),
                               "throughput": self.data["throughput"].get("error")},
                "device": device(), "versions": versions(), "steps": len(self.times), "warmup": self.warmup,
                "status": self.status, "checks": self.checks}

    def write(self) -> Path | None:
        """receipt.json in the run folder (and a copy in the cache); None where no step was measured."""
        if not self.times:
            log.warning("no receipt: the run ended before %d optimizer steps (warm-up %d)", self.warmup + 1,
                        self.warmup)
            return None
        text = json.dumps(self.receipt(), indent=1, sort_keys=True)
        written = None
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            written = self.folder / RECEIPT
            written.write_text(text)
        if self.cache:
            store = cache_dir(CACHE_KIND)
            try:
                store.mkdir(parents=True, exist_ok=True)
                (store / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json").write_text(text)
            except OSError:  # a read-only home is no reason to fail a run
                pass
        return written


def check(measured: dict, expected: dict, data: dict) -> list[str]:
    """The figures of a GPU run outside the plan's error bars, a sentence each (none on a CPU: the plan is a GPU's)."""
    if measured.get("peak_reserved") is None:
        return []
    lines = []
    bars = {"memory": data["memory"].get("error") or {}, "throughput": data["throughput"].get("error") or {}}
    peak, planned = measured.get("peak_reserved"), expected.get("peak_reserved")
    high = bars["memory"].get("high") or 1.0
    if peak and planned and peak > planned * high:
        budget = data["hardware"]["budget_bytes"]
        lines.append(f"peak {peak / GiB:.1f} GiB is {peak / planned - 1:.0%} above the plan's {planned / GiB:.1f} GiB "
                     f"(bar: +{high - 1:.0%}); {(budget - peak) / GiB:.1f} GiB of the {budget / GiB:.1f} GiB budget "
                     f"left, and the longest batches may be still to come: see {RECEIPT}")
    step, planned_step = measured.get("step_time_s"), expected.get("step_time_s")
    slow = bars["throughput"].get("high") or 1.0
    if step and planned_step and step > planned_step * slow:
        lines.append(f"steps take {step:.3g} s, {step / planned_step - 1:.0%} longer than the plan's "
                     f"{planned_step:.3g} s (bar: +{slow - 1:.0%}): see {RECEIPT}")
    return lines


# --- reading receipts back ------------------------------------------------------------------------------------------

def read_receipts(paths: list[str | os.PathLike] | None = None, cache: bool = True) -> tuple[list[dict], list[str]]:
    """The receipts in the cache (where `cache`) and under each of `paths` (a receipt.json, or a folder searched for
    *.json); and one line per file skipped as malformed or foreign. Reads JSON only."""
    files: list[Path] = []
    for path in paths or []:
        path = Path(path).expanduser()
        if not path.exists():
            raise InputError(f"{path} does not exist", flag="--receipts",
                             hint="Name a receipt.json or a folder of them (a team's runs).")
        files += sorted(path.rglob("*.json")) if path.is_dir() else [path]
    if cache and cache_dir(CACHE_KIND).is_dir():
        files += sorted(cache_dir(CACHE_KIND).glob("*.json"))
    receipts, skipped = [], []
    for file in files:
        try:
            data = json.loads(file.read_text())
            problem = _problem(data)
        except (OSError, ValueError) as err:
            problem = str(err)
        if problem:
            skipped.append(f"skipped {file.name}: {problem}")
        else:
            receipts.append(data)
    return receipts, skipped


def _problem(data) -> str | None:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return f"not a schema-{SCHEMA} receipt"
    try:
        Config.model_validate(data["plan"]["choice"])
        return None if isinstance(data["predicted"], dict) and isinstance(data["measured"], dict) \
            and isinstance(data["plan"]["hardware"]["gpu"], str) else "its predicted or measured part is missing"
    except (KeyError, TypeError, ValueError) as err:
        return f"malformed ({type(err).__name__})"


__all__ = ["Meter", "RECEIPT", "SCHEMA", "check", "predicted", "read_receipts", "host_peak"]
