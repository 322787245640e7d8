"""Run probes as subprocesses with a timeout, through the cache. `Prober` is the `measure` callable that
`planner.plan(..., measure=...)` takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from probes import cache

#: Seconds a single probe may take (model build, warm-up, timed steps) before it is killed.
DEFAULT_TIMEOUT_S = 120.0


@dataclass
class Prober:
    """Measures candidates on `device` ("cuda" or, for tests and CPU planning, "cpu")."""

    device: str = "cuda"
    timeout_s: float = DEFAULT_TIMEOUT_S
    warmup: int = 1
    steps: int = 2
    use_cache: bool = True
    inject: str | None = None  # tests: "oom" | "hang" | "crash"

    def _deepspeed_unprobeable(self, cfg, context) -> str | None:
        """Why a DeepSpeed candidate cannot be measured here, or None."""
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            return "DeepSpeed is not installed: modelled only"
        if context.optimizer not in ("adamw", "adam", "lion"):
            return f"DeepSpeed probes build Adam-family optimizers, not {context.optimizer}: modelled only"
        local = _local_gpu_count() if self.device.startswith("cuda") else 1
        if cfg.world_size > local:
            return f"needs {cfg.world_size} GPUs, {local} here: modelled only"
        return None

    def request(self, context, cfg) -> dict:
        resolved = context.resolved
        req = {"micro_batch": cfg.micro_batch, "grad_accum": cfg.grad_accum, "seq_len": context.seq_len,
               "precision": cfg.precision, "checkpointing": cfg.checkpointing, "attention": context.attention,
               "optimizer": context.optimizer, "device": self.device, "warmup": self.warmup, "steps": self.steps,
               "config_hash": resolved.spec.config_hash, "trust_remote_code": resolved.trust_remote_code}
        if resolved.spec.source == "folder":
            req["model_dir"] = resolved.spec.name
        else:
            req["config"] = resolved.config.to_dict()
        if self.inject:
            req["inject"] = self.inject
        return req

    def __call__(self, context, cfg) -> dict:
        if context.resolved.config is None:
            return {"status": "skipped", "reason": "a bare nn.Module cannot be re-built in a probe process"}
        req = self.request(context, cfg)
        if cfg.zero_stage > 0:
            reason = self._deepspeed_unprobeable(cfg, context)
            if reason:
                return {"status": "skipped", "reason": reason}
            req["deepspeed"] = _probe_ds_config(cfg, context)
            req["world_size"] = cfg.world_size
        key = cache.probe_key(req, context.gpu_name)
        if self.use_cache and not self.inject:
            hit = cache.load(key)
            if hit is not None:
                return {**hit, "cached": True, "seconds": 0.0}
        start = time.monotonic()
        result = run_probe(req, self.timeout_s)
        result["seconds"] = time.monotonic() - start
        result["cached"] = False
        if not self.inject:
            cache.store(key, {k: v for k, v in result.items() if k not in ("cached", "seconds")})
        return result


def _local_gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _probe_ds_config(cfg, context) -> dict:
    """The candidate's own DeepSpeed config, with accumulation cut to 2 micro-steps to keep the probe short."""
    from planner.export import deepspeed_config_for

    accum = min(2, cfg.grad_accum)
    short = cfg.model_copy(update={"grad_accum": accum})
    return deepspeed_config_for(short, context.resolved.spec.hidden, context.optimizer, lr=1e-4)


def run_probe(request: dict, timeout_s: float) -> dict:
    """One probe in a fresh interpreter: an OOM, a hang or a crash cannot poison the caller or the next probe.
    Multi-GPU DeepSpeed probes run under torchrun, one process per GPU."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRANSFORMERS_VERBOSITY": "error"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="trainplan-probe-", delete=False) as handle:
        json.dump(request, handle)
    worker = ["-m", "probes.worker", handle.name]
    world = int(request.get("world_size", 1))
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", *worker]
    else:
        cmd = [sys.executable, *worker]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)  # noqa: S603
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"no result within {timeout_s:.0f} s"}
    finally:
        os.unlink(handle.name)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("PROBE-RESULT "):
            return json.loads(line[len("PROBE-RESULT "):])
    tail = (done.stderr or "").strip().splitlines()[-1:] or [""]
    return {"status": "error", "error": f"probe exited with code {done.returncode}: {tail[0][:300]}"}
