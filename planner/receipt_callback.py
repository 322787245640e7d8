"""`plan.callback()`: a run's receipt (planner/receipts.py) taken by a transformers TrainerCallback.

It times each optimizer step, counts the non-pad tokens where the run counts them
(TrainingArguments(include_num_input_tokens_seen="non_padding"), transformers/trainer.py:2730-2748), checks the run
against its plan once the warm-up is over, and writes receipt.json (rank 0) when training ends.
"""

from __future__ import annotations

from transformers import TrainerCallback

from planner.receipts import DEFAULT_WARMUP, Meter


class ReceiptCallback(TrainerCallback):
    """Writes receipt.json into `folder` (default: the Trainer's output_dir) and the cache; `path` is the file
    written once training ends (None before, or where too few steps ran)."""

    def __init__(self, data: dict, seq_len: int, folder=None, *, warmup: int = DEFAULT_WARMUP, cache: bool = True):
        self.data, self.seq_len, self.folder, self.warmup, self.cache = data, seq_len, folder, warmup, cache
        self.meter: Meter | None = None
        self.path = None
        self._seen = 0

    def on_train_begin(self, args, state, control, **kwargs):
        tokens = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size * self.seq_len
        self.meter = Meter(self.data, self.folder or args.output_dir, warmup=self.warmup, tokens_per_step=tokens,
                           cache=self.cache)
        # what the Trainer runs, whatever was planned: its Liger switch (transformers/trainer.py applies the patches
        # where `use_liger_kernel` is set)
        self.meter.ran(liger=bool(getattr(args, "use_liger_kernel", False)))
        self._seen = state.num_input_tokens_seen

    def on_step_end(self, args, state, control, **kwargs):
        seen = state.num_input_tokens_seen
        real = seen - self._seen if args.include_num_input_tokens_seen == "non_padding" else None
        self._seen = seen
        self.meter.step(real)

    def on_train_end(self, args, state, control, **kwargs):
        if self.meter is not None and state.is_world_process_zero:
            self.path = self.meter.write()


__all__ = ["ReceiptCallback"]
