"""Liger-Kernel in the traced program (planner/program/liger.py): the patch table against liger-kernel's own, the
chunking and the fused loss's forward against liger's own FLCE run on the CPU, the fused loss against a real chunked
loss and HF's loss, the norm and MLP stand-ins against Liger's own per-layer memory benchmark
(benchmarks/data/liger_layer_memory.json), and models traced with and without it.

The byte formulas are those of the research notes on liger-kernel 0.8.5 (per micro-batch of N tokens, hidden H,
intermediate I, vocabulary V, compute dtype bytes b_c): RMSNorm saves 4·N·H bytes less than HF's per norm, SwiGLU
N·I·b_c less per layer, RoPE nothing more, and the fused loss replaces HF's N·V·(b_c + 8) bytes at the forward's
peak (logits, their fp32 upcast, the saved log-softmax) with C·V·b_c + V·H·b_w + N·H·b_x (a chunk's logits, the
weight's and the input's gradients).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from planner.hardware import lookup_gpu
from planner.models import resolve_model
from planner.program import liger
from planner.program.autocast import cuda_autocast_rules
from planner.program.trace import TraceRequest, run_trace
from planner.program.tracker import LiveStorageTracker

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None and importlib.util.find_spec("triton") is not None
needs_liger = pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel is not installed in this environment")
NOT_INSTALLED = liger._not_installed


def tiny(config_class, layers=3, vocab=2000, **extra):
    return config_class(num_hidden_layers=layers, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=vocab, head_dim=16, tie_word_embeddings=False, **extra)


def request(**kw):
    base = dict(micro_batch=2, seq_len=64, activations="half", checkpointing="none", attention="flash",
                attention_dropout=False, autocast_device="cuda")
    return TraceRequest(**{**base, **kw})


# --- the table ------------------------------------------------------------------------------------------------------

@needs_liger
def test_table_matches_liger_kernels_own():
    """Every model type of MODEL_TYPE_TO_APPLY_LIGER_FN, with its apply function's def line and keyword defaults."""
    import inspect

    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    assert set(liger.SUPPORTED) == set(MODEL_TYPE_TO_APPLY_LIGER_FN)
    for model_type, fn in MODEL_TYPE_TO_APPLY_LIGER_FN.items():
        params = inspect.signature(fn).parameters
        on = {name for name, p in params.items() if p.default is True}
        entry = liger.SUPPORTED[model_type]
        assert entry.line == inspect.getsourcelines(fn)[1], model_type
        assert (entry.rope, entry.rms_norm, entry.layer_norm) == ("rope" in on, "rms_norm" in on, "layer_norm" in on)
        assert entry.mlp == next((n for n in ("swiglu", "geglu", "relu_squared") if n in on), None), model_type
        assert entry.loss == next((n for n in (liger.FLCE, liger.CROSS_ENTROPY) if n in on), None), model_type


#: Run in its own process: liger's apply functions also swap classes and functions in transformers' modules.
_PROBE = """
import json, logging, sys
import transformers
from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance
logging.disable(logging.WARNING)
small = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, head_dim=16, pad_token_id=0, num_local_experts=4, num_experts=4, moe_intermediate_size=32,
             num_experts_per_tok=2)
out = {}
for model_type in sys.argv[1:]:
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **small))
    _apply_liger_kernel_to_instance(model=model)
    bound = {name: m.__dict__["forward"] for name, m in model.named_modules() if "forward" in m.__dict__}
    out[model_type] = {"forward": bound.pop("").__module__ if "" in bound else None,
                       "norms": {n: [m.casting_mode, m.offset, m.in_place] for n, m in model.named_modules()
                                 if n in bound and hasattr(m, "casting_mode")},
                       "mlps": {n: f.__qualname__ for n, f in bound.items() if not hasattr(model.get_submodule(n),
                                                                                           "casting_mode")}}
print(json.dumps(out))
"""
_FORMS = {"LigerSwiGLUMLP.forward": liger.SWIGLU, "LigerHunyuanV1SwiGLUMLP.forward": liger.SWIGLU,
          "LigerPhi3SwiGLUMLP.forward": liger.PHI3_SWIGLU, "LigerGEGLUMLP.forward": liger.GEGLU,
          "LigerExperts.forward": liger.EXPERTS}


def _per_layer(names: dict) -> dict:
    """Module paths with the decoder layer's index dropped ("model.layers.1.mlp" -> "mlp"), the final norm kept."""
    return {name.split(".", 3)[-1] if ".layers." in name else name: value for name, value in names.items()}


@needs_liger
def test_instance_layouts_match_what_liger_binds():
    """What `_apply_liger_kernel_to_instance` binds on a tiny model of each type in LAYOUTS: the norms (with casting
    mode, offset, in_place), the MLP's form, and the FLCE forward (granite: cross_entropy instead)."""
    found = json.loads(subprocess.run([sys.executable, "-c", _PROBE, *liger.LAYOUTS], capture_output=True, text=True,
                                      check=True).stdout)
    for model_type, layout in liger.LAYOUTS.items():
        got, norms = found[model_type], layout.norms
        want = {path: [norms.casting_mode, norms.offset, norms.in_place] for path in norms.layer}
        want["model.norm"] = [norms.casting_mode, norms.offset, norms.final_in_place]
        assert _per_layer(got["norms"]) == want, model_type
        assert {_FORMS[q] for q in _per_layer(got["mlps"]).values()} == {layout.mlp}, model_type
        flce = liger.SUPPORTED[model_type].loss == liger.FLCE
        assert (got["forward"] is not None) == flce, model_type


def test_stand_ins_bind_the_modules_the_layouts_name():
    """The stand-ins bind the norms and MLPs of LAYOUTS (checked against liger above) and the causal LM's forward, and
    undo every binding on exit."""
    config = tiny(transformers.Qwen3Config, layers=2)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = transformers.Qwen3ForCausalLM(config)
    patches = liger.patches_for(config, "causal-lm")
    with liger.stand_ins(model, patches) as applied:
        bound = {name for name, m in model.named_modules() if "forward" in m.__dict__}
        assert applied.patched == {"rms_norm": 2 * 4 + 1, "mlp": 2, "rope": 1, liger.FLCE: 1}
        assert applied.skipped == []
    assert _per_layer(dict.fromkeys(bound)).keys() == {"", "model.norm", "mlp", "input_layernorm",
                                                       "post_attention_layernorm", "self_attn.q_norm",
                                                       "self_attn.k_norm"}
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert transformers.models.qwen3.modeling_qwen3.apply_rotary_pos_emb.__name__ == "apply_rotary_pos_emb"


@pytest.mark.parametrize("model_type, norms, mlp", [
    ("llama", ("input_layernorm", "post_attention_layernorm"), liger.SWIGLU),
    ("mistral", ("input_layernorm", "post_attention_layernorm"), liger.SWIGLU),
    ("qwen2", ("input_layernorm", "post_attention_layernorm"), liger.SWIGLU),
    ("gemma", ("input_layernorm", "post_attention_layernorm"), liger.GEGLU),
    ("gemma2", ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm"), liger.GEGLU),
    ("phi3", ("input_layernorm", "post_attention_layernorm"), liger.PHI3_SWIGLU),
])
def test_hand_checked_supported_types(model_type, norms, mlp):
    """Read by hand from monkey_patch.py (llama :259-323, mistral :723-784, qwen2 :1750-1814, gemma :1073-1139,
    gemma2 :1142-1213, phi3 :2371-2432): all patch RoPE, their RMSNorms and MLP and the loss with FLCE."""
    patches = liger.patches_for(transformers.AutoConfig.for_model(model_type), "causal-lm")
    assert patches.rope and patches.loss == liger.FLCE and not patches.unmodelled
    assert patches.norms.layer == norms and patches.mlp == mlp
    gemma = model_type.startswith("gemma")
    assert (patches.norms.casting_mode, patches.norms.offset) == (("gemma", 1.0) if gemma else ("llama", 0.0))
    assert patches.norms.in_place == (model_type != "gemma2")  # gemma2's residual needs dY (ops/rms_norm.py:646-648)
    assert patches.trainer_config() is None
    assert liger.applies(transformers.AutoConfig.for_model(model_type), lookup_gpu("A100-80GB"),
                         check_installed=False) is None


@pytest.mark.parametrize("model_type", ["bloom", "gpt2", "bert", "gpt_neox", "opt", "phi"])
def test_unsupported_types_are_a_no_op(model_type):
    config = transformers.AutoConfig.for_model(model_type)
    assert liger.patches_for(config, "causal-lm") is None
    assert "has no patches for model type" in liger.applies(config, check_installed=False)


def test_a_type_whose_layout_is_not_read_keeps_hf_norms_and_mlp():
    """deepseek_v3 is supported (monkey_patch.py:3655) but its instance layout is not in LAYOUTS: the fused loss is
    modelled, its norms and MLP are traced as HF's, and `unmodelled` says so."""
    patches = liger.patches_for(transformers.AutoConfig.for_model("deepseek_v3"), "causal-lm")
    assert patches.loss == liger.FLCE and patches.rms_norm and not patches.rope
    assert patches.norms is None and patches.mlp == liger.SWIGLU and patches.modelled_mlp is None
    assert any("layout is not read" in why for why in patches.unmodelled)


def test_a_classification_head_turns_the_fused_loss_off():
    """The FLCE patch rebinds `forward` to the causal-LM one whatever the head: the Trainer needs
    liger_kernel_config={"fused_linear_cross_entropy": False}; norms, MLP and RoPE stay patched."""
    config = transformers.AutoConfig.for_model("llama")
    for task in ("seq-cls", "token-cls", "other"):
        patches = liger.patches_for(config, task)
        assert patches.loss is None and patches.trainer_config() == {"fused_linear_cross_entropy": False}
        assert patches.norms is not None and patches.mlp == liger.SWIGLU and patches.rope
    granite = liger.patches_for(transformers.AutoConfig.for_model("granite"), "seq-cls")
    assert granite.loss == liger.CROSS_ENTROPY and granite.trainer_config() is None
    assert any("cross_entropy" in why for why in granite.unmodelled)


def test_gpu_rule():
    llama = transformers.AutoConfig.for_model("llama")
    for name in ("V100-16GB", "T4-16GB"):
        assert "Triton" in liger.applies(llama, lookup_gpu(name), check_installed=False)
    for name in ("A100-80GB", "H100-80GB", "L4-24GB", "MI300X-192GB"):
        assert liger.applies(llama, lookup_gpu(name), check_installed=False) is None


def test_not_installed_is_a_reason(monkeypatch):
    monkeypatch.setattr(liger, "_not_installed", NOT_INSTALLED)  # the real check, which tests/conftest.py replaces
    monkeypatch.setattr(liger.importlib.util, "find_spec", lambda name: None)
    assert "not installed" in liger.applies(transformers.AutoConfig.for_model("llama"), lookup_gpu("H100-80GB"))


#: The notes' models (Llama-3-8B, Qwen2-7B, Gemma-7B, Mistral-7B, Qwen2.5-0.5B): (hidden, vocabulary)
NOTES_HEADS = [(4096, 128256), (3584, 152064), (3072, 256000), (4096, 32000), (896, 151936)]


def test_chunking_follows_ligers_worked_example():
    """liger-kernel 0.8.5's own comment (ops/fused_linear_cross_entropy.py:98): "BT = 4096*4, V = 32000, H = 4096 ==>
    inc_factor = 8, chunk_size = 2048"."""
    assert liger.flce_chunks(4096 * 4, 4096, 32000) == (2048, 4096 * 4 // 2048)


class _NoKernel:
    """Stands for a Triton kernel launched as `kernel[grid](...)`: does nothing (the cross-entropy kernel writes its
    loss and gradient in place, allocating nothing)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def _ligers_own_flce(device: str):
    """liger-kernel's `fused_linear_cross_entropy_forward`, run as installed; on the CPU its one Triton kernel (the
    chunk's cross-entropy, `liger_cross_entropy_kernel`) replaced by a no-op, everything else (its chunking, its torch
    matmuls and buffers) liger's own."""
    import liger_kernel.ops.fused_linear_cross_entropy as flce

    kernel = flce.liger_cross_entropy_kernel
    if device == "cpu":
        flce.liger_cross_entropy_kernel = _NoKernel()
    try:
        yield flce.fused_linear_cross_entropy_forward
    finally:
        flce.liger_cross_entropy_kernel = kernel


class _LogitsMatmuls(TorchDispatchMode):
    """The rows of every matmul whose output has the vocabulary's width: a chunk's logits."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("mm", "addmm") and out.dim() == 2 and out.shape[1] == self.vocab:
            self.rows.append(out.shape[0])
        return out


def _chunk_rows(tokens: int, hidden: int, vocab: int, device: str = "cpu") -> list[int]:
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, device=device, requires_grad=True)
    weight = torch.randn(vocab, hidden, device=device, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,), device=device)
    with _ligers_own_flce(device) as forward, torch.no_grad(), _LogitsMatmuls(vocab) as seen:
        forward(x, weight, target)
    return seen.rows


@needs_liger
@pytest.mark.parametrize("hidden, vocab", NOTES_HEADS)
@pytest.mark.parametrize("tokens", [2048, 100])
def test_chunking_is_what_ligers_forward_runs(tokens, hidden, vocab):
    """The chunks liger's own FLCE forward runs on the CPU, counted as its logits matmuls, at the notes' models'
    vocabulary-to-hidden ratios (hidden 32 and the vocabulary scaled with it; its chunking reads only that ratio and
    the token count)."""
    small = -(-vocab * 32 // hidden)
    rows = _chunk_rows(tokens, 32, small)
    assert liger.flce_chunks(tokens, 32, small) == (rows[0], len(rows))
    assert sum(rows) == tokens


@needs_liger
@pytest.mark.gpu
@pytest.mark.parametrize("hidden, vocab", NOTES_HEADS[:2])
def test_chunking_is_what_ligers_kernel_runs_on_a_gpu(hidden, vocab):
    """The same count with liger's Triton kernel running, at the models' own widths."""
    rows = _chunk_rows(8192, hidden, vocab, "cuda")
    assert liger.flce_chunks(8192, hidden, vocab) == (rows[0], len(rows))


# --- the fused loss: against a real chunked loss, and against HF's ---------------------------------------------------

class ReferenceFLCE(torch.autograd.Function):
    """Liger's FLCE in plain torch on real tensors: the same chunks and paths, each chunk's cross-entropy and
    gradients computed in the forward, only the gradients saved. Its row statistics live in a (chunk, 2) scratch
    buffer (Liger's kernel keeps them in registers); everything else it allocates is what Liger allocates."""

    @staticmethod
    def forward(ctx, x, weight, target, safe, valid, cuda):
        tokens, hidden = x.shape
        chunk, _ = liger.flce_chunks(tokens, hidden, weight.shape[0])
        scratch = torch.empty((chunk, 2), dtype=x.dtype)
        grad_input, grad_weight = torch.zeros_like(x), torch.zeros_like(weight)
        loss_1d = torch.zeros(tokens, dtype=torch.float32)
        mask = target != liger.IGNORE_INDEX
        n = int(mask.sum())
        storage = torch.empty((chunk, weight.shape[0]), dtype=x.dtype) if cuda else None
        for start in range(0, tokens, chunk):
            end = min(start + chunk, tokens)
            xc, rows = x[start:end], end - start
            logits = torch.mm(xc, weight.t(), out=storage[:rows]) if cuda else xc @ weight.t()
            _cross_entropy_in_place(logits, safe[start:end, None], valid[start:end, None], scratch[:rows],
                                    loss_1d[start:end], n)
            if cuda:
                torch.mm(logits, weight, out=grad_input[start:end])
            else:
                grad_input[start:end] = logits @ weight
            if cuda and weight.dtype == torch.bfloat16:
                torch.addmm(grad_weight, logits.t(), xc, out=grad_weight)
            else:
                grad_weight += torch.mm(logits.t(), xc).float()
        del storage, mask
        ctx.save_for_backward(grad_input, grad_weight)
        return loss_1d.sum()

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight = ctx.saved_tensors
        grad_input.mul_(grad_output)
        grad_weight.mul_(grad_output)
        return grad_input, grad_weight, None, None, None, None


def _cross_entropy_in_place(logits, safe, valid, scratch, loss, n):
    """Mean cross-entropy of one chunk into `loss`, its gradient written over the logits, without allocating."""
    top, total = scratch[:, :1], scratch[:, 1:]
    torch.amax(logits, dim=1, keepdim=True, out=top)
    logits.sub_(top).exp_()
    torch.sum(logits, dim=1, keepdim=True, out=total)
    logits.div_(total)
    torch.gather(logits, 1, safe, out=top)
    loss.copy_(top[:, 0])
    loss.log_().neg_().mul_(valid[:, 0]).div_(n)
    logits.scatter_(1, safe, top.sub_(valid))
    logits.mul_(valid).div_(n)


def _peak(step, tensors, cuda_matmuls=False) -> tuple[int, int]:
    """(forward, whole step) peak bytes above `tensors` of `step`, which returns the loss."""
    tracker = LiveStorageTracker(cuda_matmuls=cuda_matmuls)
    with tracker:
        tracker.track_all(tensors)
        base = tracker.reset_peak()
        loss = step()
        forward = tracker.peak - base
        loss.backward()
    return forward, tracker.peak - base


def _inputs(dtype, tokens=128, hidden=32, vocab=1000):
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    weight = (0.1 * torch.randn(vocab, hidden, dtype=dtype)).requires_grad_()
    target = torch.randint(0, vocab, (tokens,))
    target[::7] = liger.IGNORE_INDEX
    return x, weight, target


def test_reference_is_the_cross_entropy():
    x, weight, target = _inputs(torch.float32)
    loss = ReferenceFLCE.apply(x, weight, target, target.clamp(min=0), (target >= 0).float(), False)
    loss.backward()
    loss = loss.detach()
    x2, w2 = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    expected = F.cross_entropy(x2 @ w2.t(), target, ignore_index=liger.IGNORE_INDEX)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert torch.allclose(x.grad, x2.grad, atol=1e-6) and torch.allclose(weight.grad, w2.grad, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cuda", [False, True])
def test_stand_in_loss_allocates_what_a_real_chunked_loss_does(dtype, cuda):
    """The stand-in, traced on fake tensors, against the real reference on the CPU: equal peak bytes in the forward and
    over the step, but for the reference's (chunk, 2) scratch. cuda=False is the legacy path (a V x H product and its
    fp32 copy per chunk); cuda=True the persistent logits buffer and, in bf16, the in-place addmm."""
    x, weight, target = _inputs(dtype)
    safe, valid = target.clamp(min=0), (target >= 0).to(dtype)
    real = _peak(lambda: ReferenceFLCE.apply(x, weight, target, safe, valid, cuda), [x, weight, target, safe, valid])
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx, fw = mode.from_tensor(x.detach()).requires_grad_(), mode.from_tensor(weight.detach()).requires_grad_()
        ft = mode.from_tensor(target)
        fake = _peak(lambda: liger.fused_linear_cross_entropy(fx, fw, ft, cuda=cuda), [fx, fw, ft])
    chunk, _ = liger.flce_chunks(*x.shape, weight.shape[0])
    scratch = chunk * 2 * x.element_size()
    assert (real[0] - scratch, real[1] - scratch) == fake


@pytest.mark.parametrize("family", ["half", "mixed"])
def test_hf_loss_holds_what_the_notes_say(family):
    """lm_head + HF's ForCausalLMLoss traced under CUDA's autocast rules: its forward peak is N·V·(b_c + 8) plus the
    shifted labels (with fp32 weights under autocast also autocast's cached bf16 copy of the weight and the bf16 input
    its matmul saves), the notes' formula against HF's own code."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    batch, seq, hidden, vocab = 2, 256, 64, 4096
    n, dtype = batch * seq, torch.bfloat16 if family == "half" else torch.float32
    with FakeTensorMode(allow_non_fake_inputs=True):
        h = torch.empty(batch, seq, hidden, dtype=dtype).requires_grad_()
        w = torch.nn.Parameter(torch.empty(vocab, hidden, dtype=dtype))
        labels = torch.randint(0, vocab, (batch, seq))

        def hf_loss():  # the logits stay referenced while the loss runs, as LlamaForCausalLM.forward holds them
            if family == "half":
                logits = F.linear(h, w)
            else:
                with cuda_autocast_rules("bfloat16"), torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = F.linear(h, w)
            return ForCausalLMLoss(logits, labels, vocab)

        hf = _peak(hf_loss, [h, w, labels])
    shifted_labels = batch * (seq + 1) * 8 + n * 8
    b_w = dtype.itemsize
    assert hf[0] == n * vocab * (2 + 8) + shifted_labels + (n * hidden * 2 + vocab * hidden * 2 if b_w == 4 else 0) + 8


@needs_liger
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, hidden, vocab", [(256, 64, 4096), (300, 64, 2004), (128, 32, 1000)])
def test_stand_in_loss_forward_allocates_what_ligers_own_forward_does(tokens, hidden, vocab, dtype):
    """The stand-in's FLCE forward against liger-kernel 0.8.5's own `fused_linear_cross_entropy_forward`, both run on
    the CPU under the live-storage tracker (liger's chunk cross-entropy kernel a no-op: it writes in place), ignored
    labels included: the same peak, byte for byte. (On the CPU liger takes its non-CUDA paths: the stand-in's
    cuda=False.)"""
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    weight = (0.1 * torch.randn(vocab, hidden, dtype=dtype)).requires_grad_()
    target = torch.randint(0, vocab, (tokens,))
    target[::7] = liger.IGNORE_INDEX

    def forward_peak(step):
        tracker = LiveStorageTracker()
        with tracker, torch.no_grad():  # an autograd Function's forward runs without grad
            tracker.track_all([x, weight, target])
            base = tracker.reset_peak()
            step()
        return tracker.peak - base

    with _ligers_own_flce("cpu") as forward:
        real = forward_peak(lambda: forward(x, weight, target))
    assert liger.flce_forward(x, weight, target, False)[0] is not None
    assert forward_peak(lambda: liger.flce_forward(x, weight, target, False)) == real


@needs_liger
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stand_in_loss_step_allocates_what_liger_does_on_a_gpu(dtype):
    """Liger's FLCE Function on a CUDA device (its CUDA paths: the persistent logits buffer, in bf16 the in-place
    addmm) against the stand-in traced with cuda=True: the step's peak above the inputs, to the caching allocator's
    rounding of each block up to 512 bytes (c10/cuda/CUDACachingAllocator.cpp kMinBlockSize)."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    tokens, hidden, vocab = 2048, 256, 32000
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, dtype=dtype, device="cuda", requires_grad=True)
    weight = (0.1 * torch.randn(vocab, hidden, dtype=dtype, device="cuda")).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    x.detach() @ weight.detach()[:8].t()  # cuBLAS's workspace, allocated at a stream's first matmul, before the base
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    LigerFusedLinearCrossEntropyFunction.apply(x, weight, target).backward()
    torch.cuda.synchronize()
    real = torch.cuda.max_memory_allocated() - base
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx, fw = mode.from_tensor(x.detach().cpu()).requires_grad_(), mode.from_tensor(weight.detach().cpu())
        fw.requires_grad_()
        ft = mode.from_tensor(target.cpu())
        tracker = LiveStorageTracker(cuda_matmuls=True)
        with tracker:
            tracker.track_all([fx, fw, ft])
            start = tracker.reset_peak()
            tracker.record()
            liger.fused_linear_cross_entropy(fx, fw, ft, cuda=True).backward()
        allocations = sum(1 for op, _, _ in tracker.events if op == "alloc")
    assert abs(real - (tracker.peak - start)) <= 512 * allocations


# --- traced models -------------------------------------------------------------------------------------------------

LAYER_ROWS = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "liger_layer_memory.json"


def _layer_pairs() -> list:
    """(kernel, x value, config, liger's MiB, huggingface's MiB) of every pair of rows in the data file."""
    found = {}
    for row in json.loads(LAYER_ROWS.read_text())["rows"]:
        found.setdefault((row["kernel"], row["x_value"]), {})[row["provider"]] = row
    return [pytest.param(kernel, x, pair["liger"]["config"], pair["liger"]["value"], pair["huggingface"]["value"],
                         id=f"{kernel}-{x}") for (kernel, x), pair in sorted(found.items())]


def _layer_step_peak(make_layer, x_shape, dy: bool, weights=torch.bfloat16) -> tuple[int, int]:
    """The peak of the second of two forward + backward calls of a layer on fake bf16 tensors, as Liger's benchmark
    measures it (benchmark/scripts/utils.py `_test_memory`: the peak of each of 10 calls, the first gradient kept by
    the input from then on), and how many storages the step allocated. `weights`: the layer's weight dtype (the
    benchmark's MLPs `.to(dtype)`, its norms left fp32)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        default = torch.get_default_dtype()
        torch.set_default_dtype(weights)
        try:
            layer = make_layer()
        finally:
            torch.set_default_dtype(default)
        tracker = LiveStorageTracker(cuda_matmuls=True)
        with tracker:
            x = torch.randn(x_shape, dtype=torch.bfloat16).requires_grad_()
            grad = torch.randn(x_shape, dtype=torch.bfloat16) if dy else None
            tracker.track_all([x, *layer.parameters()] + ([grad] if dy else []))
            for call in range(2):
                tracker.reset_peak()
                if call:
                    tracker.record()
                y = layer(x)
                y.backward(grad if dy else torch.randn_like(y), retain_graph=True)
                del y
        return tracker.peak, sum(1 for op, _, _ in tracker.events if op == "alloc")


class _BenchRMSNorm(torch.nn.Module):
    """The benchmark's LigerRMSNorm: an fp32 weight of ones (in_place=True, its default)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden, dtype=torch.float32))

    def forward(self, x):
        return liger._norm_forward(liger._stand_in_functions()[0], True, self, x)


@pytest.mark.parametrize("kernel, x, config, liger_mib, hf_mib", _layer_pairs())
def test_stand_in_layers_save_what_ligers_own_benchmark_measured(kernel, x, config, liger_mib, hf_mib):
    """Liger-Kernel's per-layer memory benchmark on an H100 NVL (benchmarks/data/liger_layer_memory.json: liger 0.5.2,
    peak allocated over a forward and backward), liger against the Hugging Face layer, against the same two traced
    at the same shapes: the stand-in's step peak falls below HF's by what liger's fell, to the caching allocator's
    rounding of each block up to 512 bytes (c10/cuda/CUDACachingAllocator.cpp kMinBlockSize). The benchmark's
    tensors outside the step (inputs, weights) are the same for both and cancel. RMSNorm's partial dW has one row
    per SM: the H100 NVL's 132, which `liger.SM_COUNT` (an H100 SXM's) also is."""
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    weights = torch.bfloat16
    if kernel == "rms_norm":
        shape, dy, weights = (config["M"], x), True, torch.float32

        def hf():
            return LlamaRMSNorm(x, eps=config["eps"])

        def ours():
            return _BenchRMSNorm(x)
    else:
        shape, dy = (config.get("B", config.get("bsz")), x, config["hidden_size"]), False
        mlp_config = transformers.LlamaConfig(hidden_size=config["hidden_size"],
                                              intermediate_size=config["intermediate_size"],
                                              hidden_act=config["hidden_act"])
        gated = liger._stand_in_functions()[1]

        def hf():
            return LlamaMLP(mlp_config)

        def ours():
            mlp = LlamaMLP(mlp_config)
            mlp.forward = functools.partial(liger._swiglu_forward, gated, mlp)
            return mlp

    (theirs, allocations), (mine, own_allocations) = (_layer_step_peak(hf, shape, dy, weights),
                                                      _layer_step_peak(ours, shape, dy, weights))
    measured = (hf_mib - liger_mib) * 2**20
    assert abs((theirs - mine) - measured) <= 512 * (allocations + own_allocations)


def test_tiny_llama_activations_fall_by_what_its_patched_modules_save():
    """bf16 weights: the activations (the larger of the two phases' peaks) fall to the stand-in's forward peak. The
    fall is at least the fused loss's own saving at the model's shapes (HF's lm_head + loss against the stand-in's,
    checked against liger's own forward above) and at most that plus every patched module's saving traced alone
    (each norm and MLP, HF's against its stand-in, checked against Liger's measurements above): the model saves
    nothing outside what liger replaces. The baseline's activations are its backward's peak (three fp32 N x V
    buffers in the loss's backward); the stand-ins' are their forward's."""
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    hidden, vocab, layers = 64, 2000, 3
    config = tiny(transformers.LlamaConfig, layers=layers)
    off = run_trace(config, layers, request(), profile=False)
    on = run_trace(config, layers, request(liger=True), profile=False)
    assert on.activations == on.forward < off.forward < off.activations == off.backward
    norm, gated = liger._stand_in_functions()[:2]

    def kept(layer):
        """What a module holds after its forward on a (2, 64, hidden) bf16 input, its output included."""
        with FakeTensorMode(allow_non_fake_inputs=True):
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                module = layer()
            finally:
                torch.set_default_dtype(default)
            tracker = LiveStorageTracker(cuda_matmuls=True)
            with tracker:
                x = torch.empty(2, 64, hidden, dtype=torch.bfloat16).requires_grad_()
                tracker.track_all([x, *module.parameters()])
                base = tracker.reset_peak()
                y = module(x)  # noqa: F841 - held while the tracker counts it
                tracker.sweep()
                return tracker.current - base

    def patched_norm():
        module = LlamaRMSNorm(hidden)
        module.forward = functools.partial(liger._norm_forward, norm, True, module)
        return module

    def patched_mlp():
        module = LlamaMLP(config)
        module.forward = functools.partial(liger._swiglu_forward, gated, module)
        return module

    norm_saves = kept(lambda: LlamaRMSNorm(hidden)) - kept(patched_norm)
    mlp_saves = kept(lambda: LlamaMLP(config)) - kept(patched_mlp)
    with FakeTensorMode(allow_non_fake_inputs=True):
        h = torch.empty(2, 64, hidden, dtype=torch.bfloat16).requires_grad_()
        w = torch.nn.Parameter(torch.empty(vocab, hidden, dtype=torch.bfloat16))
        labels = torch.randint(0, vocab, (2, 64))
        def hf_loss():  # the logits stay referenced while the loss runs, as LlamaForCausalLM.forward holds them
            logits = F.linear(h, w)
            return ForCausalLMLoss(logits, labels, vocab)

        hf = _peak(hf_loss, [h, w, labels], cuda_matmuls=True)
        ours = _peak(lambda: liger.causal_lm_loss(h, w, labels), [h, w, labels], cuda_matmuls=True)
    loss_saves = hf[0] - ours[0]
    assert 0 < norm_saves and 0 < mlp_saves and 0 < loss_saves
    assert loss_saves <= off.forward - on.forward <= loss_saves + layers * (2 * norm_saves + mlp_saves) + norm_saves


def test_unsupported_model_traces_the_same():
    """bloom-560m: liger-kernel has no patches for bloom, so `--liger on` changes nothing in the trace."""
    config = resolve_model("bigscience/bloom-560m").config
    req = request(micro_batch=1, seq_len=128, attention="eager")
    assert liger.patches_for(config, "causal-lm") is None
    assert run_trace(config, 2, replace(req, liger=True)) == run_trace(config, 2, req)


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_checkpointed_steps_trace_with_the_stand_ins(checkpointing):
    """Qwen2's q/k projections have a bias (addmm, which torch's selective checkpointing caches): the in-place RoPE
    stand-in must leave autograd's version counters as Liger's Triton kernel does. Recomputation runs the stand-ins
    too: the checkpointed steps keep less than without Liger."""
    config = tiny(transformers.Qwen2Config, layers=3)
    off = run_trace(config, 3, request(checkpointing=checkpointing, activations="mixed"), profile=False)
    on = run_trace(config, 3, request(checkpointing=checkpointing, activations="mixed", liger=True), profile=False)
    assert on.activations < off.activations


def test_op_profile_counts_the_chunks_as_tokens():
    """The fused loss's GEMMs run in the forward, three per chunk; the profile holds each shape as one GEMM batched
    over the chunks, each chunk's rows marked as growing with the micro-batch (the chunk count stays put as BT grows;
    the chunks' rows do not), so that each chunk reads the vocabulary's weight again."""
    config = tiny(transformers.LlamaConfig, layers=1)
    profile = run_trace(config, 1, request(liger=True)).profile
    n, hidden, vocab = 2 * 64, 64, 2000
    chunk, chunks = liger.flce_chunks(n, hidden, vocab)
    assert (chunk, chunks) == (4, 32)
    gemms = {key: value for key, value in profile["matmuls"].items() if str(vocab) in key.split(",")[:4]}
    assert gemms == {f"{chunks},{chunk},{vocab},{hidden},half,forward,0100": 1,
                     f"{chunks},{chunk},{hidden},{vocab},half,forward,0100": 1,
                     f"{chunks},{vocab},{hidden},{chunk},half,forward,0001": 1}


def test_the_fused_loss_waits_for_the_gpu_twice_and_accumulates_its_weight_gradient_per_chunk():
    """The host reads the label count (`.item()`, ops/fused_linear_cross_entropy.py:131-132) before the chunk loop and
    compares the incoming gradient on the host (`torch.equal`, :420) before the backward: the profile holds the step
    up to each wait. Each chunk's `addmm` into the whole weight gradient reads and rewrites it: its bytes count once
    per chunk."""
    from planner.program.profile import Profile

    config = tiny(transformers.LlamaConfig, layers=1)
    profile = Profile.from_json(run_trace(config, 1, request(liger=True, activations="mixed")).profile)
    first, second = profile.syncs
    assert not any(",backward," in key for key in second.matmuls)          # both waits come before the backward
    assert not any(str(2000) in key.split(",")[:4] for key in first.matmuls)  # the loop runs after the first
    assert all(key in second.matmuls for key in profile.matmuls if ",forward," in key)
    _chunk, chunks = liger.flce_chunks(2 * 64, 64, 2000)
    added = sum(v[1] for k, v in second.memory.items()) - sum(v[1] for k, v in first.memory.items())
    assert added >= chunks * 2000 * 64 * (4 + 4 - 2)  # the fp32 gradient read and written beyond a 16-bit output


def test_torch_compile_capture_runs_the_stand_ins():
    """planner/program/compiled.py captures the step under AOTAutograd through the stand-ins' Functions: the joint
    graph saves less for the backward than HF's program does."""
    from planner.program.compiled import analyse_program

    config = tiny(transformers.LlamaConfig, layers=1)
    req = request(micro_batch=1, activations="mixed", autocast_device="cpu")
    off, on = (analyse_program(config, 1, replace(req, liger=flag)) for flag in (False, True))
    assert on["saved_eager"] < off["saved_eager"] and on["saved_compiled"] < off["saved_compiled"]


# --- the planner's knob: --liger auto | on | off

def _llama():
    return tiny(transformers.LlamaConfig, layers=2, vocab=32000)


def test_on_is_refused_where_liger_does_not_apply():
    from planner import plan
    from planner.errors import InputError

    with pytest.raises(InputError) as err:
        plan("bigscience/bloom-560m", 8, seq_len=256, gpu="A100-80GB", liger="on")
    assert err.value.flag == "--liger" and "bloom" in str(err.value)
    with pytest.raises(InputError) as err:  # Triton's NVIDIA GPUs start at compute capability 8.0
        plan(_llama(), 8, seq_len=256, gpu="T4-16GB", liger="on")
    assert err.value.flag == "--liger" and "T4" in str(err.value)


@pytest.mark.long
def test_on_plans_and_emits_it_and_says_what_to_install(tmp_path):
    from emit import emit
    from planner import plan

    p = plan(_llama(), 8, seq_len=256, gpu="A100-80GB", liger="on")
    assert p.choice.config.liger and all(c.config.liger for c in p.candidates if c.memory is not None)
    assert "liger" in {n.kind for n in p.notes}
    assert {r.package: r.installed for r in p.requirements}["liger-kernel"] == HAS_LIGER
    emit(p, tmp_path)
    args = json.loads((tmp_path / "training_args.json").read_text())
    assert args["use_liger_kernel"] is True and "liger_kernel_config" not in args
    cls = plan(_llama(), 8, seq_len=256, gpu="A100-80GB", liger="on", task="seq-cls", num_labels=2)
    emit(cls, tmp_path / "cls")
    args = json.loads((tmp_path / "cls" / "training_args.json").read_text())
    assert args["liger_kernel_config"] == {"fused_linear_cross_entropy": False}  # the FLCE patch breaks such heads


def test_auto_weighs_it_only_where_installed(monkeypatch):
    from planner import plan

    monkeypatch.setattr(liger, "_not_installed", lambda: "liger_kernel not installed here")
    p = plan(_llama(), 8, seq_len=256, gpu="A100-80GB")
    assert not any(c.config.liger for c in p.candidates)
    assert "liger-available" in {n.kind for n in p.notes}
    monkeypatch.setattr(liger, "_not_installed", lambda: None)
    p = plan(_llama(), 8, seq_len=256, gpu="A100-80GB", micro_batch=8, checkpointing="none", precision="bf16-mixed",
             zero_stage=0, offload="none")
    by = {c.config.liger: c for c in p.candidates if c.memory is not None}
    assert set(by) == {False, True} and by[True].memory.activations < by[False].memory.activations
    assert "liger-available" not in {n.kind for n in p.notes}


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_the_analytic_screen_counts_what_the_trace_saves(precision):
    """The search screens candidates by formula before tracing them: with Liger, the formula's saving (no full logits,
    the norms' and MLP's smaller saves) is within a quarter of the traced saving, so a Liger candidate is neither
    screened out nor let through on the formula's account of a step without it."""
    from planner.config import Config
    from planner.memory.estimate import Evaluation

    evaluation = Evaluation(resolve_model(_llama()), seq_len=512, optimizer="adamw", attention="sdpa",
                            gpus_per_node=1)
    saved = {}
    for method in ("trace", "analytic"):
        act = [evaluation.activations(Config(micro_batch=4, grad_accum=1, world_size=1, precision=precision,
                                             checkpointing="none", zero_stage=0, offload="none", liger=on),
                                      method)[0] for on in (False, True)]
        saved[method] = act[0] - act[1]
    assert saved["trace"] > 0 and saved["analytic"] == pytest.approx(saved["trace"], rel=0.25)


@pytest.mark.parametrize(("activations", "device"), [("half", "cuda"), ("mixed", "cuda"), ("fp32", "cpu")])
def test_memory_trace_runs_the_first_and_last_loss_chunks_only(monkeypatch, activations, device):
    """A trace of memory alone runs the fused loss's first and last chunks: the step's peaks and the allocator's replay
    are those of the trace of every chunk (in the paths that allocate per chunk, with fewer events)."""
    config = tiny(transformers.LlamaConfig, vocab=4096)
    r = request(micro_batch=2, seq_len=200, activations=activations, attention="math" if device == "cpu" else "flash",
                autocast_device=device, liger=True)
    assert liger.flce_chunks(400, 64, 4096)[1] > 2
    few = run_trace(config, 3, r, profile=False)
    starts = liger._chunk_starts
    monkeypatch.setattr(liger, "_chunk_starts", lambda tokens, chunk, every: starts(tokens, chunk, True))
    full = run_trace(config, 3, r, profile=False)
    fields = ("activations", "forward", "backward", "slack", "rounding")
    assert [getattr(few, f) for f in fields] == [getattr(full, f) for f in fields]
    if activations != "half":  # the legacy paths allocate and free per chunk
        assert len(few.template["events"]) < len(full.template["events"])
