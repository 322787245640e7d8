"""Activations by formula, for when tracing is impossible or too slow (the planner's many candidates).

Per block, bytes per token, after Korthikanti et al. 2022 (arXiv 2205.05198, "sbh(34 + 5as/h)" for
16-bit GPT blocks without tensor parallelism), extended the way HF model code actually saves tensors:

* GQA: K and V are h·kv/a wide; HF's SDPA/eager paths `repeat_kv` them to full width before the kernel,
  and those expanded copies are what attention saves.
* SwiGLU/GeGLU: gate, up, act(gate) and their product are saved (4 tensors of f) against GELU's 2.
* Under torch.autocast the residual stream, norm inputs and softmax stay fp32 (autocast's fp32 op
  list); matmul inputs are saved as 16-bit casts. fp32 saves everything at 4 bytes; DeepSpeed's 16-bit
  engine and bf16-true at 2.
* Attention scores (5·a·s² per sequence in the paper) exist only for eager attention; SDPA flash /
  memory-efficient kernels save the output and a log-sum-exp of a·s floats.
* Dropout masks: 1 byte per element (torch bool) where the model applies dropout in training.
* Logits and loss: HF upcasts logits to fp32 for the loss: T·V·(2 + 4 + 4) bytes (`LOSS_FP32_BYTES`).
* Full checkpointing keeps each block's input plus one block's activations during its recompute;
  selective keeps the matmul and attention outputs and recomputes norms, activations and dropout.

The trace (`trace.py`) is exact for what it runs; these formulas agree with it to the tolerance
tests/test_memory_analytic.py pins, and are the planner's fast screen.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner import facts
from planner.models.spec import ModelSpec
from planner.program.liger import FLCE, flce_chunks, patches_of
from planner.vocab import ACTIVATIONS, ADAPTER, CHECKPOINTING, KERNEL

#: HF models upcast logits to fp32 for the loss (`logits.float()` in transformers/loss/loss_utils.py
#: `ForCausalLMLoss`) and cross_entropy keeps an fp32 log-softmax: T·V·(2 + 4 + 4) bytes under 16-bit matmuls.
LOSS_FP32_BYTES = 4


@dataclass(frozen=True)
class Widths:
    """Bytes per element of what a block saves: matmul inputs, fp32-kept tensors, residual stream."""

    matmul: int
    kept: int
    residual: int

    @staticmethod
    def of(activations: str) -> "Widths":
        """For an activation family (`vocab.ACTIVATIONS`): autocast keeps norms and softmax in fp32."""
        info = ACTIVATIONS[activations]
        matmul = 2 if info.half_weights or info.autocast else 4
        kept = 4 if info.autocast or not info.half_weights else 2
        residual = 2 if info.half_weights else 4
        return Widths(matmul, kept, residual)


def block_bytes_per_token(spec: ModelSpec, w: Widths, seq_len: int, attention: str, checkpointing: str,
                          tp: int = 1) -> float:
    """Saved bytes per token for one block with no checkpointing, or with selective checkpointing. With `tp`-way
    tensor parallelism (Megatron-style, no sequence parallelism: Korthikanti et al. 2022 eq. 2, 10sbh + 24sbh/t +
    5as^2b/t) the inputs of the column-parallel matmuls, the norms and the residual stay whole on every GPU; the
    heads, the attention kernel's tensors and the MLP's inner tensors are split."""
    h, f, a = spec.hidden, spec.ffn, spec.heads
    kv_full = h  # repeat_kv expands K and V to all heads before the kernel
    norms = 2 * w.kept * h  # two norm inputs (fp32 under autocast)
    qkv_in = w.matmul * h
    q_k_v = w.matmul * (h + 2 * kv_full)
    out_in = w.matmul * h
    if KERNEL[attention].saves_scores:
        scores = seq_len * a * (w.matmul + w.kept + w.matmul)  # scores, softmax (fp32), probs cast for @V
        if spec.attention_dropout > 0:
            scores += seq_len * a * (facts.get("activations.dropout_mask_bytes") + w.matmul)
        attn_kernel = scores
    else:
        attn_kernel = w.matmul * h + facts.get("activations.attention_lse_bytes") * a  # output + log-sum-exp
    mlp_in = w.matmul * h
    experts = spec.experts_per_token if spec.num_experts > 1 else 1
    mlp_inner = (4 if spec.gated_mlp else 2) * w.matmul * f * experts
    dropout = 2 * facts.get("activations.dropout_mask_bytes") * h if spec.hidden_dropout > 0 else 0
    if CHECKPOINTING[checkpointing].per_op_policy:  # matmul and attention outputs only
        # a mixture's experts run as torch._grouped_mm (transformers' default), which the policy recomputes
        # (planner/program/step.py `_SAC_SAVE`, torchtitan's list): only a dense MLP's matmul outputs stay
        mlp_saved = 0 if spec.num_experts > 1 else (3 * f if spec.gated_mlp else f)
        return (w.matmul * (h + 2 * h / tp + mlp_saved / tp)
                + (seq_len * a * w.matmul if KERNEL[attention].saves_scores else attn_kernel) / tp)
    return norms + qkv_in + mlp_in + dropout + (q_k_v + attn_kernel + out_in + mlp_inner) / tp


def activation_bytes(spec: ModelSpec, *, micro_batch: int, seq_len: int, activations: str, attention: str,
                     checkpointing: str, tp: int = 1, liger: bool = False) -> dict[str, int]:
    """Named activation terms (bytes) for one micro-batch of the whole model, per GPU of a `tp`-way tensor-parallel
    group (the logits are gathered whole: transformers' plans make the LM head `colwise_rep`). `liger`: with
    Liger-Kernel's patches for the model (`liger_savings`)."""
    w = Widths.of(activations)
    tokens = micro_batch * seq_len
    patches = patches_of(spec.model_type, spec.task) if liger else None
    per_block = block_bytes_per_token(spec, w, seq_len, attention, checkpointing, tp)
    if patches is not None:
        per_block -= liger_block_savings(spec, w, patches, checkpointing, tp)
    info = CHECKPOINTING[checkpointing]
    if info.enabled and not info.per_op_policy:  # full: block inputs, plus one block's activations in recompute
        blocks = spec.layers * w.residual * spec.hidden * tokens + per_block * tokens
    else:
        blocks = spec.layers * per_block * tokens
    # logits in the matmul dtype, their fp32 upcast and the fp32 log-softmax (fp32 logits need no upcast)
    logits_bytes = w.matmul + LOSS_FP32_BYTES * (2 if w.matmul < LOSS_FP32_BYTES else 1)
    logits = tokens * spec.logit_width * logits_bytes
    if patches is not None and patches.loss == FLCE:
        logits = liger_loss_bytes(spec, w, tokens, activations)
    embeddings = w.residual * spec.hidden * tokens
    autocast_copies = ACTIVATIONS[activations].autocast and not ACTIVATIONS[activations].half_weights
    # autocast casts fp32 weights; with adapters only the trainable ones are fp32 (the frozen base is 16-bit)
    cast = spec.trainable_parameters if ADAPTER[spec.adapter].trains_adapters else (
        spec.parameters - spec.embedding_parameters)
    copies = 2 * cast // tp if autocast_copies else 0
    return {"blocks": int(blocks), "logits_and_loss": int(logits), "embeddings": int(embeddings),
            "autocast_weight_copies": int(copies)}


def liger_block_savings(spec: ModelSpec, w: Widths, patches, checkpointing: str, tp: int = 1) -> float:
    """Bytes per token a block saves less with Liger's kernels, as its traced stand-ins measure it
    (tests/test_liger.py): each of the two RMSNorms keeps its input and a per-row fp32 RSTD instead of the copies
    `block_bytes_per_token` counts (fp32 under autocast; whole on every tensor-parallel rank), and the gated MLP recomputes its activation instead
    of saving it (1/tp of it per rank). Selective checkpointing keeps neither in the first place: nothing to save."""
    if CHECKPOINTING[checkpointing].per_op_policy:
        return 0.0
    experts = spec.experts_per_token if spec.num_experts > 1 else 1
    norms = 2 * w.kept * spec.hidden if patches.norms is not None else 0  # at most what the formula counts
    mlp = w.matmul * spec.ffn * experts / tp if patches.modelled_mlp is not None and spec.gated_mlp else 0
    return norms + mlp


def liger_loss_bytes(spec: ModelSpec, w: Widths, tokens: int, activations: str) -> int:
    """Liger's fused linear cross-entropy (planner/program/liger.py `flce_forward`): one chunk's logits at a time, and
    the gradients its forward computes and keeps for the backward: the input's, and the LM head's in the weights'
    dtype where the head trains."""
    chunk, _ = flce_chunks(tokens, spec.hidden, spec.vocab)
    weight_bytes = 2 if ACTIVATIONS[activations].half_weights else 4
    head = spec.vocab * spec.hidden * weight_bytes if not ADAPTER[spec.adapter].trains_adapters else 0
    return chunk * spec.vocab * w.matmul + tokens * spec.hidden * w.residual + head


def tensor_parallel_share(workload, cfg) -> float:
    """A tensor-parallel rank's activations over the unsplit model's, by these formulas (`workload`: a
    planner.program.workload.Workload; `cfg` a Config)."""
    req = workload.request(cfg)
    terms = [activation_bytes(workload.spec, micro_batch=cfg.micro_batch, seq_len=workload.seq_len,
                              activations=req.activations, attention=req.attention, checkpointing=cfg.checkpointing,
                              tp=tp, liger=cfg.liger)
             for tp in (1, cfg.tensor_parallel)]
    return sum(terms[1].values()) / max(1, sum(terms[0].values()))


#: Activation terms a tensor-parallel rank keeps whole: the gathered logits and the embeddings' output.
WHOLE_ON_EVERY_RANK = ("logits_and_loss", "embeddings")


def tensor_parallel_activations(workload, cfg, whole: float) -> float:
    """A tensor-parallel rank's activations from the unsplit model's `whole` (traced or calibrated): the terms every
    rank keeps whole as these formulas count them, and the rest of `whole` (the blocks, autocast's weight copies)
    scaled by the formulas' share of it that one rank keeps. A single ratio over the total would split the logits
    too, which transformers gathers whole on every rank."""
    req = workload.request(cfg)
    terms = [activation_bytes(workload.spec, micro_batch=cfg.micro_batch, seq_len=workload.seq_len,
                              activations=req.activations, attention=req.attention, checkpointing=cfg.checkpointing,
                              tp=tp, liger=cfg.liger)
             for tp in (1, cfg.tensor_parallel)]
    kept = [sum(t[k] for k in WHOLE_ON_EVERY_RANK) for t in terms]
    split = [sum(t.values()) - k for t, k in zip(terms, kept)]
    return kept[1] + max(0.0, whole - kept[0]) * (split[1] / split[0] if split[0] > 0 else 1.0)

