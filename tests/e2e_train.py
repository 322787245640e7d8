"""A tiny training script for the end-to-end test: run by `accelerate launch` with trainplan's configs.

Trains a random-init GPT-2 for two optimizer steps at the micro-batch the plan chose, with the planned
accumulation; prints one line the test parses.
"""

import json
import sys

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import DummyOptim, DummyScheduler


def main() -> None:
    model_dir, args_path = sys.argv[1], sys.argv[2]
    targs = json.load(open(args_path))
    accelerator = Accelerator()
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ds = accelerator.state.deepspeed_plugin.deepspeed_config if accelerator.state.deepspeed_plugin else {}
    lr = targs.get("learning_rate", 1e-3)
    if "optimizer" in ds:
        optimizer = DummyOptim(model.parameters(), lr=lr)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = DummyScheduler(optimizer) if "scheduler" in ds else None
    micro = targs["per_device_train_batch_size"]
    data = torch.randint(0, config.vocab_size, (micro * targs["gradient_accumulation_steps"] * 2, 32))
    loader = torch.utils.data.DataLoader(data, batch_size=micro)
    prepared = accelerator.prepare(model, optimizer, loader, *([scheduler] if scheduler else []))
    model, optimizer, loader = prepared[:3]
    steps, losses = 0, []
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            steps += 1
            losses.append(round(loss.item(), 4))
    engine_accum = getattr(model, "gradient_accumulation_steps", lambda: None)
    print(f"TRAINED steps={steps} micro_batch={micro} batch_seen={batch.shape[0]} "
          f"accum={accelerator.gradient_accumulation_steps} "
          f"engine_accum={engine_accum() if callable(engine_accum) else engine_accum} losses={losses}", flush=True)


if __name__ == "__main__":
    main()
