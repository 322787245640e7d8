"""Activations by tracing the real model's training step under FakeTensorMode on the CPU.

Nothing is allocated: every tensor is fake, yet the live-storage accounting of `LiveStorageTracker`
matches a real step. A trace runs one forward+backward, with the gradients already allocated (every micro-batch
after the first of an accumulation cycle) or not (the first, whose backward allocates them), and measures the
peak above the model states present: the activations, in the broad sense of everything the step allocates and
frees (saved tensors, autocast weight copies, logits, the loss's scratch). Asked to, it also records the step's
op profile (planner/program/profile.py) for the speed model.

Models are traced at two depths at the micro-batch asked for and extrapolated per block (`TraceFit`);
with `batch_slope` two micro-batches more give the per-sample slope too. The model states themselves are
always computed exactly by `states.py` from the full parameter count. Results are cached in memory and on
disk (JSON).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import asdict, dataclass, replace

from planner.cache import load_json, store_json
from planner.allocator import replay
from planner.models.build import build_meta, with_layers
from planner.program.autocast import cuda_autocast_rules
from planner.program.dropout import fused_dropout
from planner.program.forked import map_forked, worker_count
from planner.program.liger import CACHE_VERSION as LIGER_CACHE_VERSION
from planner.program.liger import patches_for, stand_ins, unwrap
from planner.program.profile import OpRecorder
from planner.program.regions import Template, block_regions
from planner.program.step import enable_checkpointing, forward_loss, make_batch
from planner.program.tracker import LiveStorageTracker
from planner.vocab import ACTIVATIONS, KERNEL, LABELS_OBJECTIVE, task_of_class

#: Block counts traced for the per-block slope. From 3 blocks on, the moment of the peak (end of the
#: forward, or the loss's backward) no longer moves with depth, so the slope holds for any depth; 2 and 4
#: for models whose blocks alternate (Gemma-2's sliding/global layers), so one step spans both kinds.
TRACED_LAYERS = (3, 4)
TRACED_LAYERS_ALTERNATING = (2, 4)
#: The micro-batch slope is measured between the anchor micro-batch b and b + 1. Activations are convex in
#: b (the peak is the max over the step's moments, and the moment can move as b grows), so a fit is exact
#: at its anchor and a lower bound far from it: callers anchor at the micro-batch they need.
CACHE_VERSION = 29


@dataclass(frozen=True)
class TracePoint:
    """One trace: the activation peak above the model states, and what the CUDA caching allocator's statistics would
    add to the step's live bytes (the step's allocations and frees replayed through planner/allocator.py,
    which rounds blocks, carves segments and leaves the gaps the step's order leaves)."""

    activations: int
    slack: int              # max_memory_reserved - max_memory_allocated of the step's replay
    #: planner.program.profile.Profile as JSON: the step's ops, for the speed model; None where the trace was run for
    #: its memory alone (recording the ops costs a tenth of a trace)
    profile: dict | None
    forward: int = 0        # the peak while the forward and the loss run (`activations` is the larger of the two)
    backward: int = 0       # the peak while the backward runs
    #: the step's allocations and frees with where in the model each happened (planner/memory/whole_run.py
    #: `Template.to_json`), from which the whole run at full depth is written; None where the blocks were not found
    template: dict | None = None
    rounding: int = 0       # max_memory_allocated - the bytes requested, of the step's replay (AllocatorStats.rounding)
    #: the op profile without the last block's ops: the same step's profile one block shallower (None where ops
    #: were not recorded or the blocks not found), so a speed profile's two depths take one trace
    shallower: dict | None = None


@dataclass(frozen=True)
class TraceFit:
    """Activation bytes above the live model states as a function of blocks L and micro-batch b:

        act(L, b) = fixed + per_sample * b + L * (block_fixed + block_per_sample * b)

    `block_fixed` is autocast's cached 16-bit weight copies; `fixed` the embeddings' copies and loss
    scratch; the per-sample terms are saved activations and logits. Measured at two block counts and two
    micro-batches (four small traces), exact where the model is traced whole.
    """

    fixed: float
    per_sample: float
    block_fixed: float
    block_per_sample: float
    layers_traced: tuple[int, ...]
    #: reserved - allocated of the step's own allocations at the anchor micro-batch, at any depth: the traced depth's
    #: whose reserved is the larger (with `rounding`, allocated - requested, of the same replay). It does not grow
    #: with depth: the gaps are left by the step's largest transients (logits, the loss, a block's scratch), which
    #: later blocks reuse; traced bloom-560m at seq 2048 (mb 4, selective) gives 7.1, 6.9, 7.8, 7.4 and 7.5 GB at 2,
    #: 3, 4, 6 and all 24 blocks, so a per-block slope would extrapolate noise (+17 GB at 24 blocks).
    slack: int = 0
    rounding: int = 0
    #: The forward phase's own fit, where the phases were fitted apart (this one's coefficients are then the
    #: backward's). The step's peak is the larger of the two phases' peaks, and which phase holds it can change with
    #: depth: under full checkpointing autocast's 16-bit weight copies stay cached for the whole forward (the
    #: outermost autocast clears them on exit, torch/amp/autocast_mode.py `__exit__`), so the forward peak grows by
    #: a block's weights per block while the backward's grows by a checkpoint input. Llama-3.2-1B at seq 2048
    #: peaks in the backward at 2 and 4 blocks and in the forward's loss at 16 (measured on an H100,
    #: benchmarks/results/gpu_memory_peak-H100-80GB-2026-11-23.json): a single fit of the peak extrapolated the
    #: backward's slope and missed 1.4 GiB.
    forward: "TraceFit | None" = None

    def activations(self, layers: int, micro_batch: int) -> int:
        value = self.fixed + self.per_sample * micro_batch + layers * (self.block_fixed + self.block_per_sample * micro_batch)
        own = max(0, int(round(value)))
        return max(own, self.forward.activations(layers, micro_batch)) if self.forward else own

    @staticmethod
    def from_points(l1: int, l2: int, b1: int, b2: int, a11: int, a12: int, a21: int, a22: int) -> "TraceFit":
        """a_ij = act(l_i, b_j); solves the four coefficients exactly."""
        dl, db = l2 - l1, b2 - b1
        block_per_sample = ((a22 - a21) - (a12 - a11)) / (dl * db)
        per_sample_at_l1 = (a12 - a11) / db                # per_sample + l1 * block_per_sample
        block_at_b1 = (a21 - a11) / dl                     # block_fixed + b1 * block_per_sample
        block_fixed = block_at_b1 - b1 * block_per_sample
        per_sample = per_sample_at_l1 - l1 * block_per_sample
        fixed = a11 - per_sample * b1 - l1 * (block_fixed + block_per_sample * b1)
        return TraceFit(fixed, per_sample, block_fixed, block_per_sample, (l1, l2))


@dataclass(frozen=True)
class TraceRequest:
    micro_batch: int
    seq_len: int
    activations: str        # `Config.activation_family()`: the model's weight dtype and whether autocast runs
    checkpointing: str
    attention: str          # the kernel the step runs (`vocab.KERNEL`), which the trace reproduces
    attention_dropout: bool  # False reproduces GPU flash/mem-efficient kernels (dropout inside the kernel)
    objective: str = LABELS_OBJECTIVE  # what the backward starts from (`vocab.OBJECTIVE`)
    #: gradients exist before the step (every micro-step after the first of an accumulation); without, the
    #: backward allocates them as it goes and the peak above the weights includes those made by then
    grads_allocated: bool = True
    #: the device whose rules the traced step follows: "cuda" applies CUDA's autocast op lists
    #: (planner/program/autocast.py), runs dropout as CUDA's fused kernel (planner/program/dropout.py) and counts the
    #: operand copies its matmuls make (planner/program/tracker.py); "cpu" keeps the CPU's own
    autocast_device: str = "cpu"
    #: LoRA / QLoRA adapters peft injects (planner.models.adapters.Adapter); None trains the whole model
    adapter: object = None
    #: the 16-bit dtype (a `torch` attribute name) of the step's half weights and of its autocast: the bytes are
    #: bf16's either way, the program is not (model code branches on float16: OPT's eager attention upcasts its
    #: softmax to fp32 only for fp16 weights, transformers 4.46.3 models/opt/modeling_opt.py line 207)
    half_dtype: str = "bfloat16"
    #: the model config's `use_cache` in the traced program. A model that returns its decoding cache keeps the
    #: cache's tensors while its outputs live; most cache tensors the attention saves anyway, some not (GPT-NeoX in
    #: transformers 4.42.4 caches its key rotated in fp32 and hands SDPA a 16-bit copy: modeling_gpt_neox.py
    #: `_attn_projections_and_rope`, `present = (key, value)`, and `GPTNeoXSdpaAttention.forward`'s cast)
    use_cache: bool = False
    #: Liger-Kernel's patches run in place of the model's norms, MLPs and loss (planner/program/liger.py)
    liger: bool = False

    @property
    def half_weights(self) -> bool:
        """The model runs with 16-bit weights (bf16-true, or a ZeRO/FSDP engine's working copy)."""
        return ACTIVATIONS[self.activations].half_weights

    @property
    def autocast(self) -> str | None:
        """The autocast dtype the traced step runs under."""
        return self.half_dtype if ACTIVATIONS[self.activations].autocast else None


_memory_cache: dict[str, TracePoint] = {}


def trace_key(config_hash: str, layers: int, req: TraceRequest) -> str:
    import torch
    import transformers

    # Liger's stand-ins version only the traces that run them: every other key is as before
    liger = [LIGER_CACHE_VERSION] if req.liger else []
    text = json.dumps([CACHE_VERSION, config_hash, layers, asdict(req), torch.__version__, transformers.__version__]
                      + liger)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def traced_layers(config, total_layers: int) -> tuple[int, ...]:
    """The depths a fit traces: two, or the whole model once where it is no deeper than the deeper of them."""
    kinds = getattr(config, "layer_types", None)
    pair = TRACED_LAYERS_ALTERNATING if kinds and len(set(kinds)) > 1 else TRACED_LAYERS
    return pair if total_layers > pair[1] else (total_layers,)


def trace_activations(config, config_hash: str, total_layers: int, req: TraceRequest,
                      trust_remote_code: bool = False, batch_slope: bool = True) -> TraceFit:
    """Fit of the activations over depth (and micro-batch), exact at `req.micro_batch` (the anchor), with the
    allocator's slack at the anchor. The forward's and the backward's peaks are fitted apart and the larger taken.

    Without `batch_slope` only the anchor micro-batch is traced (2 traces instead of 4) and the fit is
    valid at that micro-batch alone."""
    depths = traced_layers(config, total_layers)
    b1, b2 = req.micro_batch, req.micro_batch + 1
    prefetch_traces(config, config_hash, _fit_jobs(depths, req, batch_slope), trust_remote_code)
    anchor = [cached_trace(config, config_hash, layers, req, trust_remote_code) for layers in depths]
    more = [cached_trace(config, config_hash, layers, replace(req, micro_batch=b2), trust_remote_code)
            for layers in depths] if batch_slope else None
    widest = max(anchor, key=lambda point: point.slack + point.rounding)
    backward = _phase_fit(depths, (b1, b2), anchor, more, lambda p: p.backward)
    return replace(backward, slack=widest.slack, rounding=widest.rounding,
                   forward=_phase_fit(depths, (b1, b2), anchor, more, lambda p: p.forward))


def _fit_jobs(depths: tuple[int, ...], req: TraceRequest, batch_slope: bool) -> list[tuple[int, TraceRequest, bool]]:
    """The traces `trace_activations` fits through, as `prefetch_traces` jobs."""
    batches = (req.micro_batch, req.micro_batch + 1) if batch_slope else (req.micro_batch,)
    return [(layers, replace(req, micro_batch=b), False) for b in batches for layers in depths]


def _phase_fit(depths: tuple[int, ...], batches: tuple[int, int], anchor: list[TracePoint],
               more: list[TracePoint] | None, phase) -> TraceFit:
    """One phase's peak as `TraceFit`'s bilinear form through the traced points (`more`: the same depths at the
    anchor micro-batch + 1, or None for no micro-batch slope)."""
    (b1, b2), (l1, l2) = batches, (depths[0], depths[-1])
    a11, a21 = phase(anchor[0]), phase(anchor[-1])
    if more is None:
        if l1 == l2:
            return TraceFit(float(a11), 0.0, 0.0, 0.0, (l1,))
        per_block = (a21 - a11) / (l2 - l1)
        return TraceFit(a11 - l1 * per_block, 0.0, per_block, 0.0, (l1, l2))
    a12, a22 = phase(more[0]), phase(more[-1])
    if l1 == l2:  # traced whole: only the micro-batch slope is fitted
        per_sample = (a12 - a11) / (b2 - b1)
        return TraceFit(a11 - per_sample * b1, per_sample, 0.0, 0.0, (l1,))
    return TraceFit.from_points(l1, l2, b1, b2, a11, a12, a21, a22)


@dataclass(frozen=True)
class SequenceFit:
    """Activations at a fixed micro-batch and depth as a quadratic in the sequence length: linear terms
    (everything saved per token) plus s^2 (attention scores, where the kernel keeps them)."""

    c0: float
    c1: float
    c2: float
    seq_lens: tuple[int, ...]

    def activations(self, seq_len: int) -> int:
        return max(0, int(round(self.c0 + self.c1 * seq_len + self.c2 * seq_len * seq_len)))


def trace_sequence_fit(config, config_hash: str, total_layers: int, req: TraceRequest,
                       seq_lens: tuple[int, int, int], trust_remote_code: bool = False) -> SequenceFit:
    """Fit act(s) = c0 + c1 s + c2 s^2 through three traced sequence lengths (each at two depths)."""
    depths = traced_layers(config, total_layers)
    prefetch_traces(config, config_hash, [job for s in seq_lens for job in _fit_jobs(depths, replace(req, seq_len=s),
                                                                                     False)], trust_remote_code)
    values = [trace_activations(config, config_hash, total_layers, replace(req, seq_len=s), trust_remote_code,
                                batch_slope=False).activations(total_layers, req.micro_batch) for s in seq_lens]
    (x0, x1, x2), (y0, y1, y2) = seq_lens, values
    # Newton's divided differences: exact through the three points
    d01, d12 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
    c2 = (d12 - d01) / (x2 - x0)
    c1 = d01 - c2 * (x0 + x1)
    c0 = y0 - c1 * x0 - c2 * x0 * x0
    return SequenceFit(c0, c1, c2, tuple(seq_lens))


def cached_trace(config, config_hash, layers, req, trust, profile: bool = False) -> TracePoint:
    """One trace, from the memory or disk cache or run now; with `profile` one that recorded its ops."""
    key = trace_key(config_hash, layers, req)
    result = _lookup(key, profile)
    if result is None:
        result = _remember(key, run_trace(config, layers, req, trust, profile=profile))
    return result


def _lookup(key: str, profile: bool) -> TracePoint | None:
    result = _memory_cache.get(key)
    if result is None:
        stored = load_json("traces", key)
        fields = ("activations", "slack", "rounding", "profile", "forward", "backward")
        if stored is not None and set(fields) <= set(stored):
            result = _memory_cache[key] = TracePoint(**{k: stored[k] for k in fields}, template=stored.get("template"),
                                                     shallower=stored.get("shallower"))
    return None if result is None or (profile and result.profile is None) else result


def _remember(key: str, point: TracePoint) -> TracePoint:
    store_json("traces", key, asdict(point))
    _memory_cache[key] = point
    return point


def prefetch_traces(config, config_hash: str, jobs: list[tuple[int, TraceRequest, bool]], trust: bool = False) -> None:
    """Run the traces among `jobs` ((layers, request, with its op profile) each) that no cache holds, side by side in
    forked processes where cores are spare (planner/program/forked.py), so that `cached_trace` finds them. A job a
    worker could not run is left for `cached_trace` to run, and fail, as it would have."""

    wanted: dict[str, tuple[int, TraceRequest, bool]] = {}
    for layers, req, profile in jobs:  # one run per trace, with its op profile if any job asks for it
        key = trace_key(config_hash, layers, req)
        wanted[key] = (layers, req, profile or (key in wanted and wanted[key][2]))
    todo = [(key, job) for key, job in wanted.items() if _lookup(key, job[2]) is None]
    # deepest first: dealt out in turn, every process gets a like share of the blocks to trace
    todo.sort(key=lambda item: -item[1][0])
    workers = worker_count(len(todo))
    if workers < 2:
        return
    found = map_forked(lambda job: asdict(run_trace(config, job[1][0], job[1][1], trust, profile=job[1][2])),
                       todo, workers)
    for (key, _), point in zip(todo, found):
        if point is not None:
            _remember(key, TracePoint(**point))


def _prepare_config(config, layers, req):
    cfg = with_layers(config, layers)
    if not req.attention_dropout:
        for name in ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob"):
            if isinstance(getattr(cfg, name, None), (int, float)):
                setattr(cfg, name, 0.0)
    cfg._attn_implementation = KERNEL[req.attention].traced_as  # callers resolve the model's support
    if hasattr(cfg, "use_cache"):
        cfg.use_cache = req.use_cache
    return cfg


@contextlib.contextmanager
def _quiet_fake_tensor_errors():
    """An op the model runs that has no meta kernel for these inputs (e.g. `aten._grouped_mm` with fp32 experts) makes
    the trace fail, and the caller falls back to the formulas; torch also logs that failure with its traceback at
    ERROR level (torch/_subclasses/fake_tensor.py `_dispatch_impl`), which is not for a planner's user to read."""
    import logging

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _real_mask_decisions():
    """Let transformers skip the attention mask under fake tensors as it does for real ones.

    transformers decides whether SDPA may run with `is_causal` (no mask tensor) by reading the values of
    the position ids (packed sequences?) and of the padding mask; under FakeTensorMode it cannot, so it
    materialises a mask and SDPA saves more than a real step does (64 KiB per block in a tiny Llama). Our
    batches are neither packed nor padded, so we give the checks the answers real values give: in
    `masking_utils` (transformers 4.53 and later) and, before transformers 5, in `modeling_attn_mask_utils`
    (`AttentionMaskConverter._ignore_causal_mask_sdpa`, and `_prepare_4d_attention_mask_for_sdpa`, which returns
    None for an all-ones mask: transformers 4.46.3 modeling_attn_mask_utils.py lines 284 and 449).
    """
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    fake = (FakeTensor, FunctionalTensor)  # FunctionalTensor: AOTAutograd's capture (planner/program/compiled.py)
    restore: list[tuple[object, str, object]] = []

    def patch(owner, name: str, replacement) -> None:
        restore.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, replacement)

    try:
        from transformers import masking_utils
    except ImportError:  # transformers before 4.53
        masking_utils = None
    for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa"):
        original = getattr(masking_utils, name, None)
        if original is not None:  # a fake padding mask is taken as none: our batches are not padded
            patch(masking_utils, name, _fake_as_none(original, "padding_mask", fake))
    packed = getattr(masking_utils, "find_packed_sequence_indices", None)
    if packed is not None:  # fake position ids: not packed
        patch(masking_utils, "find_packed_sequence_indices", _none_when_fake(packed, "position_ids", fake))
    _patch_legacy_mask_utils(patch, fake)
    try:
        yield
    finally:
        for owner, name, original in reversed(restore):
            setattr(owner, name, original)


@contextlib.contextmanager
def _real_scalar_draws(mode):
    """LayerDrop in transformers 4.x draws a scalar and branches on it (`dropout_probability = torch.rand([])`,
    `if dropout_probability < self.layerdrop`: models/opt/modeling_opt.py lines 912-916 in 4.46.3); a fake scalar
    has no value to compare. Such a draw is made for real and handed to the fake `mode` as a constant, which it
    propagates through the comparison (torch/_subclasses/fake_tensor.py, `_dispatch_impl`'s `all_constant` path)
    as a real step does. Draws of any other shape stay fake."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    original = torch.rand

    def rand(*size, **kwargs):
        shape = size[0] if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)) else size
        if len(shape) != 0:
            return original(*size, **kwargs)
        with unset_fake_temporarily():
            real = original(*size, **{k: v for k, v in kwargs.items() if k != "device"})
        return mode.fake_tensor_converter.from_real_tensor(mode, real, make_constant=True)

    torch.rand = rand
    try:
        yield
    finally:
        torch.rand = original


def _argument(name: str, args: tuple, kwargs: dict):
    """The value of parameter `name`, the function's first, whether passed by keyword or by position."""
    return kwargs[name] if name in kwargs else (args[0] if args else None)


def _fake_as_none(original, name: str, fake):
    """`original` with its first parameter `name` taken as None when it is fake (a mask check answered as for no
    mask). transformers passes it by position in some places and by keyword in others."""
    def wrapper(*args, **kwargs):
        if isinstance(_argument(name, args, kwargs), fake):
            if name in kwargs:
                kwargs[name] = None
            else:
                args = (None, *args[1:])
        return original(*args, **kwargs)

    return wrapper


def _none_when_fake(original, name: str, fake):
    """`original`, answering None without being called when its first parameter `name` is fake."""
    def wrapper(*args, **kwargs):
        return None if isinstance(_argument(name, args, kwargs), fake) else original(*args, **kwargs)

    return wrapper


def _patch_legacy_mask_utils(patch, fake) -> None:
    """transformers 4.x's `modeling_attn_mask_utils` checks, answered as for a real all-ones mask. Model modules
    import `_prepare_4d_attention_mask_for_sdpa` by name, so each loaded one is patched where it holds it. The
    padding warning of a batch without a mask (`warn_if_padding_and_no_attention_mask`, which reads token values,
    modeling_utils.py line 4457 in 4.41.2) is skipped for fake ids, as transformers 5 skips it under tracing."""
    import sys

    from transformers.modeling_utils import PreTrainedModel

    warn = PreTrainedModel.warn_if_padding_and_no_attention_mask

    def warn_unless_fake(self, input_ids, attention_mask):
        return None if isinstance(input_ids, fake) else warn(self, input_ids, attention_mask)

    patch(PreTrainedModel, "warn_if_padding_and_no_attention_mask", warn_unless_fake)
    try:
        from transformers import modeling_attn_mask_utils as legacy
    except ImportError:  # transformers 5 removed it
        return
    converter = legacy.AttentionMaskConverter
    ignore = _fake_as_none(converter._ignore_causal_mask_sdpa, "attention_mask", fake)
    patch(converter, "_ignore_causal_mask_sdpa", staticmethod(ignore))
    expand = legacy._prepare_4d_attention_mask_for_sdpa
    all_ones_when_fake = _none_when_fake(expand, "mask", fake)  # an all-ones mask expands to none
    # a module's own namespace, not getattr: transformers' lazy modules import a submodule on attribute access, and
    # one may need an optional package that is not installed (5.13.1's aria image processor imports torchvision)
    for name, module in list(sys.modules.items()):
        if (name == legacy.__name__ or name.startswith("transformers.models.")) and \
                vars(module).get("_prepare_4d_attention_mask_for_sdpa") is expand:
            patch(module, "_prepare_4d_attention_mask_for_sdpa", all_ones_when_fake)


def _cuda_dropout(req: TraceRequest):
    """Dropout as CUDA runs it (planner/program/dropout.py), for a step traced for a GPU."""
    if req.autocast_device != "cuda":
        return contextlib.nullcontext()

    return fused_dropout()


def _autocast_rules(req: TraceRequest):
    """CUDA's autocast op lists for a step traced for a GPU; CPU autocast's own otherwise."""
    if req.autocast is None or req.autocast_device != "cuda":
        return contextlib.nullcontext()

    return cuda_autocast_rules(req.autocast)


def liger_stand_ins(req: TraceRequest, model, recorder: OpRecorder | None = None):
    """Liger-Kernel's patches as stand-ins (planner/program/liger.py) for a step traced with `req.liger`, where Liger
    has patches for the model's type; nothing otherwise. With `recorder`, the fused loss's chunks count as the step's
    tokens in the op profile (their rows grow with the micro-batch)."""
    patches = patches_for(model.config, task_of_class(type(unwrap(model)).__name__)) if req.liger else None
    if patches is None:
        return contextlib.nullcontext()
    rows = ChunkRows(recorder) if recorder is not None else None
    return stand_ins(model, patches, cuda=req.autocast_device == "cuda", chunk_rows=rows)


class ChunkRows:
    """What the op profile does around Liger's fused loss: its chunk loop (`__call__`, `_tokens_as`) and the host's
    waits for the GPU (`host_waits`: the recorder marks the step's ops so far as run before it)."""

    def __init__(self, recorder: OpRecorder):
        self.recorder = recorder

    def __call__(self, rows: int, relabel: bool = True):
        return _tokens_as(self.recorder, rows, relabel)

    def host_waits(self) -> None:
        self.recorder.synchronised()


@contextlib.contextmanager
def _tokens_as(recorder: OpRecorder, rows: int, relabel: bool = True):
    """A chunked loop over the step's tokens. With `relabel` the op profile counts `rows` (a chunk of the step's
    tokens) as the step's token count for the length of the block, then folds the GEMMs each chunk ran into one batched
    GEMM of as many chunks: as the micro-batch grows a chunked loop keeps its chunk count and grows its chunks, each
    chunk's GEMMs reading the weights again (planner/speed/kernels.py times a batch's operands per member)."""
    tokens = recorder.tokens
    recorder.tokens = rows if relabel else tokens
    kept = [p for p in (recorder.profile, recorder.shallower) if p is not None]
    before = [dict(p.matmuls) for p in kept]
    try:
        yield
    finally:
        recorder.tokens = tokens
        for profile, counts in zip(kept, before):
            if relabel:
                _fold_gemms(profile.matmuls, counts)


def _fold_gemms(matmuls: dict[str, float], before: dict[str, float]) -> None:
    """The unbatched GEMMs added to `matmuls` since `before` whose token-marked dimensions are a chunk's, as one GEMM
    per shape batched over its count (keys as planner/program/profile.py `Profile.matmuls` writes them)."""
    for key, count in list(matmuls.items()):
        added = count - before.get(key, 0.0)
        b, m, n, k, dtype, phase, scaled = key.split(",")
        if added <= 0 or "1" not in scaled or b != "1":
            continue
        folded = ",".join((str(int(added)), m, n, k, dtype, phase, scaled))
        matmuls[key] = count - added
        if not matmuls[key]:
            del matmuls[key]
        matmuls[folded] = matmuls.get(folded, 0.0) + 1


def _sdpa_kernel(kernel: str):
    """Force the SDPA backend a kernel needs on the CPU (the math fallback); otherwise torch's own choice."""
    backend = KERNEL[kernel].sdpa_backend
    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, backend))


@contextlib.contextmanager
def fake_step_model(config, layers: int, req: TraceRequest, trust: bool = False):
    """The model of `layers` blocks as `req`'s step runs it (weights' dtype, adapters, attention settings,
    checkpointing) under FakeTensorMode, in training mode, with a batch for it: what a trace runs its step on (here,
    and AOTAutograd's capture in planner/program/compiled.py)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = _prepare_config(config, layers, req)
    # adapters with a 16-bit computation: the frozen base in 16 bits, the adapters in fp32 (planner/models/adapters.py)
    half = getattr(torch, req.half_dtype)
    mixed = half if req.adapter is not None and (req.autocast or req.half_weights) else None
    model = build_meta(cfg, trust_remote_code=trust, dtype=half if req.half_weights else torch.float32,
                       adapter=req.adapter, mixed_dtype=mixed)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, _real_mask_decisions(), _real_scalar_draws(mode), \
            _quiet_fake_tensor_errors():
        model.to_empty(device="cpu")
        model.tie_weights()
        model.train()
        enable_checkpointing(model, req.checkpointing)
        yield model, make_batch(model, req.micro_batch, req.seq_len, objective=req.objective)


def _with_carried(events: list, carried: list[tuple[int, int]], forward_end: int) -> list:
    """The step's allocation events as a loop runs them when it keeps the step's outputs until the next forward
    returns: a benchmark's `outputs = model(**inputs); outputs.logits.sum().backward()` rebinds `outputs` only
    once the next forward has returned, so the storages only the outputs keep (`carried`: the logits, and a
    cache's tensors where the model returns one) are live through that forward, then freed."""
    if not carried:
        return events
    return ([("alloc", ("carried", key), nbytes) for key, nbytes in carried] + events[:forward_end]
            + [("free", ("carried", key), 0) for key, _ in carried] + events[forward_end:])


def run_trace(config, layers: int, req: TraceRequest, trust: bool = False, profile: bool = True) -> TracePoint:
    """Peak bytes above params + grads (+ optimizer states) of one fwd+bwd with `layers` blocks, and the
    allocator's slack over the step's own allocations; with `profile` the step's ops too."""
    import torch

    tracker = LiveStorageTracker(cuda_matmuls=req.autocast_device == "cuda")
    held: list = []  # a sum objective's outputs, kept through the backward and the next forward (`_with_carried`)
    with fake_step_model(config, layers, req, trust) as (model, batch):
        regions = block_regions(model, layers)
        recorder = OpRecorder(req.micro_batch, req.seq_len, regions, cuda_kernels=req.autocast_device == "cuda") \
            if profile else None
        with tracker, regions or contextlib.nullcontext():
            tracker.track_all(list(model.parameters()) + list(model.buffers()) + list(batch.values()))
            batch_bytes = tuple(t.untyped_storage().nbytes() for t in batch.values())
            for p in model.parameters():  # gradients already allocated, as mid-accumulation
                if p.requires_grad and req.grads_allocated:
                    p.grad = torch.zeros_like(p)
            base = tracker.reset_peak()
            tracker.record(where=regions.code if regions else None)
            with _sdpa_kernel(req.attention), _autocast_rules(req), _cuda_dropout(req), \
                    liger_stand_ins(req, model, recorder), recorder or contextlib.nullcontext():
                loss = forward_loss(model, batch, req.autocast, objective=req.objective, hold=held)
                forward, forward_end = tracker.peak - base, len(tracker.events)
                tracker.restart_peak()
                if recorder:
                    recorder.phase = "backward"
                if regions:
                    regions.backward = True
                loss.backward()
            backward = tracker.peak - base
            if held:  # the loop's `loss` too lives until the next step's replaces it
                held.append(loss)
            del loss
            carried = tracker.release(held)
    forward += sum(nbytes for _, nbytes in carried)
    peak = max(forward, backward)
    replayed = replay(_with_carried(tracker.events, carried, forward_end))
    template = None
    if regions:
        marks = tuple(next((m for m in tracker.matmul_marks if (m > forward_end) == phase), -1) for phase in (0, 1))
        template = Template.from_tracker(tracker.events, tracker.tags, layers, batch_bytes, marks).to_json()
    return TracePoint(activations=peak, slack=replayed.peak_reserved - replayed.peak_allocated,
                      rounding=replayed.rounding, profile=recorder.profile.to_json() if recorder else None,
                      forward=forward, backward=backward, template=template,
                      shallower=recorder.shallower.to_json() if recorder and recorder.shallower else None)
