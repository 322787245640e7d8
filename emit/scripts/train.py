"""Train the model of the plan in this folder with the Hugging Face Trainer (written by `plan --emit`).

    accelerate launch --config_file FOLDER/accelerate_config.yaml FOLDER/train.py [--dataset FILE] [--max-steps N]

The plan is read from the folder this script is in. The dataset is --dataset, else the one the plan was made for:
a .jsonl/.json/.csv/.parquet file, a Dataset.save_to_disk folder, or a hub dataset in the local cache. Its
`messages` (chats, through the tokenizer's chat template) or `text` column is tokenised and cut at the plan's
length, and batched as planned: padded to each batch's longest row, padding-free, or packed.
After the warm-up the run's measurements are written beside the plan's predictions: receipt.json in this
folder (plan.callback(), docs/receipts.md).
"""

import argparse
from pathlib import Path

from transformers import Trainer

from planner import load_plan

HERE = Path(__file__).resolve().parent


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train the plan in " + str(HERE) + " with the Trainer.")
    parser.add_argument("--dataset", help="data to train on (default: the plan's --dataset)")
    parser.add_argument("--text-field", help="the column with each sample's text (default: messages, else text)")
    parser.add_argument("--tokenizer", help="tokenizer folder or cached hub id (default: the plan's)")
    parser.add_argument("--output-dir", default=str(HERE / "out"), help="checkpoints and logs (default: FOLDER/out)")
    parser.add_argument("--epochs", type=float, default=1.0, help="passes over the dataset (default 1)")
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many optimizer steps")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code to run")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = arguments(argv)
    plan = load_plan(HERE)
    tokenizer = plan.tokenizer(args.tokenizer)
    # the arguments before the model: under ZeRO-3 they make DeepSpeed partition the weights as they load
    training = plan.training_arguments(output_dir=args.output_dir, num_train_epochs=args.epochs,
                                       max_steps=args.max_steps, include_num_input_tokens_seen="non_padding")
    model = plan.prepare(plan.load_model(trust_remote_code=args.trust_remote_code))
    trainer = Trainer(model=model, args=training, processing_class=tokenizer,
                      train_dataset=plan.train_dataset(tokenizer, args.dataset, args.text_field),
                      data_collator=plan.data_collator(tokenizer),
                      optimizers=(plan.create_optimizer(model), None),  # None: the Trainer builds the one named
                      callbacks=[plan.callback()])  # receipt.json: what the run measured beside the plan
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
