"""How much more a real training step costs the host than its ops do at the micro-benchmark's per-op costs.

The speed model charges the host per op it dispatches, at costs a micro-benchmark measures on the simplest ops
(planner/hardware/host.py `measure_host_costs`: `torch.add` on eight elements, `x.view`, an identity module). A
training step's ops cost more: they record autograd nodes, pass autocast, allocate through the caching allocator, some
launch several kernels, and model code runs Python of its own around them. This measures the ratio on tiny HF models
(hidden 64, 16 tokens: the kernels cost next to nothing, so a step's time is its host's), per block from the
difference between 8 and 2 layers:

    factor = (step(8 layers) - step(2 layers)) / (the same difference of the op count x the per-op costs)

the op counts taken by the planner's own op recorder over the same real step (planner/program/profile.py
`OpRecorder`: kernels and views from Python and from the autograd engine, module calls), the per-op costs by the
micro-benchmark in the same process. Steps are timed interleaved, seven times, each taken as its median (a shared host
drifts); rounds alternate the models.

Run:  python benchmarks/host_step_factor.py [--rounds 3] [--device cpu|cuda]
      [--out benchmarks/results/host_step_factor.json]
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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages import without an install
    sys.path.insert(0, str(ROOT))

from benchmarks import checkpoint_host_cost  # noqa: E402
from planner.hardware.host import measure_host_costs  # noqa: E402
from planner.program.profile import (  # noqa: E402
    ENGINE_KERNELS, ENGINE_VIEWS, MODULE_CALLS, PY_KERNELS, PY_VIEWS, OpRecorder,
)

LAYERS = (2, 8)
TOKENS = 16
MODELS = ("llama", "gpt2", "bert", "bloom", "qwen2")


def build(kind: str, layers: int, device: str):
    """A tiny model of `kind` (GPT-2 and BERT as benchmarks/checkpoint_host_cost.py builds them)."""
    small = dict(vocab_size=128, max_position_embeddings=64)
    if kind in ("llama", "qwen2"):
        cls = transformers.LlamaConfig if kind == "llama" else transformers.Qwen2Config
        config = cls(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                     num_key_value_heads=2, **small)
        model = transformers.AutoModelForCausalLM.from_config(config)
    elif kind == "bloom":
        config = transformers.BloomConfig(hidden_size=64, n_layer=layers, n_head=4, vocab_size=128)
        model = transformers.BloomForCausalLM(config)
    else:
        return checkpoint_host_cost.build(kind, layers, device)
    return model.to(device).train()


def step(model, ids) -> None:
    model(input_ids=ids, labels=ids).loss.backward()


def step_seconds(model, device: str, steps: int = 20) -> float:
    ids = torch.randint(0, 128, (1, TOKENS), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        step(model, ids)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step(model, ids)
    sync()
    return (time.perf_counter() - start) / steps


def dispatch(model, device: str) -> dict[str, float]:
    """What one step dispatches, as the planner's op recorder counts it."""
    ids = torch.randint(0, 128, (1, TOKENS), device=device)
    with OpRecorder(1, TOKENS) as recorder:
        loss = model(input_ids=ids, labels=ids).loss
        recorder.phase = "backward"
        loss.backward()
    return dict(recorder.profile.dispatch)


def modelled_us(counts: dict[str, float], costs) -> float:
    return (counts.get(PY_KERNELS, 0.0) * costs.dispatch_us + counts.get(ENGINE_KERNELS, 0.0) * costs.engine_dispatch_us
            + counts.get(PY_VIEWS, 0.0) * costs.python_op_us + counts.get(ENGINE_VIEWS, 0.0) * costs.cpp_op_us
            + counts.get(MODULE_CALLS, 0.0) * costs.module_call_us)


def measure(kind: str, device: str, repeats: int = 7) -> dict:
    """One round for one model: the per-block host time measured and modelled, and their ratio."""
    models = {layers: build(kind, layers, device) for layers in LAYERS}
    counts = {layers: dispatch(model, device) for layers, model in models.items()}
    samples: dict[int, list[float]] = {layers: [] for layers in LAYERS}
    costs = []
    for _ in range(repeats):
        costs.append(measure_host_costs(device, ops=500))
        for layers, model in models.items():
            samples[layers].append(step_seconds(model, device))
    cost = costs[len(costs) // 2].model_copy(update={
        name: statistics.median(getattr(c, name) for c in costs)
        for name in ("dispatch_us", "engine_dispatch_us", "python_op_us", "cpp_op_us", "module_call_us")})
    low, high = LAYERS
    measured = (statistics.median(samples[high]) - statistics.median(samples[low])) / (high - low) * 1e6
    modelled = (modelled_us(counts[high], cost) - modelled_us(counts[low], cost)) / (high - low)
    return {"model": kind, "measured_us_per_block": measured, "modelled_us_per_block": modelled,
            "factor": measured / modelled, "costs_us": cost.model_dump(exclude={"measured", "measured_at"}),
            "block_dispatch": {k: (counts[high].get(k, 0.0) - counts[low].get(k, 0.0)) / (high - low)
                               for k in sorted(counts[high])}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    rounds = []
    for r in range(args.rounds):
        for kind in MODELS[r % len(MODELS):] + MODELS[:r % len(MODELS)]:
            rounds.append(measure(kind, args.device))
            last = rounds[-1]
            print(f"{kind:6s} block: measured {last['measured_us_per_block']:7.1f} us, modelled "
                  f"{last['modelled_us_per_block']:7.1f} us, factor {last['factor']:.2f}", flush=True)
    per_model = {kind: statistics.median(r["factor"] for r in rounds if r["model"] == kind) for kind in MODELS}
    result = {"factor": statistics.median(per_model.values()), "per_model": per_model}
    print(f"factor: median {result['factor']:.2f} over models ({', '.join(f'{k} {v:.2f}' for k, v in per_model.items())})")
    if args.out:
        args.out.write_text(json.dumps({"device": args.device, "host": platform.machine(), "torch": torch.__version__,
                                        "transformers": transformers.__version__, "result": result,
                                        "rounds": rounds}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
