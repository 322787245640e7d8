"""One training step, the same everywhere: the fake-tensor trace, the CPU benchmark and the GPU probes.

Kept in one place so that what we predict and what we measure are the same program.
"""

from __future__ import annotations

import contextlib

import torch

# Selective checkpointing is torch's per-op SAC with torchtitan's policy (torchtitan/models/llama3/infra/
# parallelize.py `_save_list` and `_get_custom_policy`): keep the outputs of the matmuls and attention
# kernels, except every second `mm`; recompute everything else (norms, activations, dropout, elementwise).
_SAC_SAVE = {
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
}


def _sac_context():
    """A fresh policy per checkpointed call, counting mm separately in the forward and in the recompute."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs):
        name = str(op)
        if name == "aten.mm.default":
            mode = "recompute" if ctx.is_recompute else "forward"
            counts[mode] += 1
            if counts[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if name in _SAC_SAVE else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def enable_checkpointing(model, mode: str) -> None:
    """none | full (each block recomputed from its input) | selective (matmul outputs kept)."""
    if mode == "none":
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = _sac_context
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(kwargs)
    else:  # transformers < 5
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False


def make_optimizer(model, name: str, *, foreach: bool | None = None):
    """The torch optimizer for `name`, or SGD (no state) for ones torch lacks (their states are analytic)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, foreach=foreach)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-4, foreach=foreach)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=foreach)
    if name == "adafactor" and hasattr(torch.optim, "Adafactor"):
        return torch.optim.Adafactor(params, lr=1e-2, foreach=foreach)
    return torch.optim.SGD(params, lr=1e-2, foreach=foreach)


def head_kind(model) -> str:
    name = type(model).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal"
    if name.endswith("ForSequenceClassification"):
        return "classification"
    if name.endswith(("ForMaskedLM", "ForPreTraining")):
        return "masked"
    if name.endswith("ForConditionalGeneration") and getattr(model.config, "is_encoder_decoder", False):
        return "seq2seq"
    return "other"


def make_batch(model, micro_batch: int, seq_len: int, device="cpu") -> dict:
    vocab = int(getattr(model.config.get_text_config(), "vocab_size", 1000))
    ids = torch.randint(0, vocab, (micro_batch, seq_len), device=device)
    kind = head_kind(model)
    if kind == "classification":
        labels = torch.randint(0, max(2, model.config.num_labels), (micro_batch,), device=device)
        return {"input_ids": ids, "labels": labels}
    if kind == "masked" and type(model).__name__.endswith("ForPreTraining"):
        return {"input_ids": ids}
    if kind in ("causal", "masked", "seq2seq"):
        return {"input_ids": ids, "labels": ids.clone()}
    return {"input_ids": ids}


def autocast_context(precision: str, device_type: str):
    if precision == "bf16-mixed":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    if precision == "fp16-mixed":
        return torch.autocast(device_type, dtype=torch.float16)
    return contextlib.nullcontext()


def micro_step(model, batch: dict, precision: str, device_type: str = "cpu", loss_scale: float = 1.0) -> None:
    """Forward and backward of one micro-batch; gradients accumulate into .grad.

    `loss_scale` stands for fp16 loss scaling (GradScaler multiplies the loss; memory is the same).
    """
    with autocast_context(precision, device_type):
        out = model(**batch)
        loss = out.loss if getattr(out, "loss", None) is not None else out[0].float().mean()
    (loss * loss_scale if loss_scale != 1.0 else loss).backward()
