"""Liger-Kernel (the Trainer's `use_liger_kernel=True`) in the traced program: what it patches, and stand-ins that
allocate and compute what its kernels do, so that a Liger configuration's memory and op profile come from the
same trace as every other program.

The Trainer calls `_apply_liger_kernel_to_instance(model, **liger_kernel_config)` in `train()`
(transformers 5.24 trainer.py:1494-1495, integrations/liger.py:28-53), which runs the model type's
`apply_liger_kernel_to_<type>(model=...)` with its own defaults; a model type without an entry is a silent no-op
(logger.info). All `monkey_patch.py:N` citations are liger-kernel 0.8.5's
`liger_kernel/transformers/monkey_patch.py` (the wheel's); `ops/...:N` its `liger_kernel/ops/`.

The stand-ins replace module forwards with `torch.autograd.Function`s that save exactly what Liger's kernels save
and run one ordinary torch op where a Triton kernel runs (the values do not matter under FakeTensorMode; the
allocations, dtypes and the bytes each kernel moves do):

* RMSNorm (ops/rms_norm.py:629-712): saves X, W and an fp32 RSTD of one value per row; the backward writes dX into
  dY where `in_place` and reduces a (SMs, H) fp32 partial dW.
* SwiGLU / GeGLU (ops/swiglu.py:240-305, ops/geglu.py:133-146): saves the gate and up projections' outputs, the
  activation is recomputed in the backward, which writes both gradients into them.
* RoPE (ops/rope.py:271-303): rotates q and k in place in the projections' output, saves cos and sin.
* Fused linear cross-entropy (ops/fused_linear_cross_entropy.py:51-418): the causal-LM forward returns no logits in
  training with labels (transformers/model/llama.py:113-127); the loss walks the tokens in chunks, computing each
  chunk's logits, loss and the lm_head's input and weight gradients in the forward, and keeps only the gradients.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import math
import types
from dataclasses import dataclass, field

from planner.vocab import PACKAGE, TASK, TOKEN_TARGETS

logger = logging.getLogger(__name__)

VERSION = "0.8.5"
MONKEY_PATCH = "liger_kernel/transformers/monkey_patch.py"
#: Stand-in semantics: part of the trace cache key of Liger traces (planner/program/trace.py `trace_key`).
CACHE_VERSION = 2
FLCE, CROSS_ENTROPY = "fused_linear_cross_entropy", "cross_entropy"
SWIGLU, PHI3_SWIGLU, GEGLU, EXPERTS = "swiglu", "phi3_swiglu", "geglu", "experts"
_NAMES = {SWIGLU: "SwiGLU", PHI3_SWIGLU: "SwiGLU (fused gate_up)", GEGLU: "GeGLU", EXPERTS: "MoE experts",
          FLCE: "fused linear cross-entropy", CROSS_ENTROPY: "cross-entropy"}
#: The CUDA streaming multiprocessors Liger's RMSNorm backward sizes its fp32 partial dW by
#: (ops/rms_norm.py:532-544: `multi_processor_count` rows); an H100 SXM's 132. A few MB, freed in the backward.
SM_COUNT = 132
IGNORE_INDEX = -100


@dataclass(frozen=True)
class _D:
    """An `apply_liger_kernel_to_<type>` function's defaults: its def line in monkey_patch.py, rope, rms_norm, the MLP
    flag that is on (swiglu / geglu / relu_squared), the loss (fused_linear_cross_entropy, cross_entropy or None) and
    layer_norm (vision towers)."""

    line: int
    rope: bool
    rms_norm: bool
    mlp: str | None
    loss: str | None
    layer_norm: bool


_F, _C = FLCE, CROSS_ENTROPY
#: `MODEL_TYPE_TO_APPLY_LIGER_FN` (monkey_patch.py:3904-3958) with each function's keyword defaults, read from
#: liger-kernel 0.8.5 (tests/test_liger.py compares it with an installed liger-kernel's own table). llava, internvl
#: and smolvlm forward their other keywords to the text model's function.
SUPPORTED: dict[str, _D] = {
    "deepseek_v2": _D(3548, False, True, SWIGLU, _F, False), "deepseek_v3": _D(3655, False, True, SWIGLU, _F, False),
    "deepseek_v4": _D(3750, False, True, None, _F, False), "gemma": _D(1073, True, True, GEGLU, _F, False),
    "gemma2": _D(1142, True, True, GEGLU, _F, False), "gemma3_text": _D(1216, True, True, GEGLU, _F, False),
    "gemma3": _D(1303, True, True, GEGLU, _F, True), "gemma4_text": _D(1395, False, True, GEGLU, _F, False),
    "gemma4": _D(1544, False, True, GEGLU, _F, False), "glm4": _D(2570, False, True, SWIGLU, _F, False),
    "glm4v": _D(2639, False, True, SWIGLU, _F, False), "glm4v_moe": _D(2728, False, True, SWIGLU, _F, False),
    "gpt_oss": _D(1943, True, True, None, _F, False), "internvl": _D(2833, False, True, None, _F, True),
    "llama": _D(259, True, True, SWIGLU, _F, False), "llama4_text": _D(470, True, True, SWIGLU, _F, True),
    "llama4": _D(470, True, True, SWIGLU, _F, True), "llava": _D(393, False, False, None, _F, False),
    "granite": _D(184, True, True, SWIGLU, _C, False), "mllama": _D(560, True, True, SWIGLU, _F, True),
    "mllama_text_model": _D(560, True, True, SWIGLU, _F, True), "ministral": _D(660, True, True, SWIGLU, _F, False),
    "mistral": _D(723, True, True, SWIGLU, _F, False), "mixtral": _D(834, True, True, SWIGLU, _F, False),
    "muse_glimmer": _D(907, True, True, SWIGLU, _F, True), "nemotron": _D(787, False, False, "relu_squared", _F, False),
    "olmo2": _D(2435, True, True, SWIGLU, _F, False), "pixtral": _D(1024, True, True, SWIGLU, None, False),
    "olmo3": _D(2502, True, True, SWIGLU, _F, False), "qwen2": _D(1750, True, True, SWIGLU, _F, False),
    "qwen3": _D(1817, True, True, SWIGLU, _F, False), "qwen3_moe": _D(1876, True, True, SWIGLU, _F, False),
    "qwen2_vl": _D(2016, True, True, SWIGLU, _F, True), "qwen2_vl_text": _D(2016, True, True, SWIGLU, _F, True),
    "qwen2_5_vl": _D(2113, True, True, SWIGLU, _F, False), "qwen2_5_vl_text": _D(2113, True, True, SWIGLU, _F, False),
    "qwen3_next": _D(3117, False, True, SWIGLU, _F, False), "qwen3_5": _D(3219, False, True, SWIGLU, _F, False),
    "qwen3_5_text": _D(3219, False, True, SWIGLU, _F, False), "qwen3_5_moe": _D(3319, False, True, SWIGLU, _F, False),
    "qwen3_5_moe_text": _D(3319, False, True, SWIGLU, _F, False), "qwen3_vl": _D(2204, True, True, None, _F, False),
    "qwen3_vl_text": _D(2204, True, True, None, _F, False), "qwen3_vl_moe": _D(2283, True, True, SWIGLU, _F, False),
    "qwen3_vl_moe_text": _D(2283, True, True, SWIGLU, _F, False), "smollm3": _D(326, True, True, SWIGLU, _F, False),
    "phi3": _D(2371, True, True, SWIGLU, _F, False), "paligemma": _D(1639, True, True, GEGLU, _F, True),
    "falcon_h1": _D(3045, True, True, SWIGLU, _F, False), "smolvlm": _D(2945, False, True, None, _F, True),
    "hunyuan_v1_dense": _D(3425, True, True, SWIGLU, _F, False),
    "hunyuan_v1_moe": _D(3483, True, True, SWIGLU, _F, False), "exaone4": _D(3826, True, True, SWIGLU, _F, False),
}


@dataclass(frozen=True)
class Norms:
    """The RMSNorms an instance patch binds `LigerRMSNorm.forward` to (`_patch_rms_norm_module`, monkey_patch.py:
    72-110): paths inside every decoder layer, and the decoder's final `norm`, with the kernel's casting mode and
    offset and whether its backward writes dX into dY (`in_place`)."""

    layer: tuple[str, ...]
    casting_mode: str = "llama"
    offset: float = 0.0
    in_place: bool = True
    final_in_place: bool = True


@dataclass(frozen=True)
class Layout:
    """What an apply function's `if model is not None:` block patches on an instance: the norms and the MLP's form
    (swiglu: `LigerSwiGLUMLP`, gate/up/down; phi3_swiglu: `LigerPhi3SwiGLUMLP`, one gate_up projection; geglu:
    `LigerGEGLUMLP`; experts: `LigerExperts`, the fused MoE), and the lines it is read from."""

    norms: Norms
    mlp: str | None
    lines: str


_PAIR = ("input_layernorm", "post_attention_layernorm")
_QK = ("self_attn.q_norm", "self_attn.k_norm")
_SANDWICH = ("post_attention_layernorm", "post_feedforward_layernorm")
_GEMMA2 = _PAIR + ("pre_feedforward_layernorm", "post_feedforward_layernorm")
_GEMMA = dict(casting_mode="gemma", offset=1.0)
#: The instance layouts read for the text decoders traced here; other supported types keep HF's norms and MLP in the
#: trace (`Patches.unmodelled` says so).
LAYOUTS: dict[str, Layout] = {
    "llama": Layout(Norms(_PAIR), SWIGLU, "308-323"),
    "smollm3": Layout(Norms(_PAIR), SWIGLU, "375-390"),
    "ministral": Layout(Norms(_PAIR), SWIGLU, "705-720"),
    "mistral": Layout(Norms(_PAIR), SWIGLU, "769-784"),
    "mixtral": Layout(Norms(_PAIR), EXPERTS, "885-904"),
    "gemma": Layout(Norms(_PAIR, **_GEMMA), GEGLU, "1106, 1124-1139"),
    "gemma2": Layout(Norms(_GEMMA2, **_GEMMA, in_place=False, final_in_place=False), GEGLU, "1175-1177, 1196-1213"),
    "gemma3_text": Layout(Norms(_GEMMA2 + _QK, **_GEMMA, in_place=False, final_in_place=False), GEGLU,
                          "1254-1256, 1276-1300"),
    "qwen2": Layout(Norms(_PAIR), SWIGLU, "1799-1814"),
    "qwen3": Layout(Norms(_PAIR + _QK), SWIGLU, "1857-1873"),
    "qwen3_moe": Layout(Norms(_PAIR + _QK), EXPERTS, "1920-1940"),
    "phi3": Layout(Norms(_PAIR), PHI3_SWIGLU, "2417-2432"),
    "olmo2": Layout(Norms(_SANDWICH, in_place=False), SWIGLU, "2484-2499"),
    "olmo3": Layout(Norms(_SANDWICH, in_place=False), SWIGLU, "2552-2567"),
    "glm4": Layout(Norms(_PAIR + ("post_self_attn_layernorm", "post_mlp_layernorm"), in_place=False,
                         final_in_place=False), PHI3_SWIGLU, "2619-2636"),
    "granite": Layout(Norms(_PAIR), SWIGLU, "241-256"),
    "exaone4": Layout(Norms(_SANDWICH + _QK, in_place=False, final_in_place=False), SWIGLU, "3884-3900"),
    "hunyuan_v1_dense": Layout(Norms(_PAIR), SWIGLU, "3466-3480"),
}
_MODELLED_MLPS = (SWIGLU, PHI3_SWIGLU, GEGLU)


@dataclass(frozen=True)
class Patches:
    """What `use_liger_kernel=True` patches on one model (its type's defaults, less FLCE on a head that is not a
    causal LM), and the parts the trace leaves as HF runs them, with why (`unmodelled`)."""

    model_type: str
    source: str                 # monkey_patch.py:N, the apply function
    rope: bool
    rms_norm: bool
    norms: Norms | None         # the RMSNorms patched, where the type's instance layout is read (LAYOUTS)
    mlp: str | None             # the MLP's patched form (LAYOUTS), or the apply function's flag where not read
    loss: str | None            # fused_linear_cross_entropy | cross_entropy | None
    layer_norm: bool            # LigerLayerNorm on a vision tower
    flce_off_for_task: bool = False
    unmodelled: tuple[str, ...] = ()

    @property
    def modelled_mlp(self) -> str | None:
        """The MLP form the stand-ins replace: one of a read layout with a stand-in."""
        return self.mlp if self.model_type in LAYOUTS and self.mlp in _MODELLED_MLPS else None

    def names(self) -> str:
        """What is patched, in words: "RoPE, RMSNorm, SwiGLU, fused linear cross-entropy"."""
        parts = [name for name, on in (("RoPE", self.rope), ("RMSNorm", self.rms_norm), ("LayerNorm", self.layer_norm))
                 if on] + [_NAMES[p] for p in (self.mlp, self.loss) if p]
        return ", ".join(parts)

    def trainer_config(self) -> dict | None:
        """`TrainingArguments.liger_kernel_config` for this model: None (the defaults), or FLCE off where the head is
        not a causal LM, which the FLCE patch breaks (it rebinds `forward` to the causal-LM `lce_forward` whatever the
        class: `'LlamaForSequenceClassification' object has no attribute 'lm_head'`, monkey_patch.py:303-304;
        `_apply_liger_kernel_to_instance` passes the keys the function takes, :4014-4023)."""
        return {FLCE: False} if self.flce_off_for_task else None


def patches_for(config, task: str) -> Patches | None:
    """The patches `use_liger_kernel=True` applies to a model of `config.model_type` with a `task` head (`vocab.TASK`);
    None where liger-kernel has no entry for the type (a silent no-op: monkey_patch.py:4010-4012)."""
    return patches_of(getattr(config, "model_type", None), task)


def patches_of(model_type: str | None, task: str) -> Patches | None:
    """`patches_for` by the model type's name."""
    defaults = SUPPORTED.get(model_type)
    if defaults is None:
        return None
    info = TASK.get(task)
    lm_head = info is not None and info.lm_head and info.labels == TOKEN_TARGETS
    flce_off = defaults.loss == FLCE and not lm_head
    loss = None if flce_off else defaults.loss
    layout = LAYOUTS.get(model_type)
    norms = layout.norms if layout and defaults.rms_norm else None
    mlp = (layout.mlp if layout else defaults.mlp) if defaults.mlp else None
    return Patches(model_type, f"{MONKEY_PATCH}:{defaults.line}", defaults.rope, defaults.rms_norm, norms, mlp, loss,
                   defaults.layer_norm, flce_off, _unmodelled(model_type, defaults, layout, mlp, loss))


def trainer_config(model_type: str, task: str) -> dict | None:
    """`TrainingArguments.liger_kernel_config` for a `model_type` with a `task` head (`Patches.trainer_config`)."""
    patches = patches_of(model_type, task)
    return patches.trainer_config() if patches is not None else None


def _unmodelled(model_type: str, defaults: _D, layout: Layout | None, mlp: str | None, loss: str | None
                ) -> tuple[str, ...]:
    """What Liger patches on this type that the stand-ins do not, with why."""
    out = []
    if layout is None and (defaults.rms_norm or mlp):
        out.append(f"rms_norm and {mlp or 'MLP'}: {model_type}'s instance layout is not read here; its norms and MLP "
                   "are traced as HF's")
    elif mlp is not None and mlp not in _MODELLED_MLPS:
        out.append(f"{mlp}: no stand-in; its MLP is traced as HF's")
    if loss == CROSS_ENTROPY:
        out.append("cross_entropy (a global swap of transformers.loss.loss_utils' cross_entropy, monkey_patch.py:"
                   f"{defaults.line}): no stand-in; the loss is traced as HF's")
    if defaults.layer_norm:
        out.append("layer_norm (vision tower): not traced")
    return tuple(out)


def applies(config, gpu=None, *, check_installed: bool = True) -> str | None:
    """Why `use_liger_kernel=True` would not apply Liger's kernels to this model on `gpu` (a catalog entry; None: not
    known), or None where it does:

    * a model type without an entry: a silent no-op (monkey_patch.py:4010-4012);
    * an NVIDIA GPU below compute capability 8.0: Triton lists "NVIDIA GPUs (Compute Capability 8.0+)" as its
      supported hardware (triton-lang/triton README); bf16 kernels fail there to compile ("Feature '.bf16' requires
      .target sm_80", Liger issue #51), and the FLCE takes its legacy path, with V x H temporaries per chunk, which
      the stand-ins do not trace (ops/fused_linear_cross_entropy.py:329, :351, :371-375). AMD GPUs run it through
      ROCm (README: "v0.4.0: Full AMD support"; the code's `is_hip()` branches);
    * liger-kernel or triton not importable here, or transformers < 5.0.0, which liger-kernel 0.8.5 refuses
      (monkey_patch.py:57-62); the Trainer then raises ImportError (transformers/integrations/liger.py:39-43)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        return (f"liger-kernel {VERSION} has no patches for model type {model_type!r} ({MONKEY_PATCH}:3904-3958): "
                "use_liger_kernel would change nothing")
    cc = gpu.compute_capability_tuple if gpu is not None else None
    if cc is not None and cc < (8, 0):
        return (f"{gpu.name} (compute capability {gpu.compute_capability}) is below Triton's supported NVIDIA GPUs "
                "(8.0+); Liger's bf16 kernels do not compile there")
    return _not_installed() if check_installed else None


def _not_installed() -> str | None:
    """Why liger-kernel could not be imported here, or None."""
    import transformers

    missing = [name for name in ("liger_kernel", "triton") if importlib.util.find_spec(name) is None]
    if missing:
        return f"{' and '.join(missing)} not installed here ({PACKAGE['liger-kernel'].install})"
    if int(transformers.__version__.split(".")[0]) < 5:
        return f"liger-kernel {VERSION} needs transformers >= 5.0.0 ({MONKEY_PATCH}:57-62)"
    return None


def flce_chunks(tokens: int, hidden: int, vocab: int) -> tuple[int, int]:
    """Liger's FLCE chunk size and count for `tokens` rows (ops/fused_linear_cross_entropy.py:99-106, with
    `chunk_mem_const` 1, :27): inc = ceil(V / H), chunk = min(next_pow2(ceil(BT / inc)), BT)."""
    inc = -(-vocab // hidden)
    chunk = min(1 << max(0, math.ceil(math.log2(-(-tokens // inc)))), tokens)
    return chunk, -(-tokens // chunk)


@functools.cache
def _stand_in_functions():
    """The autograd Functions, built on first use: importing this module does not import torch (the CLI and the
    search read the table)."""
    import torch

    return _make_norm(torch), _make_gated(torch), _make_rope(torch), _make_flce(torch)


def _kernel_writes(*tensors):
    """A Triton kernel writes through pointers, which autograd's version counters do not see: a stand-in's in-place op
    leaves them as they were (else torch's selective checkpointing rejects the rotated q of a projection it cached)."""
    import torch

    return torch.autograd._unsafe_preserve_version_counter(tensors)


def _make_norm(torch):
    class RMSNorm(torch.autograd.Function):
        """LigerRMSNormFunction (ops/rms_norm.py:651-712): Y in X's dtype, RSTD fp32 in llama/gemma casting (:462-466);
        saves X, W, RSTD (:674)."""

        @staticmethod
        def forward(ctx, x, weight, in_place):
            x = x.contiguous()
            shape = x.shape
            x = x.view(-1, shape[-1])
            y = torch.empty_like(x)
            rstd = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
            torch.mul(x, weight, out=y)  # the kernel: reads X and W, writes Y (and RSTD)
            ctx.in_place = in_place
            ctx.save_for_backward(x, weight, rstd)
            return y.view(shape)

        @staticmethod
        def backward(ctx, dy):
            x, weight, _rstd = ctx.saved_tensors
            dy = dy.contiguous()
            shape = dy.shape
            dy = dy.view(-1, shape[-1])
            partial = torch.empty((SM_COUNT, x.shape[1]), dtype=torch.float32, device=x.device) \
                if ctx.needs_input_grad[1] else None  # :544
            dx = dy if ctx.in_place else torch.zeros_like(dy)  # :555-558
            with _kernel_writes(dx):  # the kernel: reads dY, X, W, RSTD; writes dX and the partial dW
                torch.mul(dy, x, out=dx)
            dw = partial.sum(dim=0).to(weight.dtype) if partial is not None else None  # :621-622
            return dx.view(shape), dw, None

    return RMSNorm


def _make_gated(torch):
    class GatedProduct(torch.autograd.Function):
        """LigerSiLUMulFunction / LigerGELUMulFunction (ops/swiglu.py:240-305, ops/geglu.py:133-146): act(a) * b in one
        kernel, a and b saved (after `ensure_contiguous`, ops/utils.py:44-54); the backward recomputes act(a) and
        writes da and db into a and b (ops/swiglu.py:201-237)."""

        @staticmethod
        def forward(ctx, a, b):
            a, b = a.contiguous(), b.contiguous()
            c = torch.empty_like(a)
            torch.mul(a, b, out=c)  # the kernel
            ctx.save_for_backward(a, b)
            return c

        @staticmethod
        def backward(ctx, dc):
            a, b = ctx.saved_tensors
            dc = dc.contiguous()
            with _kernel_writes(a, b):  # the backward kernel, in place in the saved inputs
                a.mul_(dc)
                b.mul_(dc)
            return a, b

    return GatedProduct


def _make_rope(torch):
    def tables(cos, sin):
        """rope_forward's cos/sin shapes (ops/rope.py:135-148): (batch or 1, seq, rotary dim)."""
        if cos.ndim == 4:
            cos, sin = cos.squeeze(1), sin.squeeze(1)
        if cos.ndim == 2:
            cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        return cos.contiguous(), sin.contiguous()

    def rotate(q, k, cos):
        """The kernel: q and k, in their physical (batch, seq, heads, dim) layout, rotated in place."""
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        width = min(cos.shape[-1], q.shape[-1])
        with _kernel_writes(q, k):
            q[..., :width].mul_(cos[..., :width].unsqueeze(2))
            k[..., :width].mul_(cos[..., :width].unsqueeze(2))
        return q.transpose(1, 2), k.transpose(1, 2)

    class Rope(torch.autograd.Function):
        """LigerRopeFunction (ops/rope.py:271-303): q and k rotated in place, cos and sin saved."""

        @staticmethod
        def forward(ctx, q, k, cos, sin):
            cos, sin = tables(cos, sin)
            ctx.save_for_backward(cos, sin)
            return rotate(q, k, cos)

        @staticmethod
        def backward(ctx, dq, dk):
            cos, _sin = ctx.saved_tensors
            dq, dk = rotate(dq, dk, cos)
            return dq, dk, None, None

    return Rope


def _make_flce(torch):
    class FusedLinearCrossEntropy(torch.autograd.Function):
        """LigerFusedLinearCrossEntropyFunction with reduction mean/sum (ops/fused_linear_cross_entropy.py:480-615):
        the gradients computed in the forward are all it saves (:572-578); its backward scales them in place by the
        incoming gradient (`element_mul_kernel`, :418-464), as the Trainer's loss (divided by the batch's token
        count) makes it do."""

        @staticmethod
        def forward(ctx, x, weight, target, cuda, chunk_rows):
            loss, grad_input, grad_weight = flce_forward(x, weight, target, cuda, chunk_rows)
            ctx.save_for_backward(grad_input.detach(), grad_weight.detach() if grad_weight is not None else None)
            ctx.chunk_rows = chunk_rows
            return loss

        @staticmethod
        def backward(ctx, grad_output):
            if ctx.chunk_rows is not None:  # `torch.equal(grad_output, ...)` reads a comparison on the host (:420)
                ctx.chunk_rows.host_waits()
            grad_input, grad_weight = ctx.saved_tensors
            grad_input.mul_(grad_output)
            if grad_weight is not None:
                grad_weight.mul_(grad_output)
            return grad_input, grad_weight, None, None, None

    return FusedLinearCrossEntropy


def fused_linear_cross_entropy(x, weight, target, *, cuda: bool = True, chunk_rows=None):
    """The FLCE stand-in on `x` (tokens, hidden), the lm_head `weight` and shifted `target`s: the loss, whose backward
    hands back the gradients its forward computed (what `LigerForCausalLMLoss` calls, transformers/model/
    loss_utils.py:67-106)."""
    return _stand_in_functions()[3].apply(x, weight, target, cuda, chunk_rows)


def _autocast_dtype():
    """The enclosing autocast's dtype (CUDA's, or the CPU's a trace stands in for it), or None."""
    import torch

    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
    return None


def _mm_out(x, weight, cuda: bool) -> bool:
    """`_can_use_mm_out` (ops/fused_linear_cross_entropy.py:32-48, on CUDA, not ROCm; grad mode is off in a Function's
    forward): the logits go into one persistent (chunk, V) buffer."""
    import torch

    if not cuda or x.dtype != weight.dtype or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    autocast = _autocast_dtype()
    return autocast is None or x.dtype == autocast


def flce_forward(x, weight, target, cuda: bool, chunk_rows=None):
    """`fused_linear_cross_entropy_forward` (ops/fused_linear_cross_entropy.py:51-412) with the Triton CE kernel as one
    in-place op on each chunk's logits: the loss, grad_input (x's shape and dtype, :108) and grad_weight (the weight's
    dtype, None for a frozen weight, :114-123). `cuda` picks CUDA's paths (the persistent logits buffer and the
    in-place `addmm` weight-gradient accumulation, for compute capability 8.0+); `chunk_rows`, where given, is told
    where the host waits for the GPU (`host_waits`: the `.item()` of the label count, :131-132, which cannot run on
    fake tensors) and `chunk_rows(n, relabel)` is the context the chunk loop runs in for the op profile, a chunk's n
    rows taken as the step's tokens where `relabel` (planner/program/trace.py `ChunkRows`: a chunk's rows grow with
    the micro-batch, the chunk count does not); without it only the first and last chunks run (`_chunk_starts`)."""
    import torch

    tokens, hidden = x.shape
    vocab = weight.shape[0]
    chunk, _count = flce_chunks(tokens, hidden, vocab)
    grad_input = torch.zeros_like(x)
    grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
    loss_1d = torch.zeros(tokens, dtype=torch.float32, device=x.device)
    target_mask = target != IGNORE_INDEX  # kept through the loop, as in :130
    target_mask.sum()
    mm_out = _mm_out(x, weight, cuda)
    storage = torch.empty((chunk, vocab), dtype=x.dtype, device=x.device) if mm_out else None
    if chunk_rows is not None:  # the host's `.item()` of the label count (:131-132)
        chunk_rows.host_waits()
    rows = chunk_rows(chunk, chunk not in (hidden, vocab)) if chunk_rows is not None else contextlib.nullcontext()
    with rows:
        for start in _chunk_starts(tokens, chunk, every=chunk_rows is not None):
            end = min(start + chunk, tokens)
            _flce_chunk(x[start:end], weight, grad_input[start:end], grad_weight, storage, cuda)
    del storage, target_mask
    loss = torch.sum(loss_1d)
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)  # :412, a copy only with an accumulation dtype
    return loss, grad_input, grad_weight


def _chunk_starts(tokens: int, chunk: int, every: bool) -> list[int]:
    """The first rows of the chunks the loop runs: every chunk where the op profile counts them, else the first and
    the last only. The chunks between allocate and free what the first does, in its order, so the step's peak and the
    caching allocator's replay are the same without them, and a trace of memory alone skips their dispatch."""
    starts = list(range(0, tokens, chunk))
    return starts if every or len(starts) <= 2 else [starts[0], starts[-1]]


def _flce_chunk(x, weight, grad_input, grad_weight, storage, cuda: bool) -> None:
    """One chunk (ops/fused_linear_cross_entropy.py:157-384): its logits, the CE kernel overwriting them with their
    gradient (:250), the input's gradient rows and the weight gradient's accumulation."""
    import torch

    if storage is not None:
        logits = storage[: x.shape[0]]
        torch.mm(x, weight.t(), out=logits)
    else:
        logits = x @ weight.t()
    logits = logits.contiguous()
    logits.mul_(1.0)  # the CE kernel: reads the chunk's logits, writes their gradient (and the chunk's losses)
    if storage is not None and logits.dtype == grad_input.dtype:
        torch.mm(logits, weight, out=grad_input)
    else:
        grad_input.copy_(logits @ weight)
    if grad_weight is None:
        return
    half = logits.dtype in (torch.float16, torch.bfloat16)
    fp32_sum = grad_weight.dtype == torch.float32 and _addmm_out_dtype()
    if cuda and half and (fp32_sum or grad_weight.dtype == logits.dtype):  # :326-370, compute capability 8.0+
        x = x.to(logits.dtype) if x.dtype != logits.dtype else x
        extra = {"out_dtype": torch.float32} if grad_weight.dtype != logits.dtype else {}
        torch.addmm(grad_weight, logits.t(), x, out=grad_weight, **extra)
    else:  # the legacy path (:371-375): a V x H product and its fp32 copy per chunk
        grad_weight += torch.mm(logits.t(), x).float()


def _addmm_out_dtype() -> bool:
    """`addmm(..., out_dtype=torch.float32)` exists from torch 2.8 (ops/fused_linear_cross_entropy.py:29)."""
    import torch

    major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    return (major, minor) >= (2, 8)


@dataclass
class Applied:
    """What the stand-ins replaced in one traced model, and what Liger patches that they left as HF runs it."""

    patched: dict[str, int] = field(default_factory=dict)   # part -> modules (or functions) replaced
    skipped: list[str] = field(default_factory=list)        # why a part Liger patches is traced as HF's


def unwrap(model):
    """The transformers model inside a peft wrapper, which the Trainer patches (transformers/integrations/liger.py:48,
    `unwrap_peft_model`: `get_base_model()`)."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


@contextlib.contextmanager
def stand_ins(model, patches: Patches, *, cuda: bool = True, chunk_rows=None):
    """`patches` applied to `model` as stand-ins for the length of the block (a traced step's forward and backward,
    recomputation included), then undone. Yields `Applied`. `cuda` follows CUDA's paths in the FLCE; `chunk_rows` as
    in `flce_forward`."""
    norm, gated, rope, _flce = _stand_in_functions()
    model = unwrap(model)
    applied, undo = Applied(dict.fromkeys(("rms_norm", "mlp", "rope", FLCE), 0), list(patches.unmodelled)), []
    base = getattr(model, getattr(model, "base_model_prefix", ""), model)
    try:
        _patch_norms(base, patches, norm, undo, applied)
        _patch_mlps(base, patches, gated, undo, applied)
        if patches.rope:
            _patch_rope(model, rope, undo, applied)
        if patches.loss == FLCE:
            _patch_loss(model, functools.partial(causal_lm_loss, cuda=cuda, chunk_rows=chunk_rows), undo, applied)
        for why in dict.fromkeys(applied.skipped):
            logger.info("Liger-Kernel stand-ins for %s: %s", patches.model_type, why)
        yield applied
    finally:
        for step in reversed(undo):
            step()


def _bind(module, forward, undo: list) -> None:
    """`forward` as the instance's own method, as Liger's `_bind_method_to_module` binds it (monkey_patch.py:67-69)."""
    had = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    module.__dict__["forward"] = types.MethodType(forward, module)
    undo.append(lambda: module.__dict__.__setitem__("forward", previous) if had else module.__dict__.pop("forward"))


def _attribute(module, path: str):
    for name in path.split("."):
        module = getattr(module, name, None)
    return module


def _patch_norms(base, patches: Patches, norm, undo: list, applied: Applied) -> None:
    norms, layers = patches.norms, getattr(base, "layers", None)
    if norms is None:
        return
    if layers is None or getattr(base, "norm", None) is None:
        applied.skipped.append(f"rms_norm: {type(base).__name__} has no `layers` and `norm`")
        return
    targets = [(_attribute(layer, path), norms.in_place) for layer in layers for path in norms.layer]
    targets.append((base.norm, norms.final_in_place))
    for module, in_place in targets:
        if module is None or getattr(module, "weight", None) is None:
            applied.skipped.append("rms_norm: a norm the layout names is missing or has no weight")
            continue
        _bind(module, functools.partial(_norm_forward, norm, in_place), undo)
        applied.patched["rms_norm"] += 1


def _norm_forward(norm, in_place, self, hidden_states):
    return norm.apply(hidden_states, self.weight, in_place)


def _patch_mlps(base, patches: Patches, gated, undo: list, applied: Applied) -> None:
    forward = {SWIGLU: _swiglu_forward, GEGLU: _swiglu_forward, PHI3_SWIGLU: _fused_gate_up_forward}.get(
        patches.modelled_mlp)
    if forward is None:
        return
    fused = patches.modelled_mlp == PHI3_SWIGLU
    needs = ("gate_up_proj", "down_proj") if fused else ("gate_proj", "up_proj", "down_proj")
    for layer in getattr(base, "layers", ()):
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not all(hasattr(mlp, name) for name in needs):
            applied.skipped.append(f"mlp: a layer's `mlp` lacks {', '.join(needs)}")
            continue
        _bind(mlp, functools.partial(forward, gated), undo)
        applied.patched["mlp"] += 1


def _swiglu_forward(gated, self, x):
    """LigerSwiGLUMLP.forward / LigerGEGLUMLP.forward (transformers/swiglu.py:34-35, transformers/geglu.py:22-23)."""
    return self.down_proj(gated.apply(self.gate_proj(x), self.up_proj(x)))


def _fused_gate_up_forward(gated, self, x):
    """LigerPhi3SwiGLUMLP.forward (transformers/swiglu.py:134-137)."""
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(gated.apply(gate, up))


def _patch_rope(model, rope, undo: list, applied: Applied) -> None:
    """`modeling_<type>.apply_rotary_pos_emb = liger_rotary_pos_emb` (monkey_patch.py:290-291 for llama): a module
    global the attention looks up when it runs."""
    import sys

    module = sys.modules.get(type(model).__module__)
    original = getattr(module, "apply_rotary_pos_emb", None)
    if original is None:
        applied.skipped.append(f"rope: {type(model).__module__} has no apply_rotary_pos_emb")
        return

    def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return rope.apply(q, k, cos, sin)

    module.apply_rotary_pos_emb = liger_rotary_pos_emb
    undo.append(lambda: setattr(module, "apply_rotary_pos_emb", original))
    applied.patched["rope"] = 1


def _patch_loss(model, loss, undo: list, applied: Applied) -> None:
    """The causal LM's forward as Liger's `lce_forward` runs it in training with labels (transformers/model/llama.py:
    80-155): the decoder, then the loss on its last hidden state, no logits. Recognised for decoder-only causal LMs
    (`model.model` or `get_decoder()`, then `lm_head`); otherwise the loss is left as HF's, with the reason."""
    why = _unrecognised(model)
    if why:
        applied.skipped.append(f"{FLCE}: {why}; the loss is traced as HF's")
        return
    decoder = getattr(model, "model", None) or model.get_decoder()
    original = type(model).forward.__get__(model)
    _bind(model, functools.partial(_lce_forward, decoder, original, loss), undo)
    applied.patched[FLCE] = 1


def _unrecognised(model) -> str | None:
    """Why the FLCE stand-in cannot run this model's loss, or None."""
    import torch

    name, config = type(model).__name__, model.config
    if not name.endswith("ForCausalLM"):
        return f"{name} is not a decoder-only causal LM"
    if not isinstance(getattr(model, "lm_head", None), torch.nn.Linear) or model.lm_head.bias is not None:
        return f"{name} has no bias-free `lm_head` Linear"
    if getattr(model, "model", None) is None and not hasattr(model, "get_decoder"):
        return f"{name} has no decoder at `model` or `get_decoder()`"
    if getattr(config, "output_router_logits", False):
        return "the router's auxiliary loss (output_router_logits) is not modelled"
    if getattr(config, "pretraining_tp", 1) > 1:
        return "Liger refuses pretraining_tp > 1 (transformers/model/llama.py:104-105)"
    return None


def _lce_forward(decoder, original, loss, self, input_ids=None, labels=None, **kwargs):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if labels is None or not self.training:  # logits as HF computes them (transformers/model/llama.py:113-137)
        return original(input_ids=input_ids, labels=labels, **kwargs)
    out = decoder(input_ids=input_ids, **kwargs)
    return CausalLMOutputWithPast(loss=loss(out[0], self.lm_head.weight, labels), logits=None,
                                  past_key_values=getattr(out, "past_key_values", None))


def causal_lm_loss(hidden, weight, labels, *, cuda: bool = True, chunk_rows=None):
    """`LigerForCausalLMLoss` (transformers/model/loss_utils.py:67-106) with the FLCE stand-in: labels padded and
    shifted, tokens flattened, the fused loss on the last hidden state without an upcast."""
    import torch

    labels = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)
    shift_labels = labels[..., 1:].contiguous()
    hidden = hidden.view(-1, hidden.shape[-1])
    return fused_linear_cross_entropy(hidden, weight, shift_labels.view(-1), cuda=cuda, chunk_rows=chunk_rows)
