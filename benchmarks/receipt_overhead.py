"""What taking a receipt costs a run: the Trainer's steps with and without `plan.callback()` (and the non-pad token
count it reads, TrainingArguments(include_num_input_tokens_seen="non_padding")), on this machine's CPU or GPU.

The two alternate, `--runs` times each; the median step time of each is compared (the first steps left out).

    python benchmarks/receipt_overhead.py            # a 2-layer Llama, 40 steps per run
    python benchmarks/receipt_overhead.py --runs 7 --steps 80
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import transformers

import planner

WARMUP = 5


class Rows(torch.utils.data.Dataset):
    """`count` rows of `length` token ids, unpadded, labels the inputs."""

    def __init__(self, count: int, length: int):
        self.count, self.length = count, length

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        ids = torch.arange(self.length) % 300
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


class _Clock(transformers.TrainerCallback):
    def __init__(self):
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())


def step_time(p, config, steps: int, receipt: bool) -> float:
    """The median step time of one run (after WARMUP steps), with or without the receipt's callback."""
    with tempfile.TemporaryDirectory() as out:
        extra = {"include_num_input_tokens_seen": "non_padding"} if receipt else {}
        args = p.training_arguments(output_dir=out, use_cpu=not torch.cuda.is_available(), max_steps=steps,
                                    report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=10**6,
                                    **extra)
        clock = _Clock()
        callbacks = [clock] + ([p.callback(out, cache=False)] if receipt else [])
        transformers.logging.set_verbosity_error()
        trainer = transformers.Trainer(model=p.prepare(transformers.LlamaForCausalLM(config)), args=args,
                                       train_dataset=Rows(steps * p.choice.config.global_batch, 128),
                                       callbacks=callbacks)
        trainer.train()
    gaps = [b - a for a, b in zip(clock.ends[WARMUP:], clock.ends[WARMUP + 1:])]
    return statistics.median(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                      architectures=["LlamaForCausalLM"])
    p = planner.plan(config, 4, gpu="A100-80GB", seq_len=128, precision="fp32", zero_stage=0, detect=False)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.runs):
        for receipt in (False, True):
            times[receipt].append(step_time(p, config, args.steps, receipt))
    without, with_ = statistics.median(times[False]), statistics.median(times[True])
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"{where}: step {without * 1e3:.2f} ms without the receipt, {with_ * 1e3:.2f} ms with it "
          f"({with_ / without - 1:+.1%}; medians of {args.runs} runs of {args.steps} steps)")


if __name__ == "__main__":
    main()
