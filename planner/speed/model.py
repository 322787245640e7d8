"""Modelled speed of candidates: the op profile of the model's traced micro-step (one per checkpointing mode and
traced program), timed on the GPU with its measured efficiencies (planner/speed/step.py). Probes rescale it afterwards
(planner/refine.py)."""

from __future__ import annotations

from dataclasses import replace

from planner import facts
from planner.config import Config
from planner.hardware import GPU
from planner.hardware.efficiency_data import efficiency_of
from planner.memory.analytic import tensor_parallel_share
from planner.program.profile import Profile, analytic_profile
from planner.program.trace import TRACED_LAYERS_ALTERNATING, TraceRequest, cached_trace, prefetch_traces
from planner.program.workload import Workload
from planner.speed.step import SpeedSetup, StepSize, ThroughputInfo, TracedStep, step_time
from planner.vocab import CHECKPOINTING, FUSED_STEP, NO_CHECKPOINTING, AdamStep


class SpeedModel:
    """Times configurations of one workload on `gpu`, `gpus_per_node` to a node; `train_steps` spreads compile time
    over the run; `adam_step` is how an Adam-family step runs (`vocab.ADAM_STEP`: the emitted files' fused kernel
    unless the caller's program runs another)."""

    def __init__(self, workload: Workload, gpu: GPU, gpus_per_node: int, train_steps: int | None = None,
                 adam_step: AdamStep = FUSED_STEP):
        self.workload, self.gpu, self.gpus_per_node = workload, gpu, gpus_per_node
        self.setup = SpeedSetup(spec=workload.spec, gpu=gpu, eff=efficiency_of(gpu), seq_len=workload.seq_len,
                                gpus_per_node=gpus_per_node, optimizer=workload.optimizer, adam_step=adam_step,
                                train_steps=train_steps)
        self._profiles: dict = {}  # trace family -> (profile and its micro-batch, facts it read)

    @property
    def eff(self):
        return self.setup.eff

    def profile(self, cfg: Config) -> tuple[Profile, int]:
        """The traced op profile of `cfg`'s program and the micro-batch it was traced at (the formulas' profile where
        the model cannot be traced)."""
        def traced_or_analytic() -> tuple[Profile, int]:
            found = speed_profile(self.workload, cfg)
            return found or analytic_profile(self.workload.spec, self.workload.seq_len, cfg.checkpointing)

        return facts.cached(self._profiles, cfg.trace_family(), traced_or_analytic)

    def traced_step(self, cfg: Config) -> TracedStep:
        profile, anchor = self.profile(cfg)
        share = tensor_parallel_share(self.workload, cfg) if cfg.tensor_parallel > 1 else 1.0
        effect = self.workload.compile_effect(cfg) if cfg.compiled else None
        return TracedStep(profile=profile, micro_batch=anchor, tp_share=share, compile_effect=effect)

    def __call__(self, cfg: Config) -> ThroughputInfo:
        return step_time(self.setup, cfg, self.traced_step(cfg))

    def step_size(self, cfg: Config) -> StepSize:
        """Every row is one sample filling the sequence."""
        tokens = cfg.global_batch * self.workload.seq_len
        return StepSize(samples=cfg.global_batch, tokens=tokens, real_tokens=tokens)

    def attention_length(self, cfg: Config) -> float:
        """The keys a token's attention runs over at most (before the causal mask)."""
        return self.workload.seq_len

    def prefetch(self, configs) -> None:
        """Trace the speed profiles `configs` need side by side where cores are spare (planner/program/trace.py
        `prefetch_traces`); `profile` then finds them cached."""
        resolved = self.workload.resolved
        if resolved.config is None:
            return
        requests = {speed_request(self.workload, cfg) for cfg in configs}
        try:
            prefetch_traces(resolved.config, resolved.spec.config_hash,
                            [(depth, req, True) for req in requests for depth in _traced_depths(resolved.config)],
                            resolved.trust_remote_code)
        except Exception:  # noqa: BLE001 - `profile` meets the failure again and falls back per program
            pass


def speed_profile(workload: Workload, cfg: Config) -> tuple[Profile, int] | None:
    """The op profile of one micro-step of `cfg`'s program (its weights' dtype and autocast, its attention kernel, its
    checkpointing) and the micro-batch it was traced at; None when the model cannot be traced. The step is traced once
    without checkpointing at one and two blocks; recomputation adds the traced forward of a block per block: all of it
    for full checkpointing, and for selective (torchtitan's per-op policy, planner/program/step.py) its non-matmul ops
    and every second matmul, the attention kernel's outputs being kept, every op of the block passing the policy's
    dispatch mode twice."""
    spec, resolved = workload.spec, workload.resolved
    if resolved.config is None:
        return None
    req = speed_request(workload, cfg)
    try:
        (l1, p1), (l2, p2) = speed_trace_profiles(resolved, req)
    except Exception:  # noqa: BLE001 - an untraceable model gets the formula profile
        return None
    base = p1.extrapolated(p2, l1, l2, spec.layers)
    info = CHECKPOINTING[cfg.checkpointing]
    if not info.enabled:
        return base, req.micro_batch
    block = p2.minus(p1)
    blocks = spec.layers / max(1, l2 - l1)
    if info.per_op_policy:
        return base.scaled_add(block, blocks, matmul_factor=blocks / 2, attention=False, policy=True), req.micro_batch
    return base.scaled_add(block, blocks), req.micro_batch


def speed_request(workload: Workload, cfg: Config) -> TraceRequest:
    """The traced program of `cfg`'s speed profile: its micro-step at the anchor micro-batch, without checkpointing
    (recomputation is added per block), mid-accumulation."""
    return replace(workload.request(cfg), micro_batch=speed_anchor_micro_batch(workload.spec, workload.seq_len),
                   checkpointing=NO_CHECKPOINTING, grads_allocated=True)


def speed_trace_profiles(resolved, req: TraceRequest) -> tuple[tuple[int, Profile], tuple[int, Profile]]:
    """The speed trace at the smallest depths that show one block (1 and 2; 2 and 4 where blocks alternate), also
    for models shallower than that (the profile is extrapolated to their depth). One block less than the deeper
    trace is that trace without its last block's ops, where its blocks were found (`TracePoint.shallower`)."""
    spec = resolved.spec

    def traced(depth: int):
        return cached_trace(resolved.config, spec.config_hash, depth, req, resolved.trust_remote_code, profile=True)

    shallow, deep = speed_depths(resolved.config)
    point = traced(deep)
    below = point.shallower if _traced_depths(resolved.config) == (deep,) else None
    return ((shallow, Profile.from_json(below if below is not None else traced(shallow).profile)),
            (deep, Profile.from_json(point.profile)))


def speed_depths(config) -> tuple[int, int]:
    """The depths of the speed trace: 1 and 2 blocks, 2 and 4 where blocks alternate."""
    kinds = getattr(config, "layer_types", None)
    return TRACED_LAYERS_ALTERNATING if kinds and len(set(kinds)) > 1 else (1, 2)


def _traced_depths(config) -> tuple[int, ...]:
    """The depths `prefetch` traces: the deeper alone where the shallower is one block less (read from its trace)."""
    shallow, deep = speed_depths(config)
    return (deep,) if deep - shallow == 1 else (shallow, deep)


def speed_anchor_micro_batch(spec, seq_len: int) -> int:
    """The micro-batch a speed profile is traced at: the smallest from 2 whose token count equals no dimension of
    the model's weights, so that the profile can tell token-proportional dimensions from the weights' own."""
    dims = {spec.hidden, spec.ffn, spec.vocab, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim,
            2 * spec.ffn, 3 * spec.hidden, spec.hidden + 2 * spec.kv_heads * spec.head_dim, spec.num_labels}
    return next(b for b in range(2, 64) if b * seq_len not in dims)
