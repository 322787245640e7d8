"""Run probes as subprocesses with a timeout, through the cache. `Prober` is the `measure` callable that
`planner.plan(..., measure=...)` takes.

Each probe runs in its own process group; when it finishes, times out or the caller is interrupted, the whole
group is killed (torchrun and its workers included), so no probe outlives its call.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from planner.types import Measurement
from planner.vocab import ERROR, SKIPPED, TIMEOUT
from probes import cache
from probes.protocol import ProbeRequest, parse_result

#: Seconds a single probe may take (model build, warm-up, timed steps) before it is killed.
DEFAULT_TIMEOUT_S = 120.0
WORKER = ("-m", "probes.worker")


@dataclass
class Prober:
    """Measures candidates on `device` ("cuda" or, for tests and CPU planning, "cpu")."""

    device: str = "cuda"
    timeout_s: float = DEFAULT_TIMEOUT_S
    warmup: int = 1
    steps: int = 2
    use_cache: bool = True
    worker: Sequence[str] = field(default=WORKER)   # tests point this at a faulty worker

    def _deepspeed_unprobeable(self, cfg, context) -> str | None:
        """Why a DeepSpeed candidate cannot be measured here, or None."""
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            return "DeepSpeed is not installed: modelled only"
        local = _local_gpu_count() if self.device.startswith("cuda") else 1
        if cfg.world_size > local:
            return f"needs {cfg.world_size} GPUs, {local} here: modelled only"
        return None

    def request(self, context, cfg) -> ProbeRequest:
        resolved = context.resolved
        source = ({"model_dir": resolved.spec.name} if resolved.spec.source == "folder"
                  else {"config": resolved.config.to_dict()})
        deepspeed = _probe_ds_config(cfg, context) if cfg.sharded else None
        return ProbeRequest(
            **source, trust_remote_code=resolved.trust_remote_code, config_hash=resolved.spec.config_hash,
            micro_batch=cfg.micro_batch, grad_accum=cfg.grad_accum, seq_len=context.seq_len, precision=cfg.precision,
            checkpointing=cfg.checkpointing, attention=context.attention, optimizer=context.optimizer,
            device=self.device, warmup=self.warmup, steps=self.steps, deepspeed=deepspeed,
            world_size=cfg.world_size if cfg.sharded else 1)

    def __call__(self, context, cfg, timeout_s: float | None = None) -> Measurement:
        if context.resolved.config is None:
            return Measurement(status=SKIPPED, reason="a bare nn.Module cannot be re-built in a probe process")
        if cfg.sharded:
            reason = self._deepspeed_unprobeable(cfg, context)
            if reason:
                return Measurement(status=SKIPPED, reason=reason)
        req = self.request(context, cfg)
        key = cache.probe_key(req, context.gpu_name)
        if self.use_cache:
            hit = cache.load(key)
            if hit is not None:
                return hit.model_copy(update={"cached": True, "seconds": 0.0})
        limit = self.timeout_s if timeout_s is None else min(self.timeout_s, timeout_s)
        start = time.monotonic()
        result = run_probe(req, limit, self.worker)
        result = result.model_copy(update={"seconds": time.monotonic() - start})
        cache.store(key, result)
        return result


def _local_gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _probe_ds_config(cfg, context) -> dict:
    """The candidate's own DeepSpeed config, with accumulation cut to 2 micro-steps to keep the probe short."""
    from planner.export import deepspeed_config_for

    short = cfg.model_copy(update={"grad_accum": min(2, cfg.grad_accum)})
    return deepspeed_config_for(short, context.resolved.spec.hidden, context.optimizer, lr=1e-4)


def run_probe(request: ProbeRequest, timeout_s: float, worker: Sequence[str] = WORKER) -> Measurement:
    """One probe in a fresh interpreter (its own process group): an OOM, a hang or a crash cannot poison the caller
    or the next probe. Multi-GPU DeepSpeed probes run under torchrun, one process per GPU."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRANSFORMERS_VERBOSITY": "error"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="trainplan-probe-", delete=False) as handle:
        handle.write(request.model_dump_json())
    args = [*worker, handle.name]
    if request.world_size > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={request.world_size}", *args]
    else:
        cmd = [sys.executable, *args]
    try:
        stdout, stderr, code = _run_group(cmd, env, timeout_s)
    finally:
        os.unlink(handle.name)
    if code is None:
        return Measurement(status=TIMEOUT, reason=f"no result within {timeout_s:.0f} s (process group killed)")
    result = parse_result(stdout)
    if result is not None:
        return result
    tail = (stderr or "").strip().splitlines()[-1:] or [""]
    return Measurement(status=ERROR, reason=f"probe exited with code {code}: {tail[0][:300]}")


def _run_group(cmd: list[str], env: dict, timeout_s: float) -> tuple[str, str, int | None]:
    """Run `cmd` in a new session; (stdout, stderr, exit code), exit code None on timeout. The group is killed on
    every way out."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,  # noqa: S603
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=max(timeout_s, 0.1))
        return stdout, stderr, proc.returncode
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        stdout, stderr = proc.communicate()
        return stdout, stderr, None
    finally:
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait()


__all__ = ["Prober", "run_probe", "DEFAULT_TIMEOUT_S"]
