"""How far the analytic activation formulas (planner/memory/analytic.py) are from traces of HF model code.

For each model, activation family and checkpointing mode it traces the whole-model activations of a micro-step
with the gradients allocated (as the formulas count them; 3 and 4 blocks,
extrapolated) and prints traced / analytic. The search relies on two claims this table checks and
tests/test_memory_analytic.py pins on a subset: the analytic estimate is never more than
the fact `search.analytic_max_overestimate` times the traced one (the screen divides by it), and decoder LLMs sit near 1
(the fact `search.uncalibrated_margin`).

Run:  HF_HUB_OFFLINE=1 python benchmarks/fit_analytic.py     (about 2 minutes on 2 cores)
"""

from __future__ import annotations

from planner.config import Config
from planner.memory.estimate import Evaluation
from planner.models import resolve_model
from planner import facts
from planner.vocab import ANALYTIC, TRACE

MODELS = [("gpt2", 1024), ("facebook/opt-125m", 1024), ("EleutherAI/pythia-160m", 1024),
          ("bigscience/bloom-560m", 512), ("google-bert/bert-base-uncased", 512), ("Qwen/Qwen2.5-0.5B", 1024),
          ("meta-llama/Llama-3.2-1B", 1024), ("microsoft/phi-2", 1024), ("google/gemma-2-2b", 1024),
          ("mistralai/Mistral-7B-v0.1", 1024)]
PRECISIONS = ("bf16-mixed", "fp32", "bf16-true")
CHECKPOINTING = ("none", "selective", "full")


def ratios(name: str, seq: int, micro_batch: int = 2) -> list[tuple[str, str, float]]:
    """(precision, checkpointing, traced / analytic) for one model."""
    evaluation = Evaluation(resolve_model(name), seq_len=seq, optimizer="adamw", device="cuda")
    out = []
    for precision in PRECISIONS:
        for ckpt in CHECKPOINTING:
            cfg = Config(micro_batch=micro_batch, grad_accum=2, world_size=1, precision=precision,
                         checkpointing=ckpt, zero_stage=0, offload="none")
            traced, _ = evaluation.activations(cfg, TRACE)
            analytic, _ = evaluation.activations(cfg, ANALYTIC)
            out.append((precision, ckpt, traced / analytic))
    return out


def main() -> None:
    worst_over = 1.0
    print(f"{'model':32s} {'precision':10s} {'ckpt':9s} traced/analytic")
    for name, seq in MODELS:
        for precision, ckpt, ratio in ratios(name, seq):
            worst_over = min(worst_over, ratio)
            print(f"{name:32s} {precision:10s} {ckpt:9s} {ratio:6.2f}")
    print(f"largest over-estimate: analytic = {1 / worst_over:.2f} x traced "
          f"(the screen assumes at most {facts.get('search.analytic_max_overestimate')})")


if __name__ == "__main__":
    main()
