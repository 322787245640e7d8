"""A dataset as a plan trains it: tokenised as the planner counted it, cut at the plan's row length, and batched the
way the plan chose (padded to the longest row of each micro-batch, padding-free, or packed into rows).

Padding-free and packed batches go through TRL's collator, which turns each row's sample lengths into position ids
so that flash attention keeps the samples apart (trl/trainer/sft_trainer.py `DataCollatorForLanguageModeling`);
packing is TRL's best-fit-decreasing `pack_dataset` (trl/data_utils.py), as SFTTrainer packs.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from planner.dataset import load_rows, sample_column, tokenize_rows
from planner.errors import InputError
from planner.vocab import PACKAGE, PACKING, PADDING_FREE

TRL_EXTRA = PACKAGE["trl"].install


def _trl(what: str) -> Any:
    try:
        import trl.data_utils
        import trl.trainer.sft_trainer
    except ImportError:
        raise InputError(f"{what} needs TRL", flag="--padding", hint=TRL_EXTRA) from None
    return trl


def train_rows(source: str | os.PathLike, tokenizer: Any, *, text_field: str | None, max_length: int,
               padding: str | None, row_length: int) -> Any:
    """The dataset at `source` as training rows: `input_ids` cut at `max_length`; packed into rows of `row_length`
    tokens (with each row's `seq_lengths`) where `padding` is packing."""
    dataset = load_rows(source)
    if len(dataset) == 0:
        raise InputError(f"{source} has no rows", flag="--dataset", hint="train on a dataset with samples")
    rows = tokenize_rows(dataset, tokenizer, sample_column(dataset, text_field), max_length)
    if padding == PACKING:
        rows = _trl("packing").data_utils.pack_dataset(rows, row_length, strategy="bfd")
    return rows


def collator(tokenizer: Any, padding: str | None) -> Any:
    """The batches' collator: labels are the input ids (padding masked with -100); padding-free and packed rows
    are flattened with position ids restarting at each sample."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if padding in (PACKING, PADDING_FREE):
        return _trl(padding).trainer.sft_trainer.DataCollatorForLanguageModeling(pad_token_id=pad, padding_free=True)
    from transformers import DataCollatorForLanguageModeling

    if tokenizer.pad_token_id is None:  # a causal LM's tokenizer often has none; padding is masked from the loss
        tokenizer.pad_token = tokenizer.eos_token
    return DataCollatorForLanguageModeling(tokenizer, mlm=False)


def script_arguments(trainer: str, folder: os.PathLike, argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments of the training scripts --emit ships (emit/scripts/): the data, the tokenizer, where to write
    and how long to train; `trainer` names what trains, `folder` the plan's folder."""
    parser = argparse.ArgumentParser(description=f"Train the plan in {folder} with {trainer}.")
    parser.add_argument("--dataset", help="data to train on (default: the plan's --dataset)")
    parser.add_argument("--text-field", help="the column with each sample's text (default: messages, else text)")
    parser.add_argument("--tokenizer", help="tokenizer folder or cached hub id (default: the plan's)")
    parser.add_argument("--output-dir", default=os.path.join(folder, "out"),
                        help="checkpoints and logs (default: FOLDER/out)")
    parser.add_argument("--epochs", type=float, default=1.0, help="passes over the dataset (default 1)")
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many optimizer steps")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code to run")
    return parser.parse_args(argv)


__all__ = ["collator", "script_arguments", "train_rows"]
