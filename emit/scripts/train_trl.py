"""Train the model of the plan in this folder with TRL's SFTTrainer (written by `plan --emit`).

    accelerate launch --config_file FOLDER/accelerate_config.yaml FOLDER/train_trl.py [--dataset FILE]

The plan is read from the folder this script is in. The dataset is --dataset, else the one the plan was made for;
SFTTrainer tokenises its `messages` or `text` column itself, cuts rows at the plan's max_length and packs them or
trains padding-free where the plan chose to (plan.sft_config()). Needs TRL: pip install -e ".[trl]".
After the warm-up the run's measurements are written beside the plan's predictions: receipt.json in this
folder (plan.callback(), docs/receipts.md).
"""

import argparse
from pathlib import Path

from trl import SFTTrainer

from planner import load_plan
from planner.dataset import load_rows

HERE = Path(__file__).resolve().parent


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train the plan in " + str(HERE) + " with TRL's SFTTrainer.")
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
    config = plan.sft_config(output_dir=args.output_dir, num_train_epochs=args.epochs, max_steps=args.max_steps,
                             include_num_input_tokens_seen="non_padding",
                             **({"dataset_text_field": args.text_field} if args.text_field else {}))
    # the model prepare() returns (a PeftModel for LoRA): SFTTrainer then adds no adapters or casts of its own
    model = plan.prepare(plan.load_model(trust_remote_code=args.trust_remote_code))
    source = args.dataset or plan.dataset_source
    if source is None:
        raise SystemExit("train_trl.py: the plan was made without a dataset: pass --dataset FILE")
    trainer = SFTTrainer(model=model, args=config, processing_class=plan.tokenizer(args.tokenizer),
                         train_dataset=load_rows(source),
                         callbacks=[plan.callback()])  # receipt.json: what the run measured beside the plan
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
