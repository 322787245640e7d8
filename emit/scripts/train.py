"""Train the model of the plan in this folder with the Hugging Face Trainer (written by `plan --emit`).

    accelerate launch --config_file FOLDER/accelerate_config.yaml FOLDER/train.py [--dataset FILE] [--max-steps N]

The plan is read from the folder this script is in. The dataset is --dataset, else the one the plan was made for:
a .jsonl/.json/.csv/.parquet file, a Dataset.save_to_disk folder, or a hub dataset in the local cache. Its
`messages` (chats, through the tokenizer's chat template) or `text` column is tokenised and cut at the plan's
length, and batched as planned: padded to each batch's longest row, padding-free, or packed.
After the warm-up the run's measurements are written beside the plan's predictions: receipt.json in this
folder (plan.callback(), docs/receipts.md).
"""

from pathlib import Path

from planner import load_plan  # first: it quiets the import notices of packages transformers imports (planner/quiet.py)
from planner.train_data import script_arguments
from transformers import Trainer

HERE = Path(__file__).resolve().parent


def main(argv=None) -> None:
    args = script_arguments("the Trainer", HERE, argv)
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
