"""One probe, in its own process: `python -m probes.worker REQUEST.json` (or the JSON on stdin) prints one
JSON result line on stdout. Materialises the model with random weights on the device (from meta; nothing
is downloaded), runs warm-up and timed steps at the candidate's settings, reports memory and time.

Requests with a `deepspeed` config run through `deepspeed.initialize` (ZeRO and offload as planned); under
torchrun every rank runs and rank 0 reports. An OOM is a result (`status: "oom"`), not a failure.
`inject` ("oom" | "hang" | "crash") exists for tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time


def _config(request: dict):
    from transformers import AutoConfig, CONFIG_MAPPING

    if request.get("model_dir"):
        return AutoConfig.from_pretrained(request["model_dir"], trust_remote_code=request.get("trust_remote_code", False))
    data = request["config"]
    return CONFIG_MAPPING[data["model_type"]].from_dict(data)


def _materialise(config, request: dict, device: str):
    import torch

    from planner.models.build import build_meta

    dtype = torch.bfloat16 if request["precision"] == "bf16-true" else torch.float32
    config._attn_implementation = "eager" if request["attention"] == "eager" else "sdpa"
    model = build_meta(config, trust_remote_code=request.get("trust_remote_code", False), dtype=dtype)
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


def run_deepspeed(request: dict) -> dict:
    import deepspeed
    import torch

    from planner.memory.step import enable_checkpointing, make_batch

    device = request.get("device", "cuda")
    _init_distributed(device)
    if device.startswith("cuda"):
        device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    torch.manual_seed(0)
    stage3 = request["deepspeed"]["zero_optimization"]["stage"] == 3
    # ZeRO-3 never holds the whole model on one GPU: build it in host memory and let DeepSpeed partition it
    model = _materialise(_config(request), request, "cpu" if stage3 else device)
    model.train()
    enable_checkpointing(model, request["checkpointing"])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=request["deepspeed"])
    batch = make_batch(model, request["micro_batch"], request["seq_len"], device=engine.device)
    accum = engine.gradient_accumulation_steps()
    clock = _Clock(str(engine.device))

    def micro():
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()

    for _ in range(request.get("warmup", 1) * accum):
        micro()
    if str(engine.device).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(request.get("steps", 2) * accum):
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
    return {**_result(request, allocated, reserved, micro_s, optim_s), "engine": "deepspeed"}


def run(request: dict) -> dict:
    import torch

    from planner.memory.step import enable_checkpointing, make_batch, make_optimizer, micro_step
    from planner.memory.tracker import LiveStorageTracker

    device = request.get("device", "cuda")
    inject = request.get("inject")
    if inject == "hang":
        time.sleep(3600)
    if inject == "crash":
        os._exit(9)
    if request.get("deepspeed"):
        if inject == "oom":
            raise torch.OutOfMemoryError("injected out-of-memory")
        return run_deepspeed(request)
    torch.manual_seed(0)
    model = _materialise(_config(request), request, device)
    model.train()
    enable_checkpointing(model, request["checkpointing"])
    optimizer = make_optimizer(model, request["optimizer"], foreach=None)
    batch = make_batch(model, request["micro_batch"], request["seq_len"], device=device)
    precision = "fp32" if request["precision"] == "bf16-true" else request["precision"]
    dev_type = "cuda" if device.startswith("cuda") else "cpu"
    accum = min(2, request.get("grad_accum", 1))  # 2 micro-steps show both regimes (with/without grads)
    clock = _Clock(device)
    tracker = LiveStorageTracker() if dev_type == "cpu" else None

    def step():
        if inject == "oom":
            raise torch.OutOfMemoryError("injected out-of-memory")
        for _ in range(accum):
            micro_step(model, batch, precision, dev_type)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(request.get("warmup", 1)):
        step()
    if dev_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    micro_times, optim_times = [], []
    with tracker or contextlib.nullcontext():
        if tracker is not None:
            tracker.track_all(list(model.parameters()) + list(model.buffers()) + list(batch.values()))
            tracker.track_all(t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))
            tracker.reset_peak()
        for _ in range(request.get("steps", 2)):
            for _ in range(accum):
                t0 = clock()
                micro_step(model, batch, precision, dev_type)
                micro_times.append(clock() - t0)
            t0 = clock()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            optim_times.append(clock() - t0)
    if dev_type == "cuda":
        allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    else:
        allocated = reserved = tracker.peak
    return _result(request, allocated, reserved, _median(micro_times), _median(optim_times))


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _result(request: dict, allocated: int, reserved: int, micro_s: float, optim_s: float) -> dict:
    """The probe's report: peaks, and a full step's time as N micro-steps plus one optimizer step."""
    n = request.get("grad_accum", 1)
    step_time = n * micro_s + optim_s
    tokens = request["micro_batch"] * request["seq_len"] * n
    return {"status": "ok", "peak_allocated": int(allocated), "peak_reserved": int(reserved), "micro_step_s": micro_s,
            "optimizer_step_s": optim_s, "step_time_s": step_time, "tokens_per_s": tokens / step_time}


def main() -> int:
    request = json.loads(open(sys.argv[1]).read() if len(sys.argv) > 1 else sys.stdin.read())
    try:
        result = run(request)
    except Exception as err:  # noqa: BLE001 - report every failure as a result line
        import torch

        oom = isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()
        result = {"status": "oom" if oom else "error", "error": f"{type(err).__name__}: {str(err)[:500]}"}
    if os.environ.get("RANK", "0") == "0":
        sys.stdout.write("PROBE-RESULT " + json.dumps(result) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
