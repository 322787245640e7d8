"""The host's cost of one checkpointed block beyond the ops it recomputes, in Python view-op units.

Activation checkpointing (torch.utils.checkpoint, non-reentrant: what transformers' `gradient_checkpointing_enable`
uses) runs Python for every tensor a block saves: a pack hook in the forward, another in the recompute, an unpack
hook in the backward, each with its grad-mode and metadata bookkeeping, plus the per-block RNG and autocast state
capture and the recomputed-tensor check. That work is Python on the host, whatever the device. This measures it on
tiny HF blocks (hidden 64, 16 tokens: the kernels cost next to nothing), per block from the difference between 8 and
2 layers:

    bookkeeping = step(checkpointed) - step(plain) - forward(grad enabled)        (the recompute is a forward)

and divides it by the same host's cost of a Python view op (`x.view`, the planner's `python_op_us`), so that another
host's figure follows from its own view-op cost (planner/hardware/efficiency_data.py multiplies them).

Selective checkpointing (the per-op policy the planner emits, planner/program/step.py `_sac_context`) adds a Python
TorchDispatchMode that handles every op of the block, once in the forward and once in the recompute
(torch/utils/checkpoint.py `_CachingTorchDispatchMode`, `_CachedTorchDispatchMode`, each calling the policy). Its
cost is measured per op handled:

    policy op = (step(selective) - step(checkpointed)) / (2 x aten ops in the block's forward)

(the recompute's dispatches are the same in both: the policy's saved ops still pass through its mode), the ops
counted over a forward by the planner's own op recorder, as its speed profile counts them. Within a round the sizes
and modes are timed interleaved, seven times, each taken as its median (a shared host drifts); rounds alternate the
models; the results are medians over rounds and models.

Run:  python benchmarks/checkpoint_host_cost.py [--rounds 3] [--device cpu|cuda]
      [--out benchmarks/results/checkpoint_host_cost.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers

LAYERS = (2, 8)
TOKENS = 16


def build(kind: str, layers: int, device: str):
    small = dict(vocab_size=128, max_position_embeddings=64)
    if kind == "llama":
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                          num_attention_heads=4, num_key_value_heads=4, **small)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_layer=layers, n_head=4, vocab_size=128, n_positions=64,
                                         bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.BertConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                         intermediate_size=128, **small)
        model = transformers.BertForMaskedLM(config)
    return model.to(device).train()


def step_seconds(model, mode: str, device: str, steps: int = 20) -> float:
    """Mean time of a step: 'plain' forward+backward, 'checkpointed' the same with every block checkpointed,
    'selective' with the planner's per-op policy, 'forward' a grad-enabled forward alone."""
    from planner.program.step import enable_checkpointing

    model.gradient_checkpointing_disable()
    if mode in ("checkpointed", "selective"):
        enable_checkpointing(model, "full" if mode == "checkpointed" else "selective")
    ids = torch.randint(0, 128, (1, TOKENS), device=device)

    def step():
        out = model(input_ids=ids, labels=ids)
        if mode != "forward":
            out.loss.backward()

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) / steps


def view_op_us(device: str, count: int = 20000) -> float:
    x = torch.ones(4, 4, device=device)
    start = time.perf_counter()
    for _ in range(count):
        x.view(16)
    return (time.perf_counter() - start) / count * 1e6


def forward_ops(model, device: str) -> int:
    """The aten ops a forward dispatches, kernels and views, counted by the planner's own op recorder: the count
    its speed profile charges the policy for (planner/program/profile.py `POLICY_OPS`)."""
    from planner.program.profile import PY_KERNELS, PY_VIEWS, OpRecorder

    model.gradient_checkpointing_disable()
    ids = torch.randint(0, 128, (1, TOKENS), device=device)
    with OpRecorder(1, TOKENS) as recorder:
        model(input_ids=ids, labels=ids)
    return int(recorder.profile.dispatch.get(PY_KERNELS, 0) + recorder.profile.dispatch.get(PY_VIEWS, 0))


def measure(kind: str, device: str, repeats: int = 7) -> dict:
    """One round for one model: per-block times (us) and the view op's cost. The modes and sizes are timed
    interleaved, `repeats` times, and each quantity is the median over the repeats (a shared host drifts)."""
    models = {layers: build(kind, layers, device) for layers in LAYERS}
    modes = ("plain", "checkpointed", "selective", "forward")
    samples = {(layers, mode): [] for layers in LAYERS for mode in modes}
    views = []
    for _ in range(repeats):
        for layers, model in models.items():
            for mode in modes:
                samples[(layers, mode)].append(step_seconds(model, mode, device))
        views.append(view_op_us(device))
    blocks = LAYERS[1] - LAYERS[0]
    per_block = {mode: (statistics.median(samples[(LAYERS[1], mode)]) - statistics.median(samples[(LAYERS[0], mode)]))
                 / blocks * 1e6 for mode in modes}
    bookkeeping = per_block["checkpointed"] - per_block["plain"] - per_block["forward"]
    view = statistics.median(views)
    ops = (forward_ops(models[LAYERS[1]], device) - forward_ops(models[LAYERS[0]], device)) / blocks
    policy_op = (per_block["selective"] - per_block["checkpointed"]) / (2 * ops)
    return {"model": kind, "per_block_us": per_block, "bookkeeping_us": bookkeeping, "view_op_us": view,
            "python_ops": bookkeeping / view, "block_forward_ops": ops, "policy_op_us": policy_op,
            "policy_op_python_ops": policy_op / view}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, help="write the rounds and the result as JSON")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(1)  # one host thread issues the ops, as it does for a GPU
    rounds = []
    for r in range(args.rounds):
        for kind in ("llama", "gpt2", "bert"):
            got = measure(kind, args.device)
            rounds.append(got)
            print(f"round {r + 1} {kind:<6} bookkeeping {got['bookkeeping_us']:7.0f} us/block  view op "
                  f"{got['view_op_us']:.2f} us  = {got['python_ops']:6.0f} view ops; selective policy "
                  f"{got['policy_op_us']:5.1f} us per op handled ({got['block_forward_ops']:.0f} ops a block) = "
                  f"{got['policy_op_python_ops']:5.1f} view ops", flush=True)
    result = {name: statistics.median(g[key] for g in rounds) for name, key in (
        ("python_ops_per_block", "python_ops"), ("bookkeeping_us_per_block", "bookkeeping_us"),
        ("view_op_us", "view_op_us"), ("policy_op_us", "policy_op_us"),
        ("policy_op_python_ops", "policy_op_python_ops"))}
    print(f"median: {result['bookkeeping_us_per_block']:.0f} us per checkpointed block = "
          f"{result['python_ops_per_block']:.0f} Python view ops (view op {result['view_op_us']:.2f} us); "
          f"selective checkpointing's policy {result['policy_op_us']:.1f} us per op handled = "
          f"{result['policy_op_python_ops']:.1f} view ops")
    if args.out:
        record = {"device": args.device, "host": platform.processor() or platform.machine(),
                  "torch": torch.__version__, "transformers": transformers.__version__, "result": result,
                  "rounds": rounds}
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
