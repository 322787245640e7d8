"""One training step, the same everywhere: the fake-tensor trace, the CPU benchmark and the GPU probes.

Kept in one place so that what we predict and what we measure are the same program.
"""

from __future__ import annotations

import contextlib

import torch

from planner.models.validate import text_config
from planner.program.tracker import LiveStorageTracker
from planner.vocab import CHECKPOINTING, LABELS_OBJECTIVE, OPTIMIZER, TASK, task_of_class

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
    """none | full (each block recomputed from its input) | selective (matmul outputs kept): `vocab.CHECKPOINTING`."""
    info = CHECKPOINTING[mode]
    if not info.enabled:
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
    kwargs = {"use_reentrant": False}
    if info.per_op_policy:
        kwargs["context_fn"] = _sac_context
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(kwargs)
    else:  # transformers < 5
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False


def make_optimizer(model, name: str, *, foreach: bool | None = None):
    """The torch optimizer for `name` (`vocab.OPTIMIZER`); ValueError for optimizers torch does not have."""
    info = OPTIMIZER[name]
    if info.torch_class is None or not hasattr(torch.optim, info.torch_class):
        raise ValueError(f"torch {torch.__version__} has no {name} optimizer")
    options = dict(item.split("=") for item in info.options.split(",") if item)
    kwargs = {key: float(value) for key, value in options.items()}
    params = [p for p in model.parameters() if p.requires_grad]
    return getattr(torch.optim, info.torch_class)(params, lr=1e-4, foreach=foreach, **kwargs)


def make_batch(model, micro_batch: int, seq_len: int, device="cpu", objective: str = LABELS_OBJECTIVE) -> dict:
    """Random token ids and, for the labels objective, the labels the model's head trains on (`vocab.TASK`)."""

    vocab = int(getattr(text_config(model.config), "vocab_size", 1000))
    ids = torch.randint(0, vocab, (micro_batch, seq_len), device=device)
    if objective != LABELS_OBJECTIVE:
        return {"input_ids": ids}
    labels = TASK[task_of_class(type(model).__name__)].labels
    num_labels = max(2, int(getattr(model.config, "num_labels", 2)))
    if labels == "class":
        return {"input_ids": ids, "labels": torch.randint(0, num_labels, (micro_batch,), device=device)}
    if labels == "token-class":
        return {"input_ids": ids, "labels": torch.randint(0, num_labels, (micro_batch, seq_len), device=device)}
    if labels == "tokens" and not type(model).__name__.endswith("ForPreTraining"):
        return {"input_ids": ids, "labels": ids.clone()}
    return {"input_ids": ids}


def autocast_context(dtype_name: str | None, device_type: str):
    """torch.autocast for a dtype name (`PrecisionInfo.autocast`), or nothing."""
    if dtype_name is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=getattr(torch, dtype_name))


def forward_loss(model, batch: dict, autocast: str | None, device_type: str = "cpu",
                 objective: str = LABELS_OBJECTIVE, hold: list | None = None):
    """The forward of one micro-batch and its loss: the head's own (`vocab.OBJECTIVE`), or the sum of the first
    output; a head without a loss trains on the mean of its output. Under autocast the outputs leave the forward
    as accelerate's mixed-precision wrapper hands them to the Trainer: the autocast region closed (which frees its
    cached 16-bit weights), then every 16-bit output copied to fp32 (accelerate/accelerator.py `prepare_model`,
    `convert_outputs_to_fp32(autocast_context(...))`; accelerate/utils/operations.py `convert_to_fp32`): a second,
    fp32 copy of the logits, at BERT-large's MLM head the step's peak on an H100
    (benchmarks/results/gpu_memory_peak-H100-80GB-2026-11-23-after.json). `hold` receives the outputs of a sum
    objective, for a caller that keeps them through the backward as the benchmarks' loops do."""
    from accelerate.utils import convert_to_fp32

    with autocast_context(autocast, device_type):
        out = model(**batch)
    if autocast:
        out = convert_to_fp32(out)
    if objective != LABELS_OBJECTIVE:
        if hold is not None:  # the benchmarks' loop keeps `outputs` (the logits) alive through the backward
            hold.append(out)
        return out[0].sum()
    return out.loss if getattr(out, "loss", None) is not None else out[0].float().mean()


def micro_step(model, batch: dict, autocast: str | None, device_type: str = "cpu", loss_scale: float = 1.0,
               objective: str = LABELS_OBJECTIVE) -> None:
    """Forward and backward of one micro-batch; gradients accumulate into .grad. `loss_scale` stands for fp16 loss
    scaling (GradScaler multiplies the loss; memory is the same)."""
    loss = forward_loss(model, batch, autocast, device_type, objective)
    (loss * loss_scale if loss_scale != 1.0 else loss).backward()


def cpu_step_peak(model, optimizer, batch: dict, autocast: str | None, grad_accum: int = 1) -> int:
    """Peak live bytes of a real training step on the CPU (parameters, buffers, batch and optimizer states counted),
    as the live-storage tracker sees it: a warm-up step (which creates the optimizer states), then the measured one
    of `grad_accum` micro-steps and the optimizer step."""

    for _ in range(2):
        tracker = LiveStorageTracker()
        with tracker:
            tracker.track_all(list(model.parameters()) + list(model.buffers()) + list(batch.values()))
            tracker.track_all(t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))
            tracker.reset_peak()
            for _ in range(grad_accum):
                micro_step(model, batch, autocast)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return tracker.peak
