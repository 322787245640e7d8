"""One probe, in its own process: `python -m probes.worker REQUEST.json` (or the JSON on stdin) prints one
JSON result line on stdout. Materialises the model with random weights on the device (from meta; nothing
is downloaded), runs warm-up and timed steps at the candidate's settings, reports memory and time.

Requests with a `deepspeed` config run through `deepspeed.initialize` (ZeRO and offload as planned); under
torchrun every rank runs and rank 0 reports. An OOM is a result (`status: "oom"`), not a failure.
"""

from __future__ import annotations

import os
import sys
import time

from planner.types import Measurement
from planner.vocab import ATTENTION, ERROR, OK, OOM, PRECISION
from probes.protocol import ProbeRequest, result_line


def _config(request: ProbeRequest):
    from transformers import CONFIG_MAPPING, AutoConfig

    if request.model_dir:
        return AutoConfig.from_pretrained(request.model_dir, trust_remote_code=request.trust_remote_code)
    return CONFIG_MAPPING[request.config["model_type"]].from_dict(request.config)


def _materialise(config, request: ProbeRequest, device: str):
    import torch

    from planner.models.build import build_meta, effective_attention

    half = PRECISION[request.precision].weight_bytes < 4
    config._attn_implementation = ATTENTION[effective_attention(config, request.attention,
                                                                request.trust_remote_code)].transformers
    model = build_meta(config, trust_remote_code=request.trust_remote_code,
                       dtype=torch.bfloat16 if half else torch.float32)
    model.to_empty(device=device)
    model.tie_weights()
    with torch.no_grad():  # random weights: small normal values keep the loss finite
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model


class _Clock:
    def __init__(self, device: str):
        import torch

        self.sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def __call__(self) -> float:
        self.sync()
        return time.perf_counter()


def _init_distributed(device: str) -> None:
    """DeepSpeed needs a process group; a single probe process makes its own on a free local port."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")


def run_deepspeed(request: ProbeRequest) -> Measurement:
    import deepspeed
    import torch

    from planner.memory.step import enable_checkpointing, make_batch

    device = request.device
    _init_distributed(device)
    if device.startswith("cuda"):
        device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    torch.manual_seed(0)
    stage3 = request.deepspeed["zero_optimization"]["stage"] == 3
    # ZeRO-3 never holds the whole model on one GPU: build it in host memory and let DeepSpeed partition it
    model = _materialise(_config(request), request, "cpu" if stage3 else device)
    model.train()
    enable_checkpointing(model, request.checkpointing)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=request.deepspeed)
    batch = make_batch(model, request.micro_batch, request.seq_len, device=engine.device)
    accum = engine.gradient_accumulation_steps()
    clock = _Clock(str(engine.device))

    def micro():
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()

    for _ in range(request.warmup * accum):
        micro()
    if str(engine.device).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(request.steps * accum):
        t0 = clock()
        micro()
        times.append(clock() - t0)
    boundary = times[accum - 1::accum]  # micro-steps that end in the optimizer step
    inner = [t for i, t in enumerate(times) if (i + 1) % accum] or boundary
    micro_s = _median(inner)
    optim_s = max(0.0, _median(boundary) - micro_s)
    if str(engine.device).startswith("cuda"):
        allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    else:  # CPU runs (tests): the process's resident set is the only meaningful figure
        import resource

        allocated = reserved = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return _result(request, allocated, reserved, micro_s, optim_s).model_copy(
        update={"engine": "deepspeed", "processes": int(os.environ.get("WORLD_SIZE", "1"))})


def run(request: ProbeRequest) -> Measurement:
    if request.deepspeed:
        return run_deepspeed(request)
    import torch

    from planner.memory.step import enable_checkpointing, make_batch, make_optimizer

    device = request.device
    torch.manual_seed(0)
    model = _materialise(_config(request), request, device)
    model.train()
    enable_checkpointing(model, request.checkpointing)
    optimizer = make_optimizer(model, request.optimizer, foreach=None)
    batch = make_batch(model, request.micro_batch, request.seq_len, device=device)
    dev_type = "cuda" if device.startswith("cuda") else "cpu"
    autocast = PRECISION[request.precision].autocast
    accum = min(2, request.grad_accum)  # 2 micro-steps show both regimes (with/without grads)
    step = _Stepper(model, optimizer, batch, autocast, dev_type, accum, _Clock(device))
    for _ in range(request.warmup):
        step.run()
    if dev_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    allocated, reserved = step.measure(request.steps)
    return _result(request, allocated, reserved, _median(step.micro_times), _median(step.optim_times))


class _Stepper:
    """Runs optimizer steps of `accum` micro-steps, timing both phases; the peak comes from CUDA's counters or,
    on the CPU, from the live-storage tracker."""

    def __init__(self, model, optimizer, batch, autocast, dev_type, accum, clock):
        self.model, self.optimizer, self.batch, self.autocast = model, optimizer, batch, autocast
        self.dev_type, self.accum, self.clock = dev_type, accum, clock
        self.micro_times: list[float] = []
        self.optim_times: list[float] = []

    def run(self, timed: bool = False) -> None:
        from planner.memory.step import micro_step

        for _ in range(self.accum):
            t0 = self.clock()
            micro_step(self.model, self.batch, self.autocast, self.dev_type)
            if timed:
                self.micro_times.append(self.clock() - t0)
        t0 = self.clock()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if timed:
            self.optim_times.append(self.clock() - t0)

    def measure(self, steps: int) -> tuple[int, int]:
        import torch

        from planner.memory.tracker import LiveStorageTracker

        if self.dev_type == "cuda":
            for _ in range(steps):
                self.run(timed=True)
            return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        tracker = LiveStorageTracker()
        with tracker:
            tracker.track_all(list(self.model.parameters()) + list(self.model.buffers()) + list(self.batch.values()))
            tracker.track_all(t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))
            tracker.reset_peak()
            for _ in range(steps):
                self.run(timed=True)
        return tracker.peak, tracker.peak


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _result(request: ProbeRequest, allocated: int, reserved: int, micro_s: float, optim_s: float) -> Measurement:
    """The probe's report: peaks, and a full step's time as N micro-steps plus one optimizer step."""
    n = request.grad_accum
    step_time = n * micro_s + optim_s
    tokens = request.micro_batch * request.seq_len * n
    return Measurement(status=OK, peak_allocated=int(allocated), peak_reserved=int(reserved), micro_step_s=micro_s,
                       optimizer_step_s=optim_s, step_time_s=step_time, tokens_per_s=tokens / step_time)


def failure(err: BaseException) -> Measurement:
    """A failed probe as a result: an out-of-memory error is an OOM (the candidate does not fit), anything else an
    error."""
    import torch

    oom = isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()
    return Measurement(status=OOM if oom else ERROR, reason=f"{type(err).__name__}: {str(err)[:500]}")


def main() -> int:
    text = open(sys.argv[1]).read() if len(sys.argv) > 1 else sys.stdin.read()
    try:
        result = run(ProbeRequest.model_validate_json(text))
    except Exception as err:  # noqa: BLE001 - report every failure as a result line
        result = failure(err)
    if os.environ.get("RANK", "0") == "0":
        sys.stdout.write(result_line(result))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
