"""What a training run measures, as a transformers TrainerCallback: the time of each optimizer step's micro-steps
and optimizer step, and the peak memory after the warm-up steps (CUDA's counters, or on the CPU the live-storage
tracker the memory model's trace uses, so a CPU run is measured as the trace counts)."""

from __future__ import annotations

import contextlib
import math

from transformers import TrainerCallback

from planner.program.tracker import LiveStorageTracker
from planner.receipts import StepClock, process_memory
from planner.types import Measurement
from planner.vocab import ERROR, OK, OOM


class StepMeter(TrainerCallback):
    """Times the phases of every optimizer step after the warm-up and resets the memory peak when it ends
    (planner/receipts `StepClock`, the receipts' own timing core); on the CPU the peak is the live-storage tracker's."""

    def __init__(self, warmup: int, cuda: bool, model):
        self.cuda, self.model = cuda, model
        self.tracker = None if cuda else LiveStorageTracker()
        self.clock = StepClock(warmup, cuda, reset=None if cuda else self.tracker.reset_peak)
        self.losses: list[float] = []
        self.micro_steps: list[int] = []   # micro-steps seen per optimizer step
        self._substeps = 0

    @contextlib.contextmanager
    def tracking(self):
        """Track live tensors for the whole run (CPU only); CUDA counts by itself."""
        if self.tracker is None:
            yield
            return
        with self.tracker:
            self.tracker.track_all(list(self.model.parameters()) + list(self.model.buffers()))
            yield

    def on_train_begin(self, args, state, control, **kwargs):
        self.clock.start()

    def on_step_begin(self, args, state, control, **kwargs):
        self.clock.begin()
        self._substeps = 0

    def on_substep_end(self, args, state, control, **kwargs):
        self._substeps += 1

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.clock.mark("optimizer-begin")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.clock.mark("optimizer-end")

    def on_step_end(self, args, state, control, **kwargs):
        self.micro_steps.append(self._substeps + 1)
        self.clock.end()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))

    def peaks(self) -> tuple[int, int]:
        if self.cuda:
            import torch

            return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        return self.tracker.peak, self.tracker.peak

    def measurement(self, *, micro_batch: int, seq_len: int, processes: int, engine: str, wall_s: float) -> Measurement:
        median = self.clock.median()
        if median is None:
            raise RuntimeError("no optimizer step was measured")
        grad_accum = max(self.micro_steps)
        tokens_per_step = micro_batch * grad_accum * seq_len
        if not all(math.isfinite(x) for x in self.losses):
            raise FloatingPointError(f"the loss is not finite: {self.losses}")
        allocated, reserved = self.peaks()
        return Measurement(status=OK, peak_allocated=int(allocated), peak_reserved=int(reserved),
                           process_memory=process_memory() if self.cuda else 0,
                           micro_step_s=median.micro_steps / grad_accum, optimizer_step_s=median.optimizer,
                           step_time_s=median.whole, tokens_per_s=tokens_per_step / median.whole, processes=processes,
                           engine=engine, micro_batch=micro_batch, grad_accum=grad_accum, losses=tuple(self.losses),
                           seconds=wall_s)


def profile_summary(prof, steps: int, top: int = 60) -> dict:
    """A torch.profiler run as data: per op (by name), calls and the host and device time they took, per
    optimizer step over `steps` steps; device kernels counted and timed in total (from the device-side records
    alone: a host op's own device time repeats its kernels', and a user annotation's device-side range, e.g.
    "Optimizer.step#AdamW.step", spans kernels counted already: torch's own table leaves those out the same way,
    torch/autograd/profiler_util.py `_build_table`, `not evt.is_user_annotation`)."""
    ops, kernels = [], []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0)
        op = {"name": event.key, "calls": event.count / steps, "self_cpu_us": event.self_cpu_time_total / steps,
              "self_device_us": device_us / steps}
        ops.append(op)
        # device-side records (kernels, memcpy/memset) have device time and no host time of their own
        if op["self_device_us"] > 0 and op["self_cpu_us"] == 0 and not getattr(event, "is_user_annotation", False):
            kernels.append((op["calls"], op["self_device_us"]))
    ops.sort(key=lambda o: -(o["self_device_us"] + o["self_cpu_us"] * 1e-3))
    return {"steps": steps, "device_kernels_per_step": sum(c for c, _ in kernels),
            "device_us_per_step": sum(t for _, t in kernels),
            "host_op_us_per_step": sum(o["self_cpu_us"] for o in ops),
            "ops": ops[:top]}


def failure(err: BaseException) -> Measurement:
    """A failed run as a result: an out-of-memory error is an OOM (the candidate does not fit), anything else an
    error."""
    import torch

    oom = isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()
    return Measurement(status=OOM if oom else ERROR, reason=f"{type(err).__name__}: {str(err)[:500]}")


#: Memory-history entries kept while recording (torch's ring buffer; each holds the Python stack of one event).
HISTORY_ENTRIES = 4_000_000


@contextlib.contextmanager
def memory_history(path: str | None):
    """Record the CUDA caching allocator's history for the block (torch.cuda.memory._record_memory_history, Python
    stacks only) and write `peak_anatomy` of its snapshot to `path` as JSON. The snapshot is read in this process
    (torch.cuda.memory._snapshot returns a dict), never dumped to a pickle."""
    if not path:
        yield
        return
    import json
    from pathlib import Path

    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("--memory-peak records the CUDA caching allocator's history: it needs a CUDA GPU")
    torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python")
    try:
        yield
    finally:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        anatomy = peak_anatomy(snapshot, HISTORY_ENTRIES)
        anatomy["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        Path(path).write_text(json.dumps(anatomy, indent=1) + "\n")


def _site(frames: list[dict]) -> str:
    """Where an allocation was asked for: the innermost Python frame outside torch itself (a model's, the
    Trainer's, accelerate's line), with the torch function under it; "(no Python frame)" for allocations made by
    C++ alone, such as autograd's backward thread."""
    def short(frame: dict) -> str:
        name = frame["filename"].replace("\\", "/")
        for anchor in ("site-packages/", "dist-packages/"):
            name = name.split(anchor)[-1]
        return f"{name}:{frame['line']} {frame['name']}"

    if not frames:
        return "(no Python frame)"
    outside = next((f for f in frames if "/torch/" not in f["filename"].replace("\\", "/")), None)
    return short(outside) + ("" if outside is frames[0] else f" <- {short(frames[0])}") if outside else short(frames[0])


def peak_anatomy(snapshot: dict, max_entries: int, top: int = 40) -> dict:
    """What was live at the peak of a recorded allocator history: replays the trace (allocated bytes rise at
    "alloc" and fall at "free_completed", as torch's allocated-bytes statistic does; an entry carries the requested
    size, so the replayed peak lacks the blocks' rounding that max_memory_allocated counts), finds the event that set
    the peak and groups the blocks live then by allocation site. Blocks allocated before recording began appear
    in no event, so recording starts before the model is built (`probes.train --memory-peak`)."""
    trace = max(snapshot.get("device_traces") or [[]], key=len)
    live, level, peak, peak_at = {}, 0, 0, -1
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            level += event["size"]
            if level > peak:
                peak, peak_at = level, index
        elif event["action"] == "free_completed":
            level -= event["size"]
    for event in trace[:peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    sites: dict[str, list[int]] = {}
    for event in live.values():
        entry = sites.setdefault(_site(event.get("frames") or []), [0, 0])
        entry[0] += event["size"]
        entry[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])
    return {"events": len(trace), "truncated": len(trace) >= max_entries, "peak_event": peak_at,
            "peak_replayed": peak,
            "peak_site": _site(trace[peak_at].get("frames") or []) if peak_at >= 0 else None,
            "sites": [{"site": s, "bytes": b, "blocks": n} for s, (b, n) in ranked[:top]],
            "other_sites_bytes": sum(b for _, (b, _) in ranked[top:])}
