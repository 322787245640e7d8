"""Probes: a candidate measured by running the shipped training script (probes/train.py) under that candidate's
emitted files, with `accelerate launch`, as a user would. `Prober` is the `measure` callable that
`planner.plan(..., measure=...)` takes.

Every run is its own process group; when it ends, times out or the caller is interrupted the whole group is killed
(torchrun and its workers included). DDP and sharded candidates run with their planned number of processes when
this node has the GPUs; otherwise with the processes it has, and the plan adds the modelled per-rank difference
(labelled probe+model). The first DeepSpeed run of a kind builds DeepSpeed's ops once, with its own time budget.
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
from pathlib import Path

from emit import EmitOptions, render_files
from planner.types import Measurement
from planner.vocab import DEEPSPEED, ERROR, OK, OOM, SKIPPED, TIMEOUT
from probes import cache
from probes.protocol import parse_result

#: Seconds a single probe may take (launch, model build, warm-up, timed steps) before it is killed.
DEFAULT_TIMEOUT_S = 120.0
#: Seconds DeepSpeed may take to build its ops the first time (JIT compiles of fused Adam, CPU Adam, comm ops).
DEFAULT_BUILD_TIMEOUT_S = 900.0
#: Micro-steps per optimizer step a probe runs: two show both regimes (without and with gradients allocated); the
#: candidate's step time is then N micro-steps plus one optimizer step.
PROBE_ACCUMULATION = 2
TRAIN = ("-m", "probes.train")


def accelerate_command(config_file: str | Path, script: Sequence[str]) -> list[str]:
    """`accelerate launch --config_file FILE SCRIPT...` through this interpreter."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file), *script]


def run_training(folder: Path, timeout_s: float, *, steps: int = 2, warmup: int = 1,
                 script: Sequence[str] = TRAIN, extra: Sequence[str] = ()) -> Measurement:
    """Launch the training script under the files in `folder` for `warmup` steps and then `steps` measured ones
    (`extra`: more of its arguments), and read every rank's result: an OOM on any rank is an OOM (never a hang: the
    other ranks are killed with the group), the peak is the largest rank's."""
    out = folder / "results"
    # --force: a probe is how a candidate predicted not to fit the free memory is measured anyway
    cmd = accelerate_command(folder / "accelerate_config.yaml",
                             [*script, "--plan", str(folder), "--out", str(out), "--steps", str(warmup + steps),
                              "--warmup", str(warmup), "--force", *extra])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRANSFORMERS_VERBOSITY": "error"}
    stdout, stderr, code = run_group(cmd, env, timeout_s, cwd=folder)
    ranks = [Measurement.model_validate_json(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    if not ranks:
        single = parse_result(stdout)
        ranks = [single] if single is not None else []
    if code is None and not any(r.status == OOM for r in ranks):
        return Measurement(status=TIMEOUT, reason=f"no result within {timeout_s:.0f} s (process group killed)",
                           budget_s=timeout_s)
    return combine_ranks(ranks, code, stderr)


def combine_ranks(ranks: list[Measurement], code: int | None, stderr: str) -> Measurement:
    if any(r.status == OOM for r in ranks):
        return next(r for r in ranks if r.status == OOM)
    ok = [r for r in ranks if r.status == OK]
    if ok and len(ok) == len(ranks):
        worst = max(ok, key=lambda r: r.peak_reserved)
        return worst.model_copy(update={"step_time_s": max(r.step_time_s for r in ok)})
    failed = next((r for r in ranks if r.status != OK), None)
    if failed is not None:
        return failed
    tail = (stderr or "").strip().splitlines()[-1:] or [""]
    return Measurement(status=ERROR, reason=f"training exited with code {code}: {tail[0][:300]}")


def run_group(cmd: list[str], env: dict, timeout_s: float, cwd=None) -> tuple[str, str, int | None]:
    """Run `cmd` in a new session; (stdout, stderr, exit code), exit code None on timeout. The group is killed on
    every way out."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,  # noqa: S603
                            cwd=cwd, start_new_session=True)
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


def _compile_allowance(context, cfg) -> float:
    """Seconds a compiled candidate's probe needs beyond a probe's limit: the modelled first-step compile time
    (planner/speed/step.py `StepParts.compile_once`), which its warm-up step pays."""
    plan = getattr(context, "plan", None)
    if not cfg.compiled or plan is None:
        return 0.0
    found = next((c for c in plan.candidates if c.config == cfg and c.throughput is not None), None)
    return found.throughput.parts.compile_once if found else 0.0


@dataclass
class Prober:
    """Measures candidates on this machine's GPUs (or, for tests, on the CPU: `device="cpu"`)."""

    device: str = "cuda"
    timeout_s: float = DEFAULT_TIMEOUT_S
    build_timeout_s: float = DEFAULT_BUILD_TIMEOUT_S
    warmup: int = 1
    steps: int = 2
    use_cache: bool = True
    script: Sequence[str] = field(default=TRAIN)   # tests point this at a misbehaving script
    _built: set = field(default_factory=set)

    def local_processes(self) -> int:
        if not self.device.startswith("cuda"):
            return 2  # CPU runs (tests): two gloo ranks stand for a node
        import torch

        return torch.cuda.device_count()

    def __call__(self, context, cfg, timeout_s: float | None = None) -> Measurement:
        why = self._unprobeable(context, cfg)
        if why:
            return Measurement(status=SKIPPED, reason=why)
        processes = min(cfg.world_size, self.local_processes())
        run_cfg = cfg.model_copy(update={"world_size": processes, "grad_accum": min(cfg.grad_accum,
                                                                                       PROBE_ACCUMULATION)})
        files = probe_files(context.plan, run_cfg)
        limit = self.timeout_s + _compile_allowance(context, cfg)  # a compiled candidate's warm-up compiles
        limit = limit if timeout_s is None else min(limit, timeout_s)
        key = cache.probe_key(files, context.gpu_name, (self.warmup, self.steps, self.device))
        if self.use_cache:
            hit = cache.load(key, limit)
            if hit is not None:
                return scaled(hit, cfg).model_copy(update={"cached": True, "seconds": 0.0})
        start = time.monotonic()
        self._prebuild(run_cfg, files, limit)
        with tempfile.TemporaryDirectory(prefix="trainplan-probe-") as tmp:
            folder = write_files(files, Path(tmp))
            result = run_training(folder, max(limit - (time.monotonic() - start), 1.0), steps=self.steps,
                                  warmup=self.warmup, script=self.script)
        cache.store(key, result)
        return scaled(result, cfg).model_copy(update={"seconds": time.monotonic() - start})

    def _unprobeable(self, context, cfg) -> str | None:
        if context.plan is None or context.resolved.spec.source not in ("folder", "hf-cache", "preset", "hub"):
            return "a model given as a Python object cannot be rebuilt by the training script: modelled only"
        if cfg.tensor_parallel > 1:  # transformers applies a TP plan while loading a checkpoint (tp_plan="auto")
            return "tensor parallelism shards a checkpoint as it loads, and a probe has none: modelled only"
        if cfg.engine == DEEPSPEED:
            try:
                import deepspeed  # noqa: F401
            except ImportError:
                return "DeepSpeed is not installed: modelled only"
        return None

    def _prebuild(self, cfg, files: dict[str, str], limit: float) -> None:
        """Build DeepSpeed's ops for this kind of configuration once, in a run of its own budget, so that a probe's
        time limit measures training, not a compiler."""
        kind = (cfg.engine, cfg.offload, cfg.precision)
        if cfg.engine != DEEPSPEED or kind in self._built:
            return
        self._built.add(kind)
        with tempfile.TemporaryDirectory(prefix="trainplan-build-") as tmp:
            folder = write_files(files, Path(tmp))
            run_training(folder, self.build_timeout_s, steps=1, warmup=0, script=self.script)


def probe_files(plan, cfg) -> dict[str, str]:
    """The files `plan --emit` writes for `cfg` run on this node (its processes, one node)."""

    hardware = plan.hardware.model_copy(update={"gpus_per_node": cfg.world_size, "nodes": 1})
    candidate = next((c for c in plan.candidates if c.config == cfg), plan.choice)
    variant = plan.model_copy(update={"choice": candidate.model_copy(update={"config": cfg}), "hardware": hardware})
    return render_files(variant, EmitOptions())


def write_files(files: dict[str, str], folder: Path) -> Path:
    """The files into `folder` (they name each other by file name, so any folder does)."""
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def scaled(result: Measurement, cfg) -> Measurement:
    """A measurement of the probe's short step, as the candidate's: N micro-steps plus one optimizer step."""
    if result.status != OK:
        return result
    step = cfg.grad_accum * result.micro_step_s + result.optimizer_step_s
    tokens_per_micro = result.tokens_per_s * result.step_time_s / max(1, min(cfg.grad_accum, PROBE_ACCUMULATION))
    return result.model_copy(update={"step_time_s": step, "tokens_per_s": tokens_per_micro * cfg.grad_accum / step})


__all__ = ["Prober", "run_training", "run_group", "accelerate_command", "DEFAULT_TIMEOUT_S", "probe_files"]
