"""The host CPU's side of eager PyTorch: what dispatching one op, one backward node, one view and one nn.Module call
costs, as a measured quantity.

Where the plan runs on the GPU it plans for, a sub-second micro-benchmark measures these costs on that host and stack
(`measure_host_costs`, run in a child process so the planner's own process never holds a CUDA context), cached per
host and stack in trainplan's cache (`measured_here`). Otherwise the speed model takes the GPU's usual system's
figures from efficiency.json (planner/hardware/efficiency_data.py) and the spread between the hosts those figures were
measured on (`HOST_RANGE_FACT`) as a range of step times.

The micro-benchmark times ops as simple as can be (`torch.add` on eight elements, `x.view`, an identity module): a
real training step's ops cost the host more (autograd recording, autocast, the allocator, model code's own Python,
ops launching several kernels), which the speed model's `host.step_op_factor` fact carries (planner/speed/kernels.py).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from planner import facts
from planner.cache import load_json, store_json

CACHE_KIND = "host"
#: The cache entries' format: part of their key, so a changed benchmark measures again.
CACHE_VERSION = 1
#: The fact naming the hosts behind the usual systems' figures: the fastest and slowest as multiples of a usual
#: system's own (planner/facts/host.json).
HOST_RANGE_FACT = "host.usual_system_range"
#: How long the child process may take: importing torch and creating a CUDA context, then the benchmark itself.
MEASURE_TIMEOUT_S = 120.0


class HostCosts(BaseModel):
    """What the host spends per thing a step dispatches, in microseconds: an op launching a kernel from Python
    (`dispatch_us`) or from the autograd engine (`engine_dispatch_us`), a view op from Python (`python_op_us`) or C++
    (`cpp_op_us`), one nn.Module call (`module_call_us`). `host` says whose they are: "measured here" (this machine,
    `measured_at` naming its CPU and stack) or the usual system's."""

    model_config = ConfigDict(frozen=True)

    dispatch_us: float
    engine_dispatch_us: float
    python_op_us: float
    cpp_op_us: float
    module_call_us: float
    measured: bool = False
    measured_at: str = ""

    def scaled(self, factor: float) -> "HostCosts":
        """The same host `factor` times as slow (every cost scaled)."""
        return self.model_copy(update={name: getattr(self, name) * factor for name in COSTS})


#: The fields of `HostCosts` that are costs (what `scaled` multiplies).
COSTS = ("dispatch_us", "engine_dispatch_us", "python_op_us", "cpp_op_us", "module_call_us")


def measure_host_costs(device: str = "cpu", ops: int = 2000) -> HostCosts:
    """The micro-benchmark: each cost as the median of five timed loops of `ops` calls on `device` (synchronised
    before and after on CUDA), after one loop of warm-up. Takes well under a second on a GPU host."""
    import torch

    x = torch.ones(8, device=device)
    weight = torch.ones(8, device=device, requires_grad=True)
    linear = torch.nn.Linear(8, 8, device=device)

    def per_op(fn, count: int = ops) -> float:
        times = []
        for round_ in range(6):
            _sync(torch, device)
            start = time.perf_counter()
            fn()
            _sync(torch, device)
            if round_:  # the first round warms up
                times.append((time.perf_counter() - start) / count * 1e6)
        return sorted(times)[len(times) // 2]

    def backward():
        y = weight
        for _ in range(ops):
            y = y * 1.0001
        _sync(torch, device)
        start = time.perf_counter()
        y.sum().backward()
        _sync(torch, device)
        return (time.perf_counter() - start) / ops * 1e6

    functional = per_op(lambda: [torch.nn.functional.linear(x, linear.weight, linear.bias) for _ in range(ops)])
    return HostCosts(dispatch_us=per_op(lambda: [torch.add(x, 1) for _ in range(ops)]),
                     engine_dispatch_us=sorted(backward() for _ in range(5))[2],
                     python_op_us=per_op(lambda: [x.view(-1) for _ in range(ops)]),
                     cpp_op_us=per_op(lambda: [x.view(-1) for _ in range(ops)]) * _CPP_OVER_PYTHON,
                     module_call_us=max(0.0, per_op(lambda: [linear(x) for _ in range(ops)]) - functional),
                     measured=True, measured_at=host_stack(device))


#: A view op issued by the autograd engine skips Python's argument parsing: ngimel, pytorch/pytorch#41383, "same
#: operation called using c++ API would take about a microsecond" against about 2 from Python.
_CPP_OVER_PYTHON = 0.5


def _sync(torch, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def host_stack(device: str) -> str:
    """This host and stack, as the cache keys them: the CPU, Python, torch and the device measured on."""
    import torch

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return f"{cpu_name()} | python {platform.python_version()} | torch {torch.__version__} | {name}"


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_key(gpu_name: str) -> str:
    import hashlib

    import torch

    text = f"{CACHE_VERSION}|{cpu_name()}|{platform.python_version()}|{torch.__version__}|{gpu_name}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def measured_here(gpu_name: str) -> HostCosts | None:
    """This host's costs with the local GPU (`gpu_name`, the detected catalog GPU), from the cache or measured now in
    a child process (a CUDA context there, not in the planner's process); None when the measurement fails (the plan
    then takes the usual system's figures)."""
    key = _cache_key(gpu_name)
    found = load_json(CACHE_KIND, key)
    if found is None:
        found = _measure_in_child()
        if found is None:
            return None
        store_json(CACHE_KIND, key, found)
    try:
        return HostCosts.model_validate(found)
    except ValueError:
        return None


def _measure_in_child() -> dict | None:
    """`measure_host_costs("cuda")` in a fresh Python process, handed back through a temporary file."""
    with tempfile.TemporaryDirectory(prefix="trainplan-host-") as folder:
        out = Path(folder) / "host.json"
        try:
            subprocess.run([sys.executable, "-m", "planner.hardware.host", str(out)], check=True,
                           timeout=MEASURE_TIMEOUT_S, capture_output=True, env={**os.environ})
            return json.loads(out.read_text())
        except (OSError, subprocess.SubprocessError, ValueError):
            return None


def usual_range() -> tuple[float, float]:
    """The fastest and slowest host behind the usual systems' figures, as multiples of a usual system's own costs."""
    low, high = facts.get(HOST_RANGE_FACT)
    return float(low), float(high)


if __name__ == "__main__":  # the child process of `_measure_in_child`: measures and writes the file it is given
    Path(sys.argv[1]).write_text(json.dumps(measure_host_costs("cuda").model_dump()))
