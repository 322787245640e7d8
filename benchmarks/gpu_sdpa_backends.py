"""Which SDPA kernel torch picks on this GPU for the attention calls our models make, and what each call costs the
host and the device.

Needs a CUDA GPU (exits 2 without one). For each case (dtype; grouped-query heads passed with enable_gqa, as
transformers does without a mask; a padding mask, as BERT's step passes) it asks torch which backend it selects
(`torch._fused_sdp_choice`, the dispatcher's own choice: aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
`select_sdp_backend`), then times forward + backward at a tiny shape (host-bound: the host's cost per call) and at
a training shape (device-bound), CUDA-synchronised, median of 20 after 5 warm-ups. This is the evidence behind
planner/program/kernels.py's kernel rules and the per-call host cost the speed model charges.
Results go to benchmarks/results/gpu_sdpa_backends-<GPU>-<date>.json.

Run:  python benchmarks/gpu_sdpa_backends.py [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

CASES = (  # name, dtype, query heads, key/value heads, head dim, padding mask
    ("llama-gqa bf16", "bfloat16", 32, 8, 64, False),
    ("llama-gqa fp32", "float32", 32, 8, 64, False),
    ("gpt2 mha bf16", "bfloat16", 12, 12, 64, False),
    ("gpt2 mha fp32", "float32", 12, 12, 64, False),
    ("bert masked bf16", "bfloat16", 16, 16, 64, True),
    ("bert masked fp32", "float32", 16, 16, 64, True),
)


def inputs(torch, dtype, heads, kv_heads, head_dim, mask, batch, seq):
    def make(h):
        return torch.randn(batch, h, seq, head_dim, device="cuda", dtype=dtype, requires_grad=True)

    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    attn_mask = torch.ones(batch, 1, seq, seq, device="cuda", dtype=torch.bool) if mask else None
    return q, k, v, attn_mask


def timed(torch, fn, repeats=20, warmup=5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(torch, name, dtype_name, heads, kv_heads, head_dim, mask) -> dict:
    import torch.nn.functional as F

    dtype = getattr(torch, dtype_name)
    gqa = kv_heads != heads
    row = {"case": name, "dtype": dtype_name, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
           "padding_mask": mask}
    for label, batch, seq in (("tiny", 1, 128), ("training", 4, 2048)):
        tensors = inputs(torch, dtype, heads, kv_heads, head_dim, mask, batch, seq)
        choice = torch._fused_sdp_choice(*tensors, 0.0, not mask, scale=None, enable_gqa=gqa)
        row[f"{label}_backend"] = torch.nn.attention.SDPBackend(choice).name

        def step(q=tensors[0], k=tensors[1], v=tensors[2], attn_mask=tensors[3]):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=not mask, enable_gqa=gqa)
            out.sum().backward()

        try:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            row[f"{label}_fwd_bwd_s"] = timed(torch, step)
            row[f"{label}_peak_above_inputs"] = torch.cuda.max_memory_allocated() - base
        except Exception as err:  # noqa: BLE001 - a case the GPU cannot run is a row
            row[f"{label}_error"] = f"{type(err).__name__}: {str(err)[:200]}"
        tensors = step = None  # free this shape's inputs before the next
        torch.cuda.empty_cache()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_name("results")))
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: this benchmark runs SDPA on one", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    result = {"gpu": props.name, "date": dt.date.today().isoformat(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "rows": []}
    for case in CASES:
        row = measure(torch, *case)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out) / f"gpu_sdpa_backends-{props.name.replace(' ', '_')}-{result['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
