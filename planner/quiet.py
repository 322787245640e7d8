"""Import-time notices of optional packages that say nothing about the run, dropped from their loggers.

transformers imports torchao wherever it is installed (transformers/quantizers/quantizer_torchao.py:38, reached by
`from transformers import Trainer`), whether or not the plan trains in FP8. torchao's import then logs a line for each
of its compiled extensions it cannot load (torchao/__init__.py:96: its MX-format and CUTLASS kernels, which no
trainplan plan calls: float8 training casts tensorwise and multiplies with torch._scaled_mm), and torch logs a
deprecation for each enum torchao registers (torch/utils/_pytree.py:630). Where DeepSpeed is installed, its first use
of the accelerator on a machine without CUDA logs that it chose the CPU (deepspeed/accelerator/real_accelerator.py:213),
which a CPU trial says itself. And transformers warns, at the first loss of a causal LM whose class names no loss
(GPT-2's GPT2LMHeadModel), that it uses the default causal-LM loss (transformers/modeling_utils.py:4778), which is the
loss it should use. Only those records are dropped; anything else the loggers say is kept.
"""

from __future__ import annotations

import logging

#: the loggers, and the start of each message they log at import that is dropped
IMPORT_NOTICES = {"torchao": ("Failed to load ",),
                  "torch.utils._pytree": ("%s is an Enum subclass and is now natively supported",),
                  "DeepSpeed": ("Setting accelerator to CPU.",),
                  "transformers.modeling_utils": ("`loss_type=None` was set in the config but it is unrecognized",)}


class _ImportNotice(logging.Filter):
    """Drops a logger's records whose message template starts with one of `starts`."""

    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def quiet_import_notices() -> None:
    """Install the filters (once per logger: importing trainplan again adds none)."""
    for name, starts in IMPORT_NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ImportNotice) for f in logger.filters):
            logger.addFilter(_ImportNotice(starts))
