"""Predicted vs. real CPU training steps: `estimate_memory(device="cpu").peak` against the live-storage peak
of real steps of small real models (random weights), measured with the same dispatch-mode tracker.

Each case: build the model on the CPU, run one warm-up step (so optimizer states exist), then measure a
full step of `grad_accum` micro-batches, the optimizer step and zero_grad(set_to_none=True).

Run:  HF_HUB_OFFLINE=1 python benchmarks/cpu_memory_accuracy.py [--out benchmarks/results/cpu_memory.json]
Takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers

from planner.memory.estimate import estimate_memory
from planner.memory.step import cpu_step_peak, enable_checkpointing, make_batch, make_optimizer
from planner.vocab import PRECISION


def small_configs() -> dict:
    return {
        "gpt2-4L": transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8000, n_positions=512,
                                           architectures=["GPT2LMHeadModel"]),
        "llama-4L": transformers.LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=688,
                                             num_attention_heads=8, num_key_value_heads=2, vocab_size=8000,
                                             architectures=["LlamaForCausalLM"]),
        "bloom-6L": transformers.BloomConfig(n_layer=6, hidden_size=256, n_head=8, vocab_size=8000,
                                             architectures=["BloomForCausalLM"]),
        "bert-cls-4L": transformers.BertConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                                               intermediate_size=1024, vocab_size=8000,
                                               architectures=["BertForSequenceClassification"]),
        "llama-8L": transformers.LlamaConfig(num_hidden_layers=8, hidden_size=256, intermediate_size=688,
                                             num_attention_heads=8, num_key_value_heads=8, vocab_size=8000,
                                             architectures=["LlamaForCausalLM"]),
    }


CASES = [  # model, micro_batch, seq, precision, optimizer, checkpointing, grad_accum
    ("gpt2-4L", 4, 256, "fp32", "adamw", "none", 1),
    ("gpt2-4L", 4, 256, "bf16-mixed", "adamw", "none", 2),
    ("gpt2-4L", 2, 512, "fp32", "sgd", "full", 1),
    ("llama-4L", 4, 256, "fp32", "adamw", "none", 2),
    ("llama-4L", 4, 256, "bf16-true", "adamw", "none", 1),
    ("llama-4L", 4, 256, "bf16-mixed", "adamw", "full", 2),
    ("llama-4L", 4, 256, "bf16-mixed", "adamw", "none", 2),
    ("llama-8L", 2, 512, "bf16-mixed", "adamw", "selective", 2),
    ("llama-8L", 4, 256, "fp32", "sgd-momentum", "full", 1),
    ("bloom-6L", 4, 256, "fp32", "adamw", "none", 2),
    ("bloom-6L", 2, 256, "bf16-mixed", "sgd", "full", 1),
    ("bert-cls-4L", 8, 256, "fp32", "adamw", "none", 1),
    ("bert-cls-4L", 8, 256, "bf16-mixed", "adamw", "selective", 2),
]


def real_peak(config, micro_batch, seq, precision, optimizer, checkpointing, grad_accum) -> int:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if PRECISION[precision].weight_bytes == 2 else torch.float32
    cls = getattr(transformers, config.architectures[0])
    model = cls._from_config(config, dtype=dtype)
    model.train()
    enable_checkpointing(model, checkpointing)
    batch = make_batch(model, micro_batch, seq)
    return cpu_step_peak(model, make_optimizer(model, optimizer), batch, PRECISION[precision].autocast, grad_accum)


def run(out: str | None) -> list[dict]:
    configs = small_configs()
    rows = []
    for name, mb, seq, prec, optim, ckpt, n in CASES:
        cfg = configs[name]
        t0 = time.time()
        real = real_peak(cfg, mb, seq, prec, optim, ckpt, n)
        t1 = time.time()
        est = estimate_memory(cfg, micro_batch=mb, seq_len=seq, precision=prec, optimizer=optim, checkpointing=ckpt,
                              device="cpu", grad_accum=n)
        err = (est.peak - real) / real
        rows.append({"model": name, "micro_batch": mb, "seq_len": seq, "precision": prec, "optimizer": optim,
                     "checkpointing": ckpt, "grad_accum": n, "real_peak": real, "predicted_peak": est.peak,
                     "error": err, "method": est.method, "real_s": round(t1 - t0, 2),
                     "predict_s": round(time.time() - t1, 2)})
        print(f"{name:12s} mb={mb:<2d} s={seq:<4d} {prec:10s} {optim:12s} {ckpt:9s} N={n}  real {real / 2**20:8.1f} MiB"
              f"  predicted {est.peak / 2**20:8.1f} MiB  error {err:+6.2%}  ({est.method})", flush=True)
    errors = [abs(r["error"]) for r in rows]
    print(f"\n{len(rows)} cases: median |error| {statistics.median(errors):.2%}, worst {max(errors):.2%}")
    if out:
        with open(out, "w") as f:
            json.dump({"torch": torch.__version__, "transformers": transformers.__version__, "cases": rows}, f,
                      indent=1, sort_keys=True)
            f.write("\n")
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the per-case results as JSON")
    run(parser.parse_args().out)
