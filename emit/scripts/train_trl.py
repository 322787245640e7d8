"""Train the model of the plan in this folder with TRL's SFTTrainer (written by `plan --emit`).

    accelerate launch --config_file FOLDER/accelerate_config.yaml FOLDER/train_trl.py [--dataset FILE]

The plan is read from the folder this script is in. The dataset is --dataset, else the one the plan was made for;
SFTTrainer tokenises its `messages` or `text` column itself, cuts rows at the plan's max_length and packs them or
trains padding-free where the plan chose to (plan.sft_config()). Needs TRL: pip install -e ".[trl]".
After the warm-up the run's measurements are written beside the plan's predictions: receipt.json in this
folder (plan.callback(), docs/receipts.md).
"""

from pathlib import Path

from planner import load_plan  # first: it quiets the import notices of packages trl imports (planner/quiet.py)
from planner.dataset import load_rows
from planner.train_data import script_arguments
from trl import SFTTrainer

HERE = Path(__file__).resolve().parent


def main(argv=None) -> None:
    args = script_arguments("TRL's SFTTrainer", HERE, argv)
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
