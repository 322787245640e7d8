"""The transformers docs' Trainer quick tour (docs/source/en/quicktour.md, "Trainer - a PyTorch optimized training
loop"), kept as written there, with two changes marked CHANGED: the model and data are built offline (a config and
random token ids stand in for the hub checkpoint and the rotten_tomatoes dataset), and the arguments and the one
`plan.prepare(model)` line come from trainplan's emitted files. Used by tests/test_trainer_example.py; run as
`accelerate launch --config_file DIR/accelerate_config.yaml tests/trainer_example.py DIR MODEL_DIR`."""

import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer

from planner import load_plan  # CHANGED: the plan trainplan emitted

plan_dir, model_dir = sys.argv[1], sys.argv[2]
plan = load_plan(plan_dir)

# CHANGED: a random-init model from a local config (the quick tour loads a pretrained checkpoint)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
model = plan.prepare(model)  # CHANGED: the one line trainplan asks for

training_args = plan.training_arguments(output_dir="path/to/save/folder/", max_steps=3, save_strategy="no",
                                        report_to="none", use_cpu=not torch.cuda.is_available())

# CHANGED: random token ids in place of the tokenized rotten_tomatoes dataset
ids = torch.randint(0, model.config.vocab_size, (64, plan.seq_len))
dataset = [{"input_ids": row, "labels": row} for row in ids]

trainer = Trainer(
    model=model,
    args=training_args,
    train_dataset=dataset,
)  # doctest: +SKIP

trainer.train()
