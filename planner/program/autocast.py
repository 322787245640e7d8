"""CUDA's autocast rules applied to a trace that runs on the CPU.

A CPU build can only trace under CPU autocast, whose op lists differ from CUDA's: CPU autocast runs softmax, pow,
layer_norm and most reductions in the 16-bit dtype, where CUDA runs them in fp32 and saves fp32 tensors for
backward (GPT-2's NewGELU is built on `pow`, so a CUDA step keeps fp32 copies a CPU step does not). Autocast is a
dispatch key above autograd (aten/src/ATen/autocast_mode.cpp: casts are autograd-visible, so what an op saves for
backward has the cast dtype); `cuda_autocast_rules` re-registers the AutocastCPU kernels for the length of a trace
with CUDA's policies, so fake CPU tensors are cast exactly where a CUDA step would cast them:

* lower precision (matmuls, convolutions, SDPA): cast floating inputs to the autocast dtype. Where CPU autocast
  has the same op in its own lower-precision list, torch's CPU kernel is kept: it applies the same policy and keeps
  torch's cache of fp32 weights' 16-bit copies (cleared when the outermost autocast exits). The few CUDA-only ones
  (einsum, mv, addmv, addr, RNN cells, ...) cast without that cache.
* fp32: cast 16-bit inputs to fp32; set_dtype: run with `dtype=torch.float32` unless the caller set one (softmax,
  log_softmax, sum, prod, cumsum, norms); append_dtype: `norm` redispatched to its dtype overload; promote: the
  widest floating input's dtype.
* ops CPU autocast lists and CUDA does not (cross_entropy_loss, cat, stack, fft, linalg, ...) fall through, as
  every unlisted op does on CUDA (their parts are dispatched through autocast again).

The lists are those of the installed torch's `torch/include/ATen/autocast_mode.h` (2.13.0: lines 820-957,
`AT_FORALL_LOWER_PRECISION_FP`, `AT_FORALL_FP32`, `AT_FORALL_FP32_SET_OPT_DTYPE`,
`AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`, `AT_FORALL_PROMOTE`); tests/test_autocast_rules.py compares them with
the header of the installed torch. The cast rules themselves (`cached_cast`, `is_eligible`: floating, not double,
on the autocast's device; `prioritize` for promote) are in the same header, lines 240-370.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

LOWER = "lower"
FLOAT = "float"
SET_DTYPE = "set_dtype"
APPEND_DTYPE = "append_dtype"
PROMOTE = "promote"

CUDA_LOWER_PRECISION = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul",
    "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention")
CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
    "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bicubic2d_aa")
CUDA_FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList")
#: fp32_append_dtype: the overload registered -> the dtype-taking overload it redispatches to
CUDA_FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
CUDA_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
                "tensordot", "scatter_add")


def cuda_policies() -> dict[str, str]:
    """aten overload name -> CUDA autocast policy."""
    table = {name: LOWER for name in CUDA_LOWER_PRECISION}
    table |= {name: FLOAT for name in CUDA_FP32}
    table |= {name: SET_DTYPE for name in CUDA_FP32_SET_OPT_DTYPE}
    table |= {name: APPEND_DTYPE for name in CUDA_FP32_APPEND_DTYPE}
    return table | {name: PROMOTE for name in CUDA_PROMOTE}


def _overload(name: str):
    """torch.ops.aten's OpOverload for "op" or "op.overload"; None where the installed torch lacks it."""
    import torch

    op, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, op, None)
    return getattr(packet, overload or "default", None) if packet is not None else None


def _eligible(value, torch) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _cast(value, dtype, torch):
    if _eligible(value, torch) and value.dtype != dtype:
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype, torch) for v in value)
    return value


def _widest(values, lower, torch):
    """`prioritize` over the arguments: fp32 if any eligible floating input is fp32, else the autocast dtype."""
    flat = [v for value in values for v in (value if isinstance(value, (list, tuple)) else (value,))]
    return torch.float32 if any(_eligible(v, torch) and v.dtype == torch.float32 for v in flat) else lower


def _kernel(op, policy: str, lower, target=None):
    """A Python AutocastCPU kernel applying CUDA's `policy` to `op` (no autocast for the ops it calls)."""
    import torch

    excluded = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    dtype_position = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            if policy in (LOWER, FLOAT, PROMOTE):
                dtype = {LOWER: lower, FLOAT: torch.float32}.get(policy) or _widest(args, lower, torch)
                return op(*_cast(args, dtype, torch), **{k: _cast(v, dtype, torch) for k, v in kwargs.items()})
            if not (args and _eligible(args[0], torch)):
                return op(*args, **kwargs)
            if policy == APPEND_DTYPE:
                return target(*args, dtype=torch.float32, **kwargs)
            given = kwargs.get("dtype", args[dtype_position] if dtype_position is not None
                               and len(args) > dtype_position else None)
            if given is None:
                args = args[:dtype_position] if dtype_position is not None else args
                kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    return kernel


def _fall_through(op):
    """Dispatch past autocast for this op only; the ops it is made of go through autocast again."""
    import torch

    key = torch._C.DispatchKey.AutocastCPU

    def kernel(keyset, *args, **kwargs):
        return op.redispatch(keyset.remove(key), *args, **kwargs)

    return kernel


@functools.lru_cache(maxsize=1)
def _registered_on_cpu_autocast() -> frozenset[str]:
    import torch

    return frozenset({name.removeprefix("aten::") for name in torch._C._dispatch_get_all_op_names()
            if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCPU")})


@contextlib.contextmanager
def cuda_autocast_rules(dtype_name: str):
    """Within the block, CPU autocast (entered by the traced step with dtype `dtype_name`) follows CUDA's op lists."""
    import torch

    lower = getattr(torch, dtype_name)
    on_cpu = _registered_on_cpu_autocast()
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # re-registering a kernel for a key warns once per op
            for name, policy in cuda_policies().items():
                op = _overload(name)
                if op is None or (policy == LOWER and name in on_cpu):
                    continue
                target = _overload(CUDA_FP32_APPEND_DTYPE[name]) if policy == APPEND_DTYPE else None
                library.impl(name, _kernel(op, policy, lower, target), "AutocastCPU")
            for name in sorted(on_cpu - set(cuda_policies())):
                op = _overload(name)
                if op is not None:
                    library.impl(name, _fall_through(op), "AutocastCPU", with_keyset=True)
        yield
    finally:
        library._destroy()
