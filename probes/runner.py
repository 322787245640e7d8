"""Run probes as subprocesses with a timeout, through the cache. `Prober` is the `measure` callable that
`planner.plan(..., measure=...)` takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
        if cfg.zero_stage > 0 or cfg.offload != "none":
            return {"status": "skipped", "reason": "DeepSpeed candidates are modelled only (probes run torch steps)"}
        if context.resolved.config is None:
            return {"status": "skipped", "reason": "a bare nn.Module cannot be re-built in a probe process"}
        req = self.request(context, cfg)
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


def run_probe(request: dict, timeout_s: float) -> dict:
    """One probe in a fresh interpreter: an OOM, a hang or a crash cannot poison the caller or the next probe."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRANSFORMERS_VERBOSITY": "error"}
    if request.get("device", "cuda").startswith("cuda"):
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "")
    try:
        done = subprocess.run([sys.executable, "-m", "probes.worker"], input=json.dumps(request),  # noqa: S603
                              capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"no result within {timeout_s:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("PROBE-RESULT "):
            return json.loads(line[len("PROBE-RESULT "):])
    tail = (done.stderr or "").strip().splitlines()[-1:] or [""]
    return {"status": "error", "error": f"probe exited with code {done.returncode}: {tail[0][:300]}"}
