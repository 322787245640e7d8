"""Fit the analytic activation model's per-block coefficients to FakeTensor traces of HF model code.

For each model and precision class, traces 3 and 4 blocks at micro-batch 2 and reads the per-block,
per-token slope of saved bytes (autocast weight copies removed: they do not scale with tokens). Then
solves, per (precision class, checkpointing), least squares for

    bytes/token/block = c_h * hidden + c_gated * ffn (gated MLP) + c_plain * ffn (plain MLP)
                        + c_scores * heads * seq (eager attention only) + c_mask * hidden (hidden dropout)

Run:  HF_HUB_OFFLINE=1 python benchmarks/fit_analytic.py     (about 2 minutes on 2 cores)
The printed table is what planner/memory/analytic.py's COEFFICIENTS hold.
"""

from __future__ import annotations

import numpy as np

from planner.memory.trace import TraceRequest, _cached_trace
from planner.models import resolve_model
from planner.models.build import effective_attention

MODELS = [("gpt2", 1024), ("facebook/opt-125m", 1024), ("EleutherAI/pythia-160m", 1024),
          ("bigscience/bloom-560m", 512), ("google-bert/bert-base-uncased", 512), ("Qwen/Qwen2.5-0.5B", 1024),
          ("meta-llama/Llama-3.2-1B", 1024), ("microsoft/phi-2", 1024), ("google/gemma-2-2b", 1024),
          ("mistralai/Mistral-7B-v0.1", 1024)]
CLASSES = {"mixed": "bf16-mixed", "fp32": "fp32", "half": "half-true"}
MICRO_BATCH = 2


def features(spec, attention, seq):
    gated = spec.ffn * max(1, spec.experts_per_token) if spec.gated_mlp else 0
    plain = 0 if spec.gated_mlp else spec.ffn
    scores = spec.heads * seq if attention == "eager" else 0
    mask = spec.hidden if spec.hidden_dropout > 0 else 0
    return [spec.hidden, gated, plain, scores, mask]


def slope(resolved, attention, seq, precision, ckpt):
    req = TraceRequest(MICRO_BATCH, seq, precision, "sgd", ckpt, attention, False, True)
    three = _cached_trace(resolved.config, resolved.spec.config_hash, 3, req, False)
    four = _cached_trace(resolved.config, resolved.spec.config_hash, 4, req, False)
    per_block = four.accum - three.accum
    if precision == "bf16-mixed":  # autocast's cached 16-bit weight copies: 2 B per block parameter
        per_block -= 2 * (resolved.spec.non_embedding_parameters // resolved.spec.layers)
    return per_block / (MICRO_BATCH * seq)


def main():
    rows = {}
    for name, seq in MODELS:
        r = resolve_model(name)
        att = effective_attention(r.config, "sdpa")
        for cls, prec in CLASSES.items():
            for ckpt in ("none", "selective"):
                rows.setdefault((cls, ckpt), []).append((features(r.spec, att, seq), slope(r, att, seq, prec, ckpt), name))
    for key, data in sorted(rows.items()):
        x = np.array([d[0] for d in data], dtype=float)
        y = np.array([d[1] for d in data])
        used = x.any(axis=0)
        coef = np.zeros(x.shape[1])
        coef[used] = np.linalg.lstsq(x[:, used], y, rcond=None)[0]
        err = (x @ coef - y) / y
        print(key, "coef h/gated/plain/scores/mask =", np.round(coef, 2).tolist(),
              "max rel err", round(float(abs(err).max()), 3))
        for (_, yy, name), e in zip(data, err):
            print(f"    {name:32s} measured {yy:10.0f} B/token/block   fit err {e:+.3f}")


if __name__ == "__main__":
    main()
