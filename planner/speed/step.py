"""An optimizer step's time: grad_accum micro-steps, the optimizer, the communication and offload they do not hide,
and torch.compile's compile time spread over the run."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict

from planner import facts
from planner.config import Config
from planner.hardware import GPU
from planner.hardware.efficiency_data import Efficiency
from planner.models.spec import ModelSpec
from planner.program.compiled import BACKWARD, FORWARD, CompileEffect
from planner.program.float8 import Float8Linears, converts
from planner.program.profile import Profile
from planner.program.sequence import sequence_split_share
from planner.speed.communication import (
    collectives, contention_seconds, offload_seconds, sequence_split_seconds, tensor_parallel_seconds,
)
from planner.speed.kernels import (
    MicroStep, dequantize_seconds, float8_cast_time, float8_gemm_change, micro_step,
)
from planner.speed.optimizer import optimizer_step
from planner.vocab import CHECKPOINTING, FUSED_STEP, AdamStep

class StepParts(BaseModel):
    """Seconds per optimizer step, by what they are spent on."""

    model_config = ConfigDict(frozen=True)

    compute: float = 0.0
    optimizer: float = 0.0
    communication: float = 0.0
    offload: float = 0.0
    #: torch.compile's first-step compile time spread over the run's optimizer steps (0: eager, or run length unknown)
    compile: float = 0.0
    #: that first step's compile time itself, paid once per run (not part of `total`)
    compile_once: float = 0.0
    #: one micro-step's GPU kernel time and CPU dispatch time as modelled, before any probe calibration (`compute`
    #: takes the longer per micro-step, plus `micro_wait`; not part of `total`)
    micro_gpu: float = 0.0
    micro_cpu: float = 0.0
    #: what the host's waits for the GPU within a micro-step add to it (Liger's fused loss reads a count with
    #: `.item()`): the work before the wait and after it overlap apart (not part of `total`)
    micro_wait: float = 0.0
    #: all the step's collectives, hidden or not (not part of `total`): the data-parallel and sharding ones, of which
    #: `communication` holds what the compute does not hide plus what the hidden ones slow it by (their NCCL blocks
    #: hold SMs), and the tensor-parallel and sequence-split exchanges the micro-steps wait for (inside `compute`)
    communication_total: float = 0.0

    def bound(self) -> str | None:
        """What binds a micro-step as modelled: the GPU's kernels or the CPU's dispatch of them (None: not
        modelled, as for a measured step)."""
        if not (self.micro_gpu or self.micro_cpu):
            return None
        return "CPU-bound" if self.micro_cpu > self.micro_gpu else "GPU-bound"

    @property
    def total(self) -> float:
        return self.compute + self.optimizer + self.communication + self.offload + self.compile

    def scaled(self, factor: float) -> "StepParts":
        """Every part of the step's total `factor` times as long (what a correction of the whole step's time does to
        where it goes); the modelled micro-step and the compile time paid once stay as modelled."""
        return self.model_copy(update={"compute": self.compute * factor, "optimizer": self.optimizer * factor,
                                       "communication": self.communication * factor, "offload": self.offload * factor,
                                       "compile": self.compile * factor})


class ThroughputInfo(BaseModel):
    """A configuration's speed: tokens and samples per second, model FLOPs utilisation, the optimizer step's time and
    where it goes."""

    model_config = ConfigDict(frozen=True)

    tokens_per_s: float
    samples_per_s: float
    mfu: float
    step_time_s: float
    #: model: the speed model alone; corrected: the model times the median error of measured runs like it
    #: (planner/uncertainty.py); calibrated: the model rescaled by this GPU's probes; receipts: rescaled by earlier
    #: runs of this very model on this GPU; probe: measured; probe+model: measured on fewer ranks, the modelled
    #: communication added
    source: Literal["model", "corrected", "calibrated", "receipts", "probe", "probe+model"] = "model"
    parts: StepParts = StepParts()
    #: tokens of data per second, padding left out (None: every sample fills its row, as without a dataset)
    real_tokens_per_s: float | None = None
    #: the FLOPs the GPU executes (recomputation included, masked attention tiles skipped) over its dense peak
    hfu: float = 0.0
    #: the step time on the fastest and on the slowest host behind the usual system's host figures (facts
    #: `host.dispatch_us_range`): how much of the step's time turns on a host the plan did not measure. None where the
    #: host was measured where the plan runs, or the step was not modelled (a probe's)
    step_time_fast_host_s: float | None = None
    step_time_slow_host_s: float | None = None
    #: the speed model's own step time where measurements or measured errors corrected `step_time_s` (None: it is
    #: the model's)
    model_step_time_s: float | None = None

    @property
    def modelled_step_time_s(self) -> float:
        """The speed model's own step time, before any correction."""
        return self.step_time_s if self.model_step_time_s is None else self.model_step_time_s

    def corrected(self, step_s: float, source: str, parts: StepParts | None = None) -> "ThroughputInfo":
        """The same step corrected to take `step_s` seconds by `source` (its parts and its step on other hosts
        rescaled alike unless given), keeping the model's own step time."""
        scale = step_s / self.step_time_s if self.step_time_s > 0 else 1.0
        parts = parts if parts is not None else self.parts.scaled(scale)
        hosts = {name: (value * scale if value is not None else None) for name, value in
                 (("step_time_fast_host_s", self.step_time_fast_host_s),
                  ("step_time_slow_host_s", self.step_time_slow_host_s))}
        return self.at_step_time(step_s, parts=parts, source=source, model_step_time_s=self.modelled_step_time_s,
                                 **hosts)

    @property
    def host_spread(self) -> tuple[float, float]:
        """The step on the fastest and on the slowest known host over the planned one (1, 1: the host was measured
        here, or the step is not modelled)."""
        if self.step_time_fast_host_s is None or self.step_time_slow_host_s is None or self.step_time_s <= 0:
            return 1.0, 1.0
        return self.step_time_fast_host_s / self.step_time_s, self.step_time_slow_host_s / self.step_time_s

    @property
    def useful_tokens_per_s(self) -> float:
        """What candidates are ranked by: tokens of data per second."""
        return self.tokens_per_s if self.real_tokens_per_s is None else self.real_tokens_per_s

    def at_step_time(self, step_s: float, **update) -> "ThroughputInfo":
        """The same step's work done in `step_s` seconds: every rate rescaled (`update` sets other fields)."""
        ratio = self.step_time_s / step_s if step_s > 0 else 1.0
        real = None if self.real_tokens_per_s is None else self.real_tokens_per_s * ratio
        hosts = {f"step_time_{end}_host_s": None if getattr(self, f"step_time_{end}_host_s") is None
                 else getattr(self, f"step_time_{end}_host_s") / ratio for end in ("fast", "slow")}
        return self.model_copy(update={"tokens_per_s": self.tokens_per_s * ratio, "real_tokens_per_s": real,
                                       "samples_per_s": self.samples_per_s * ratio, "mfu": self.mfu * ratio,
                                       "hfu": self.hfu * ratio, "step_time_s": step_s, **hosts, **update})


@dataclass(frozen=True)
class StepSize:
    """What one optimizer step trains: samples of data, tokens computed (padding included) and tokens of data."""

    samples: float
    tokens: float
    real_tokens: float


def matmul_parameters(spec: ModelSpec) -> int:
    """Parameters that take part in matmuls per token: all but the embedding lookups, plus the LM head
    when it shares the embedding; for MoE only the experts a token is routed to."""
    params = spec.active_parameters - spec.embedding_parameters
    if spec.tied_embeddings and spec.vocab and spec.has_lm_head:
        params += spec.vocab * spec.hidden
    if spec.num_experts > 1 and not spec.expert_parameters:  # experts not found by name: from the config's shapes
        per_expert = (3 if spec.gated_mlp else 2) * spec.hidden * spec.ffn
        params -= spec.layers * per_expert * (spec.num_experts - spec.experts_per_token)
    return max(params, 1)


def flops_per_token(spec: ModelSpec, seq_len: int, checkpointing: str | None = None) -> tuple[float, float]:
    """FLOPs per token of a training step as (dense, attention). Dense: forward 2N over the parameters a token's
    matmuls run through (`matmul_parameters`: N active for MoE), backward 4N for trainable weights and 2N for frozen
    ones (adapters: no weight gradient). Attention: 4·L·h·s forward and twice that backward (PaLM appendix B's
    12·L·h·s). With `checkpointing=None` that is the model's FLOPs, MFU's count. Given a mode, it is what the GPU
    executes: the forward matmuls recomputation repeats (all under full checkpointing, every second under selective,
    torchtitan's per-op policy: planner/program/step.py) and causal attention at half (the kernels skip the masked
    score tiles), the share of the model's attention that is causal (`ModelSpec.causal_attention`)."""
    matmul = matmul_parameters(spec)
    frozen = max(0, matmul - spec.trainable_parameters)
    dense, attention = 6.0 * matmul - 2.0 * frozen, 12.0 * spec.layers * spec.hidden * seq_len
    if checkpointing is None:
        return dense, attention
    info = CHECKPOINTING[checkpointing]
    full = info.enabled and not info.per_op_policy  # selective keeps the attention kernel's outputs
    recomputed = 1.0 if full else 0.5 if info.enabled else 0.0
    attention *= (1.0 - spec.causal_attention / 2) * (4.0 / 3.0 if full else 1.0)
    return dense + recomputed * 2.0 * matmul, attention


def compiled_profile(profile: Profile, effect: CompileEffect) -> Profile:
    """The eager step's profile under torch.compile: Inductor's fusion of the memory-bound kernels per phase."""
    phases = (FORWARD, BACKWARD)
    return profile.compiled({p: effect.phase(p).bytes_ratio for p in phases},
                            {p: effect.phase(p).kernel_ratio for p in phases})


@dataclass(frozen=True)
class SpeedSetup:
    """What a step is timed on besides its configuration: the model at its sequence length, the GPU with its measured
    rates, the node, the optimizer and how an Adam-family one runs (`vocab.ADAM_STEP`: the emitted files' fused
    kernel by default), and the run's optimizer steps (over which torch.compile's compile time is spread)."""

    spec: ModelSpec
    gpu: GPU
    eff: Efficiency
    seq_len: int
    gpus_per_node: int
    optimizer: str
    adam_step: AdamStep = FUSED_STEP
    train_steps: int | None = None
    #: traced micro-steps already timed (`step_time`): a search times many configurations sharing one. Not
    #: an argument: a setup made from this one (`dataclasses.replace`, another Efficiency) times afresh
    timed: dict = field(default_factory=dict, init=False, compare=False, repr=False)


@dataclass(frozen=True)
class TracedStep:
    """The op profile of a configuration's micro-step, traced at `micro_batch`; `tp_share`: the share of the unsplit
    model's activation bytes a tensor-parallel rank keeps; `compile_effect`: what torch.compile changes (None: eager,
    or a graph that could not be captured)."""

    profile: Profile
    micro_batch: int
    tp_share: float = 1.0
    compile_effect: CompileEffect | None = None


def step_time(setup: SpeedSetup, cfg: Config, traced: TracedStep) -> ThroughputInfo:
    """The optimizer step's time for `cfg`. A compiled step runs Inductor's fused kernels, and its checkpointed blocks
    recompute inside the compiled backward graph, without torch.utils.checkpoint's host work; its device time carries
    the measured residual (`inductor.compiled_device_residual`). Records the GPU's efficiency figures as read (the
    setup holds them across calls). Where the host was not measured, the step is also timed on the fastest and the
    slowest known host (`host_range`)."""
    spec = setup.spec
    setup.eff.record()
    micro, compile_once = _micro_step(setup, cfg, traced)
    share = _memo(setup.timed if micro.profile is traced.profile else {}, ("backward", id(micro.profile)),
                  micro.profile, _backward_share)
    parts = step_parts(setup, cfg, micro.step, share, compile_once)
    total = parts.total
    tokens = cfg.global_batch * setup.seq_len
    peak = setup.gpu.peak_tflops(cfg.precision) * 1e12 * cfg.world_size
    model_flops, executed = (sum(flops_per_token(spec, setup.seq_len, mode)) * tokens
                             for mode in (None, cfg.checkpointing))
    fast, slow = host_range(setup, cfg, micro.step, share, compile_once)
    return ThroughputInfo(tokens_per_s=tokens / total, samples_per_s=cfg.global_batch / total,
                          mfu=model_flops / total / peak, hfu=executed / total / peak, step_time_s=total, parts=parts,
                          step_time_fast_host_s=fast, step_time_slow_host_s=slow)


@dataclass(frozen=True)
class _Timed:
    step: MicroStep
    profile: Profile    # the profile it was timed from (a compiled step's is made for the call)


def _micro_step(setup: SpeedSetup, cfg: Config, traced: TracedStep) -> tuple[_Timed, float]:
    """One micro-step of `cfg` with the collectives it waits for, and torch.compile's one-off compile time."""
    spec, gpu, eff, profile = setup.spec, setup.gpu, setup.eff, traced.profile
    blocks = spec.layers if CHECKPOINTING[cfg.checkpointing].enabled else 0
    compile_once, residual = 0.0, 1.0
    if cfg.compiled and traced.compile_effect is not None:
        profile, blocks = compiled_profile(profile, traced.compile_effect), 0
        residual = facts.get("inductor.compiled_device_residual")
        compile_once = traced.compile_effect.compile_seconds(spec.layers)
    scale = cfg.micro_batch / traced.micro_batch * sequence_split_share(cfg)  # a rank's share of the tokens
    # configurations differing only in sharding, offload or accumulation share a traced micro-step; a compiled
    # step's profile is made for this call, so its timing is kept nowhere
    timed = setup.timed if profile is traced.profile else {}
    key = (id(profile), scale, cfg.precision, blocks, cfg.tensor_parallel, traced.tp_share)
    micro = _memo(timed, key, profile, lambda p: micro_step(p, scale, cfg.precision, gpu, eff, blocks,
                                                            cfg.tensor_parallel, traced.tp_share))
    extra = dequantize_seconds(spec, cfg, gpu, eff) + tensor_parallel_seconds(spec, cfg, setup.seq_len,
                                                                               setup.gpus_per_node, gpu, eff)
    extra += sequence_split_seconds(spec, cfg, setup.seq_len, setup.gpus_per_node, gpu, eff)
    micro = replace(micro, gpu_s=micro.gpu_s * residual + extra)
    if converts(cfg):
        micro = _with_float8(micro, setup, cfg, traced, profile, scale)
    return _Timed(step=micro, profile=profile), compile_once


def step_parts(setup: SpeedSetup, cfg: Config, micro: MicroStep, backward_share: float, compile_once: float,
               host_scale: float = 1.0) -> StepParts:
    """Where an optimizer step of `cfg` goes, its micro-step `micro`, on a host `host_scale` times as slow as the
    setup's (the optimizer's host side with it)."""
    spec, gpu, eff = setup.spec, setup.gpu, setup.eff
    micro = micro.on_host(host_scale) if host_scale != 1.0 else micro
    optimizer = optimizer_step(spec, cfg, setup.optimizer, gpu, eff, setup.gpus_per_node, setup.adam_step)
    backward = micro.seconds * backward_share
    comm = collectives(spec, cfg, setup.gpus_per_node, backward, micro.seconds, gpu, eff)
    in_compute = cfg.grad_accum * (tensor_parallel_seconds(spec, cfg, setup.seq_len, setup.gpus_per_node, gpu, eff)
                                   + sequence_split_seconds(spec, cfg, setup.seq_len, setup.gpus_per_node, gpu, eff))
    return StepParts(
        compute=cfg.grad_accum * micro.seconds, optimizer=optimizer.on_host(host_scale).seconds,
        communication=comm.exposed + contention_seconds(comm.hidden, gpu, eff),
        offload=offload_seconds(spec, cfg, gpu, eff),
        compile=compile_once / setup.train_steps if setup.train_steps else 0.0, compile_once=compile_once,
        micro_gpu=micro.gpu_s, micro_cpu=micro.cpu_s, micro_wait=micro.wait_s,
        communication_total=comm.total + in_compute)


def host_range(setup: SpeedSetup, cfg: Config, micro: MicroStep, backward_share: float,
               compile_once: float) -> tuple[float | None, float | None]:
    """The step time on the fastest and the slowest host behind the usual systems' figures (`host.dispatch_us_range`,
    each host's costs in proportion to its kernel dispatch); (None, None) where the host was measured here."""
    if setup.eff.host_measured:
        return None, None
    return tuple(step_parts(setup, cfg, micro, backward_share, compile_once, dispatch / setup.eff.dispatch_us).total
                 for dispatch in facts.get("host.dispatch_us_range"))


def _memo(timed: dict, key: tuple, profile: Profile, compute):
    """`compute(profile)` kept in `timed` under `key` and the facts overridden here, with the facts it read
    (`facts.cached`) and the profile itself, whose id the key holds: a profile made later under a freed one's id is
    timed anew."""
    key += (facts.overridden(),)
    found = timed.get(key)
    if found is not None and found[0][0] is not profile:
        del timed[key]
    return facts.cached(timed, key, lambda: (profile, compute(profile)))[1]


def _with_float8(micro: MicroStep, setup: SpeedSetup, cfg: Config, traced: TracedStep, profile: Profile,
                 scale: float) -> MicroStep:
    """A micro-step with its converted GEMMs at the FP8 rate and the float8 casts beside them."""
    float8, gpu, eff = Float8Linears.of(setup.spec), setup.gpu, setup.eff
    gemms = float8_gemm_change(profile, scale, cfg.precision, gpu, eff, float8)
    casts = float8_cast_time(float8, cfg.micro_batch * setup.seq_len * sequence_split_share(cfg), cfg.weight_bytes(),
                             cfg.compiled and traced.compile_effect is not None, gpu, eff)
    return replace(micro, gpu_s=micro.gpu_s + gemms + casts.gpu_s, cpu_s=micro.cpu_s + casts.cpu_s)


def _backward_share(profile: Profile) -> float:
    """The backward's share of a micro-step's GEMM FLOPs (the time collectives can hide behind)."""
    total = backward = 0.0
    for count, dims, _dtype, phase, _scaled in profile.gemms():
        work = count * math.prod(dims)
        total += work
        backward += work if phase == "backward" else 0.0
    return backward / total if total else 2.0 / 3.0
