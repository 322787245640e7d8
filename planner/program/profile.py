"""The traced step's operations as a cost profile: what each kernel computes and moves, for the speed model.

`OpRecorder` is a TorchDispatchMode that sees every aten op of the traced forward and backward (recomputation
under checkpointing included) and records, per op: its kind (matmul, fused attention, view, or another kernel), its
FLOPs (torch.utils.flop_counter's formulas), the bytes of its inputs and outputs, its dtype, and the phase. Ops are
aggregated into a `Profile` keyed by what decides their time, so that a profile is small (JSON in the trace cache)
and can be extrapolated over depth like the activations, and over the micro-batch: every tensor dimension equal to
the traced token count (or micro-batch) is marked, so a profile traced at one micro-batch scales to another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from planner import facts
from planner.program.regions import decode
from planner.vocab import CHECKPOINTING, FP32_COMPUTE

_MATMULS = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2)}  # op -> the two operand positions
_ATTENTION_FORWARD = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                      "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
                      "_flash_attention_forward", "_efficient_attention_forward")
_ATTENTION_BACKWARD = ("_scaled_dot_product_flash_attention_backward",
                       "_scaled_dot_product_efficient_attention_backward",
                       "_scaled_dot_product_flash_attention_for_cpu_backward",
                       "_scaled_dot_product_cudnn_attention_backward", "_flash_attention_backward",
                       "_efficient_attention_backward")
#: grouped GEMMs (one per expert of a mixture): `OpRecorder._grouped_matmul`
_GROUPED_MATMULS = ("_grouped_mm", "grouped_mm")
_FREE = {"detach", "view", "_unsafe_view", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "select",
         "slice", "as_strided", "alias", "split", "split_with_sizes", "unbind", "chunk", "narrow", "reshape",
         "empty", "empty_like", "new_empty", "_reshape_alias", "lift_fresh", "diagonal", "view_as_real",
         "view_as_complex", "unfold", "sym_size", "sym_stride", "sym_numel", "is_same_size", "_to_copy_noop"}
#: `Tensor.device` asked from C++ of a fake tensor reaches every dispatch mode as an op (two in three of a traced
#: step's): it computes and allocates nothing, so the modes pass it straight on
DEVICE_QUERY = torch.ops.prim.device.default
HALF = "half"
FULL = FP32_COMPUTE
#: Dispatch kinds: who issues an op, and whether it launches a kernel.
PY_KERNELS, PY_VIEWS, MODULE_CALLS = "python_kernels", "python_views", "module_calls"
ENGINE_KERNELS, ENGINE_VIEWS = "engine_kernels", "engine_views"
PYTHON_DISPATCH = (PY_KERNELS, PY_VIEWS, MODULE_CALLS)
#: Kernels a compiled graph's generated wrapper launches: no autograd, autocast or module Python around them
GRAPH_KERNELS = "graph_kernels"
#: Ops a selective-checkpointing policy handles: torch's per-op SAC runs a Python TorchDispatchMode over every op of a
#: checkpointed block, in its forward and again in its recompute (torch/utils/checkpoint.py
#: `_CachingTorchDispatchMode`, `_CachedTorchDispatchMode`, each calling the policy)
POLICY_OPS = "policy_ops"


def _dtype_class(dtype: torch.dtype) -> str:
    return HALF if dtype in (torch.float16, torch.bfloat16) else FULL


def _argument(func, args, kwargs, name: str):
    """The value of the op's argument `name` (from its schema), or None."""
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            return kwargs.get(name, args[i] if i < len(args) else argument.default_value)
    return None


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


#: a CUDA thread block's shared memory without opting in to more (cudaDeviceProp.sharedMemPerBlock: 48 KiB on NVIDIA
#: GPUs since Kepler); SoftMax.cu caches a softmax row in it only where the row fits (`cunn_SoftMaxForwardSmem`)
SHARED_MEMORY_PER_BLOCK = 48 * 1024


def _uncached_row(t: torch.Tensor, dim: int) -> bool:
    """Whether SoftMax.cu reads this softmax's rows from device memory once per pass: a row over the last dimension
    larger than a block's shared memory (smaller rows stay on chip or in L2 between passes)."""
    return dim in (-1, t.dim() - 1) and t.shape[-1] * t.element_size() > SHARED_MEMORY_PER_BLOCK


@dataclass
class Profile:
    """Aggregated costs of one traced micro-step. Keys are strings so the profile is JSON."""

    #: "b,m,n,k,dtype,phase,scaled" -> count: GEMMs by shape; `scaled` says which of b, m, n, k grow with tokens
    matmuls: dict[str, float] = field(default_factory=dict)
    #: "dtype,phase" -> [flops, token-scaled bytes, fixed bytes, count]: fused attention kernels
    attention: dict[str, list[float]] = field(default_factory=dict)
    #: "dtype,phase" -> [token-scaled bytes, fixed bytes, count]: every other kernel (memory-bound)
    memory: dict[str, list[float]] = field(default_factory=dict)
    #: what the CPU dispatches, by who issues it (DISPATCH_KINDS): Python issues the forward's kernels and views
    #: and calls the nn.Modules; the autograd engine (C++) issues the backward's
    dispatch: dict[str, float] = field(default_factory=dict)
    #: the step's ops up to each point where the host waits for the GPU within it, in order (a `.item()` or a
    #: comparison read on the host, as Liger's fused loss does: liger_kernel ops/fused_linear_cross_entropy.py:131-132
    #: and :420): the host cannot run ahead past such a point, so the work between two of them overlaps apart
    syncs: tuple["Profile", ...] = ()

    def to_json(self) -> dict:
        out = {"matmuls": self.matmuls, "attention": self.attention, "memory": self.memory, "dispatch": self.dispatch}
        return out | ({"syncs": [p.to_json() for p in self.syncs]} if self.syncs else {})

    @staticmethod
    def from_json(data: dict) -> "Profile":
        return Profile(dict(data["matmuls"]), {k: list(v) for k, v in data["attention"].items()},
                       {k: list(v) for k, v in data["memory"].items()}, dict(data["dispatch"]),
                       tuple(Profile.from_json(p) for p in data.get("syncs", ())))

    def copy(self) -> "Profile":
        """A copy whose tables can change apart from this one's (`syncs` are shared: they are never changed)."""
        return Profile(dict(self.matmuls), {k: list(v) for k, v in self.attention.items()},
                       {k: list(v) for k, v in self.memory.items()}, dict(self.dispatch), self.syncs)

    def without_syncs(self) -> "Profile":
        return Profile(self.matmuls, self.attention, self.memory, self.dispatch)

    def gemms(self):
        """(count, [b, m, n, k], dtype class, phase, which of b, m, n, k grow with tokens) per matmul key."""
        for key, count in self.matmuls.items():
            b, m, n, k, dtype, phase, scaled = key.split(",")
            yield count, [float(b), float(m), float(n), float(k)], dtype, phase, [s == "1" for s in scaled]

    def count(self, kind: str, n: float = 1.0) -> None:
        self.dispatch[kind] = self.dispatch.get(kind, 0.0) + n

    def extrapolated(self, other: "Profile", l1: int, l2: int, layers: int) -> "Profile":
        """Linear over depth through this profile (l1 blocks) and `other` (l2 blocks), at `layers`."""
        t = (layers - l1) / (l2 - l1) if l2 != l1 else 0.0

        def mix(a, b):
            return max(0.0, a + t * (b - a))

        def mix_dict(a: dict, b: dict):
            out = {}
            for key in sorted(set(a) | set(b)):  # a fixed order: float sums do not depend on string hashing
                va, vb = a.get(key), b.get(key)
                if isinstance(va or vb, list):
                    va, vb = va or [0.0] * len(vb), vb or [0.0] * len(va)
                    out[key] = [mix(x, y) for x, y in zip(va, vb)]
                else:
                    out[key] = mix(va or 0.0, vb or 0.0)
            return out

        syncs = tuple(a.extrapolated(b, l1, l2, layers) for a, b in zip(self.syncs, other.syncs)) \
            if len(self.syncs) == len(other.syncs) else ()
        return Profile(mix_dict(self.matmuls, other.matmuls), mix_dict(self.attention, other.attention),
                       mix_dict(self.memory, other.memory), mix_dict(self.dispatch, other.dispatch), syncs)

    def scaled_add(self, other: "Profile", factor: float, *, matmul_factor: float | None = None,
                   attention: bool = True, policy: bool = False) -> "Profile":
        """This profile plus `factor` x the forward entries of `other` (recomputation of blocks), matmuls at
        `matmul_factor` x instead where given, fused attention only if `attention`. Recomputation re-runs the
        block's Python forward whatever is kept: its dispatches count in full. With `policy` a per-op policy's
        dispatch mode handles each of the block's forward ops twice (`POLICY_OPS`)."""
        mm_factor = factor if matmul_factor is None else matmul_factor
        out = self.copy()  # recomputation runs in the backward: after any sync of the forward
        for kind in PYTHON_DISPATCH:
            out.count(kind, factor * other.dispatch.get(kind, 0.0))
        if policy:
            forward_ops = other.dispatch.get(PY_KERNELS, 0.0) + other.dispatch.get(PY_VIEWS, 0.0)
            out.count(POLICY_OPS, 2 * factor * forward_ops)
        for key, count in other.matmuls.items():
            if ",forward," in key:
                recomputed = key.replace(",forward,", ",backward,")
                out.matmuls[recomputed] = out.matmuls.get(recomputed, 0.0) + mm_factor * count
        for table, source, use in ((out.attention, other.attention, attention), (out.memory, other.memory, True)):
            for key, values in source.items():
                if key.endswith(",forward") and use:
                    target = table.setdefault(key.replace(",forward", ",backward"), [0.0] * len(values))
                    table[key.replace(",forward", ",backward")] = [a + factor * b for a, b in zip(target, values)]
        return out

    def compiled(self, bytes_ratio: dict[str, float], kernel_ratio: dict[str, float]) -> "Profile":
        """This step under torch.compile: per phase, the memory-bound kernels' bytes and count scaled by Inductor's
        fusion (planner/program/compiled.py); GEMMs and attention unchanged. The host no longer runs the modules'
        Python nor the autograd engine op by op: Inductor's generated wrapper (Python) launches each kernel, GEMMs
        and attention included, so every launched kernel counts as one graph-launched kernel (`GRAPH_KERNELS`) and
        views cost nothing."""
        memory = {}
        for key, (scaled, fixed, count) in self.memory.items():
            phase = key.split(",")[1]
            memory[key] = [scaled * bytes_ratio[phase], fixed * bytes_ratio[phase], count * kernel_ratio[phase]]
        launched = (sum(self.matmuls.values()) + sum(v[3] for v in self.attention.values())
                    + sum(v[2] for v in memory.values()))
        return Profile(dict(self.matmuls), {k: list(v) for k, v in self.attention.items()}, memory,
                       {GRAPH_KERNELS: launched}, tuple(p.compiled(bytes_ratio, kernel_ratio) for p in self.syncs))

    def minus(self, other: "Profile") -> "Profile":
        """This profile less `other`, entry by entry (never below zero): one block, from two depths."""
        def sub(a: dict, b: dict):
            out = {}
            for key, value in a.items():
                base = b.get(key)
                if isinstance(value, list):
                    out[key] = [max(0.0, x - y) for x, y in zip(value, base or [0.0] * len(value))]
                else:
                    out[key] = max(0.0, value - (base or 0.0))
            return out

        return Profile(sub(self.matmuls, other.matmuls), sub(self.attention, other.attention),
                       sub(self.memory, other.memory), sub(self.dispatch, other.dispatch))

    def synced(self) -> list["Profile"] | None:
        """The step as the host runs it apart around its syncs: the ops before the first, between each two, after the
        last (None: no sync)."""
        if not self.syncs:
            return None
        marks = [Profile()] + list(self.syncs) + [self.without_syncs()]
        return [later.minus(earlier) for earlier, later in zip(marks, marks[1:])]


class OpRecorder(TorchDispatchMode):
    """Records the cost of every op into a Profile. `tokens` and `micro_batch` are the traced step's, so that
    token-proportional dimensions and bytes can be told from fixed ones; `phase` is set by the caller.

    With `regions` (planner/program/regions.py `BlockRegions`) every op outside the last block, in both phases, also
    goes to `shallower`: the step as traced one block shallower."""

    def __init__(self, micro_batch: int, seq_len: int, regions=None, cuda_kernels: bool = False):
        super().__init__()
        self.profile = Profile()
        self.micro_batch, self.seq_len, self.tokens = micro_batch, seq_len, micro_batch * seq_len
        self.cuda_kernels = cuda_kernels  # count what ATen's CUDA kernels move beyond their operands (`_kernel_bytes`)
        self.phase = "forward"
        self.regions = regions
        self.shallower = Profile() if regions is not None and regions.layers > 1 else None

    def synchronised(self) -> None:
        """The host waits for the GPU here (a `.item()` the step runs): what the profiles hold so far runs before it."""
        for profile in [self.profile] + ([self.shallower] if self.shallower is not None else []):
            profile.syncs += (Profile.from_json(profile.without_syncs().to_json()),)

    def profiles(self) -> list[Profile]:
        """The profiles the current op counts in."""
        if self.shallower is None or decode(self.regions.code())[0] == self.regions.layers - 1:
            return [self.profile]
        return [self.profile, self.shallower]

    def __enter__(self):
        from torch.nn.modules.module import register_module_forward_pre_hook

        self._hook = register_module_forward_pre_hook(self._module_called)
        return super().__enter__()

    def __exit__(self, *exc):
        self._hook.remove()
        return super().__exit__(*exc)

    def _module_called(self, module, args) -> None:
        if self.phase == "forward":  # recomputation under checkpointing is counted from the forward's
            for profile in self.profiles():
                profile.count(MODULE_CALLS)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is DEVICE_QUERY:
            return out
        name = func.overloadpacket.__name__
        try:
            for profile in self.profiles():
                self._record(profile, func, name, args, kwargs, out)
        except Exception:  # noqa: BLE001 - a cost we cannot read is a cost we skip, never a failed trace
            pass
        return out

    def _record(self, profile: Profile, func, name, args, kwargs, out) -> None:
        python = self.phase == "forward"
        if name in _FREE:
            profile.count(PY_VIEWS if python else ENGINE_VIEWS)
            return
        if not _tensors(out):  # metadata queries (device, sizes): a real tensor answers them without dispatch
            return
        profile.count(PY_KERNELS if python else ENGINE_KERNELS)
        if name in _MATMULS:
            self._matmul(profile, name, args)
            self._accumulated(profile, name, args, kwargs, out)
        elif name in _GROUPED_MATMULS:
            self._grouped_matmul(profile, args)
        elif name in _ATTENTION_FORWARD or name in _ATTENTION_BACKWARD:
            self._attention(profile, func, name, args, kwargs, out)
        else:
            self._memory(profile, args, out)
            if self.cuda_kernels:
                self._kernel_bytes(profile, name, args)

    def _token_bytes(self, t: torch.Tensor) -> tuple[float, float]:
        """(bytes that grow with the micro-batch, fixed bytes) of a tensor: it grows where it has a token dimension,
        the micro-batch before a sequence, or is attention scores with the heads folded into the batch, (micro-batch
        x heads, seq, seq) as BLOOM's `alibi.baddbmm(q, k)` and OPT's eager `bmm` make them (a weight-shaped batch,
        experts x d x d', has no sequence in its last two dimensions)."""
        # a broadcast (expanded) view reads its storage, not its logical size
        nbytes = float(min(t.numel() * t.element_size(), t.untyped_storage().nbytes()))
        shape = tuple(t.shape)
        scaled = (self.tokens in shape or (len(shape) >= 2 and shape[0] == self.micro_batch and
                                           self.seq_len in shape[1:])
                  or (len(shape) == 3 and shape[0] % self.micro_batch == 0 and shape[1] == shape[2] == self.seq_len))
        return (nbytes, 0.0) if scaled else (0.0, nbytes)

    def _memory(self, profile: Profile, args, out) -> None:
        tensors = _tensors(args) + _tensors(out)
        self._moves(profile, _tensors(out)[0].dtype, [(1, t) for t in tensors], kernels=1)

    def _moves(self, profile: Profile, dtype, moved, kernels: int) -> None:
        """`kernels` memory-bound kernels of `dtype` moving each tensor of `moved`'s (times, tensor) pairs `times`
        over (negative: bytes counted elsewhere that are never moved)."""
        entry = profile.memory.setdefault(f"{_dtype_class(dtype)},{self.phase}", [0.0, 0.0, 0.0])
        for times, t in moved:
            scaled, fixed = self._token_bytes(t)
            entry[0] += times * scaled
            entry[1] += times * fixed
        entry[2] += kernels

    def _kernel_bytes(self, profile: Profile, name, args) -> None:
        """What ATen's CUDA kernel for op `name` moves beyond reading its arguments and writing its outputs once
        (aten/src/ATen/native/cuda/SoftMax.cu, LossNLL.cu): a softmax row too large for a block's shared memory is
        read three times forward (max, sum of exponentials, write) and its gradient twice backward (sum, write);
        softmax's backward first computes `tmp = grad * output` in a kernel of its own (`softmax_backward_cuda_out`);
        NLL loss reads one entry of each row, and its backward zero-fills the gradient without reading the input."""
        moved, kernels = [], 0  # (times a tensor's bytes move beyond once: negative where never read, the tensor)
        if name in ("_softmax", "_log_softmax") and _uncached_row(args[0], args[1]):
            moved = [(2, args[0])]
        elif name in ("_softmax_backward_data", "_log_softmax_backward_data"):
            grad, output = args[0], args[1]
            if name == "_softmax_backward_data":  # tmp = grad * output: reads both, writes tmp (grad's size)
                moved, kernels = [(2, grad), (1, output)], 1
            if _uncached_row(grad, args[2]):
                moved.append((1, grad))
        elif name == "nll_loss_forward":
            moved = [(-1, args[0])]
        elif name == "nll_loss_backward":
            moved = [(-1, args[1])]
        if moved:
            self._moves(profile, args[0].dtype, moved, kernels)

    def _matmul(self, profile: Profile, name, args) -> None:
        i, j = _MATMULS[name]
        a, b = args[i], args[j]
        batch = a.shape[0] if a.dim() == 3 else 1
        m, k = a.shape[-2], a.shape[-1]
        n = b.shape[-1]
        # the batch of a bmm (micro-batch x heads in HF attention) and any dimension equal to the token count
        # grow with the micro-batch; the anchor micro-batch is chosen so that no weight dimension equals it
        scaled = "".join("1" if (x == 0 and a.dim() == 3) or d == self.tokens else "0"
                         for x, d in enumerate((batch, m, n, k)))
        key = f"{batch},{m},{n},{k},{_dtype_class(a.dtype)},{self.phase},{scaled}"
        profile.matmuls[key] = profile.matmuls.get(key, 0.0) + 1

    def _accumulated(self, profile: Profile, name, args, kwargs, out) -> None:
        """What an addmm or baddbmm moves beyond its GEMM's operands and 16-bit output, when it adds a whole matrix
        rather than a bias row: cuBLAS reads that matrix (beta 1), after ATen has copied it into the result where
        the result is another tensor (aten/src/ATen/native/cuda/Blas.cpp `addmm_out_cuda_impl`, `baddbmm_out_cuda_impl`:
        `result.copy_(self)` before the GEMM; a 1-D bias goes to cuBLASLt's bias epilogue instead), and a wider
        output writes its extra bytes (Liger's fused loss accumulates its weight gradient into an fp32 matrix, chunk
        after chunk: liger_kernel ops/fused_linear_cross_entropy.py:326-349). Bytes only: no kernel of its own."""
        added, result = args[0], _tensors(out)[0]
        if not isinstance(added, torch.Tensor) or added.dim() < 2 or name not in ("addmm", "baddbmm"):
            return
        written = result.numel() * args[_MATMULS[name][0]].element_size()
        copied = 0 if kwargs.get("out") is added else result.numel() * result.element_size()
        scaled, _fixed = self._token_bytes(result)
        extra = (result.numel() * result.element_size()) * 2 - written + copied  # read C, wider write, the copy
        entry = profile.memory.setdefault(f"{_dtype_class(result.dtype)},{self.phase}", [0.0, 0.0, 0.0])
        entry[0 if scaled else 1] += extra

    def _grouped_matmul(self, profile: Profile, args) -> None:
        """torch._grouped_mm, as transformers' default `grouped_mm` experts run a mixture of experts
        (transformers/integrations/moe.py `grouped_mm_experts_forward`): one GEMM per group (expert), the rows a
        group gets taken as equal (tokens x top-k / experts). The layouts are torch's (aten/src/ATen/native/cuda/
        GroupedBlas.cpp): 2D x 3D splits the rows of the first operand by `offs` (forward, input gradient), 2D x 2D
        splits the inner dimension (the weight gradient), 3D x 3D is a plain batch."""
        a, b = args[0], args[1]
        if a.dim() == 2 and b.dim() == 3:
            groups = b.shape[0]
            dims, scaled = (groups, a.shape[0] / groups, b.shape[-1], a.shape[1]), "0100"
        elif a.dim() == 2 and b.dim() == 2:
            groups = args[2].shape[0]
            dims, scaled = (groups, a.shape[0], b.shape[1], a.shape[1] / groups), "0001"
        elif a.dim() == 3 and b.dim() == 2:
            groups = a.shape[0]
            dims, scaled = (groups, a.shape[1], b.shape[1] / groups, a.shape[2]), "0010"
        else:
            dims, scaled = (a.shape[0], a.shape[1], b.shape[-1], a.shape[2]), "0000"
        key = f"{dims[0]},{dims[1]:g},{dims[2]:g},{dims[3]:g},{_dtype_class(a.dtype)},{self.phase},{scaled}"
        profile.matmuls[key] = profile.matmuls.get(key, 0.0) + 1

    def _attention(self, profile: Profile, func, name, args, kwargs, out) -> None:
        tensors = _tensors(args)
        if "backward" in name:
            grad_out, q, k, v = tensors[:4]
            flops = sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)
        else:
            q, k, v = tensors[:3]
            flops = sdpa_flop_count(q.shape, k.shape, v.shape)
        if _argument(func, args, kwargs, "is_causal"):  # the kernels skip the masked half of the score tiles
            flops /= 2
        entry = profile.attention.setdefault(f"{_dtype_class(q.dtype)},{self.phase}", [0.0, 0.0, 0.0, 0.0])
        entry[0] += flops
        for t in tensors + _tensors(out):
            scaled, fixed = self._token_bytes(t)
            entry[1] += scaled
            entry[2] += fixed
        entry[3] += 1


__all__ = ["OpRecorder", "Profile", "HALF", "FULL"]


def analytic_profile(spec, seq_len: int, checkpointing: str) -> tuple[Profile, int]:
    """A profile from the architecture's shapes, at micro-batch 1 (the fallback when tracing fails): per block and
    token the non-GEMM kernels move `analytic_profile.bytes_per_token_h` values of the hidden size, in
    `analytic_profile.kernels_per_block` kernels, the backward twice the forward."""
    profile, t, h = Profile(), seq_len, spec.hidden
    per_token_h = facts.get("analytic_profile.bytes_per_token_h")
    block_kernels = facts.get("analytic_profile.kernels_per_block")
    kv = spec.kv_heads * spec.head_dim
    # (groups, rows per group, k, n): a mixture's MLP runs one GEMM per expert over tokens x top-k / experts rows
    experts = spec.num_experts if spec.num_experts > 1 else 1
    rows = t * (spec.experts_per_token if experts > 1 else 1) / experts
    gemms = [(1, t, h, h + 2 * kv), (1, t, h, h), (experts, rows, h, spec.ffn * (2 if spec.gated_mlp else 1)),
             (experts, rows, spec.ffn, h)]
    info = CHECKPOINTING[checkpointing]
    forwards = 1.0 + (1.0 if info.enabled and not info.per_op_policy else 0.5 if info.per_op_policy else 0.0)
    for phase, passes in (("forward", forwards), ("backward", 1.0)):
        for b, m, k, n in gemms:
            for key in ([f"{b},{m:g},{n},{k},{HALF},{phase},0100"] if phase == "forward" else
                        [f"{b},{m:g},{k},{n},{HALF},{phase},0100", f"{b},{k},{n},{m:g},{HALF},{phase},0001"]):
                profile.matmuls[key] = profile.matmuls.get(key, 0.0) + passes * spec.layers
        flops = 4.0 * spec.heads * t * t * spec.head_dim * (passes if phase == "forward" else 2.5) * spec.layers
        profile.attention[f"{HALF},{phase}"] = [flops, 4.0 * t * h * 2 * spec.layers, 0.0, passes * spec.layers]
        moved = per_token_h * h * 2 * t * spec.layers * (passes if phase == "forward" else 2)
        kernels = block_kernels * spec.layers * (passes if phase == "forward" else 2)
        profile.memory[f"{HALF},{phase}"] = [moved, 0.0, kernels]
        launched = kernels + 4 * spec.layers * (passes if phase == "forward" else 2) + spec.layers * passes
        profile.count(PY_KERNELS if phase == "forward" else ENGINE_KERNELS, launched)
    profile.count(MODULE_CALLS, facts.get("analytic_profile.modules_per_block") * spec.layers * forwards)
    if info.per_op_policy:  # a block's forward launches (its kernels, GEMMs, attention), in forward and recompute
        profile.count(POLICY_OPS, 2 * spec.layers * (block_kernels + len(gemms) + 1))
    if spec.has_lm_head:
        profile.matmuls[f"1,{t},{spec.vocab},{h},{HALF},forward,0100"] = 1.0
        profile.matmuls[f"1,{t},{h},{spec.vocab},{HALF},backward,0100"] = 1.0
        profile.matmuls[f"1,{h},{spec.vocab},{t},{HALF},backward,0001"] = 1.0
    return profile, 1
