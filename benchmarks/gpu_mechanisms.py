"""The mechanisms under the planner's GPU numbers, measured on this machine's GPU against what the planner assumes.

Needs a CUDA GPU (exits 2 without one; `--device cpu --small` runs the timing code paths on the CPU as a check of
the script itself). Measures, each beside the planner's own figure for the detected catalog GPU:

- memory outside the caching allocator: the CUDA context (NVML's device-used before and after CUDA's first use,
  less torch.cuda.memory_reserved), and what cuBLAS, SDPA kernels, cross-entropy and fused AdamW add when they
  first run (lazy module loading grows the context; cuBLAS's workspace goes through the allocator);
- GEMM time over transformer shapes in bf16, fp16, fp32 and TF32 (CUDA events, median of repeats; GEMMs under
  64 GFLOP timed as 10 in a CUDA graph, so the host's launch cost stays out) vs. planner.speed.kernels.gemm_seconds;
- the backward thread's own cuBLAS workspace, and the bytes training dropout keeps per element (a bool mask);
- HBM bandwidth of a large copy and a large add vs. the catalog bandwidth x efficiency.json's fraction;
- fused attention (SDPA, flash and memory-efficient) forward + backward vs. efficiency.json's attention fraction;
- kernel launch cost on the GPU (a CUDA graph of tiny kernels) and eager dispatch cost on this host's CPU per op
  launched from Python, per view op, per autograd-engine kernel and per nn.Module call.

Results go to benchmarks/results/gpu_mechanisms-<GPU>-<date>.json with versions.

Run:  python benchmarks/gpu_mechanisms.py [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

MiB = 2**20
HIDDEN = (768, 1024, 2048, 4096, 8192)
TOKENS = (512, 2048, 8192, 32768)


def _nvml_used() -> int | None:
    """Bytes in use on device 0 as the driver reports it (nvidia-smi's figure), or None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    except Exception:  # noqa: BLE001 - a machine without NVML reports no figure
        return None


def measure_outside_allocator(torch) -> dict:
    """Device memory outside the caching allocator after each first use, in order."""
    from torch.nn import functional as F

    base = _nvml_used()
    stages, out = [], {"nvml_used_before_cuda": base, "module_loading": os.environ.get("CUDA_MODULE_LOADING", "")}

    def stage(name: str, fn) -> None:
        fn()
        torch.cuda.synchronize()
        used = _nvml_used()
        reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        stages.append({"stage": name, "nvml_used": used, "reserved": reserved, "allocated": allocated,
                       "outside_allocator": None if used is None or base is None else used - base - reserved})

    keep = {}
    stage("context", lambda: keep.setdefault("x", torch.zeros(1, device="cuda")))
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    stage("tensors", lambda: None)
    before = torch.cuda.memory_allocated()
    stage("bf16 matmul", lambda: keep.setdefault("y", a @ a))
    out["cublas_workspace_allocated"] = torch.cuda.memory_allocated() - before - a.numel() * 2
    stage("fp32 matmul", lambda: keep.setdefault("z", a.float() @ a.float()))
    q = torch.randn(4, 16, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    stage("sdpa bf16 fwd+bwd", lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward())
    logits = torch.randn(4096, 50257, device="cuda", requires_grad=True)
    stage("cross_entropy fwd+bwd",
          lambda: F.cross_entropy(logits, torch.randint(0, 50257, (4096,), device="cuda")).backward())
    p = torch.nn.Parameter(torch.randn(1024, 1024, device="cuda"))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], fused=True)
    stage("fused AdamW step", opt.step)
    out["stages"] = stages
    return out


def measure_step_rules(torch, gpu) -> dict:
    """Two rules the planner traces a CUDA step by, beside its figures: the backward's matmuls get a cuBLAS workspace
    of their own (they run on the autograd engine's device thread, with that thread's handle;
    planner.facts `cuda.blas_threads`), and training dropout keeps a bool mask, one byte an element, in
    fp32 as in bf16 (the fused `native_dropout`; planner/program/dropout.py)."""
    from torch.nn import functional as F

    from planner import facts
    from planner.memory.gpu import cublas_workspace_bytes

    x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = x @ w  # the Python thread's handle and workspace
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y.sum().backward()  # the backward's x.t() @ grad runs on the engine's thread
    torch.cuda.synchronize()
    out = {"backward_thread_workspace_allocated": torch.cuda.memory_allocated() - before - w.numel() * 2,
           "planner_workspace_per_thread": cublas_workspace_bytes(gpu), "planner_blas_threads": facts.get("cuda.blas_threads")}
    for dtype, width in ((torch.float32, 4), (torch.bfloat16, 2)):
        t = torch.randn(4096, 4096, device="cuda", dtype=dtype, requires_grad=True)
        before = torch.cuda.memory_allocated()
        kept = F.dropout(t, 0.1, training=True)
        out[f"dropout_{str(dtype)[6:]}_saved_bytes_per_element"] = (
            torch.cuda.memory_allocated() - before - kept.numel() * width) / t.numel()
        del kept
    out["planner_dropout_saved_bytes_per_element"] = 1.0
    return out


def _time(torch, fn, device: str, reps: int = 20, graph: int = 0) -> float:
    """Median seconds of fn() after warm-up (CUDA events on the GPU, a synchronised clock on the CPU). With
    `graph`, fn runs `graph` times inside a captured CUDA graph and one replay's time is divided by it: the GPU's
    own time, without the host's launch cost between calls."""
    for _ in range(3):
        fn()
    if graph and device == "cuda":
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            for _ in range(graph):
                fn()
        return _time(torch, captured.replay, device, reps) / graph
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def gemm_shapes(small: bool):
    for h in HIDDEN[:1] if small else HIDDEN:
        for tokens in TOKENS[:1] if small else TOKENS:
            yield tokens, h, h            # attention projections (forward)
            yield tokens, 4 * h, h        # MLP up
            yield tokens, h, 4 * h        # MLP down
            yield h, h, tokens            # a weight gradient: K is the token count


def measure_gemms(torch, gpu, eff, device: str, small: bool) -> list[dict]:
    from planner.speed.kernels import gemm_seconds

    rows = []
    for dtype_name, torch_dtype, tf32 in (("bf16", torch.bfloat16, False), ("fp16", torch.float16, False),
                                          ("fp32", torch.float32, False), ("tf32", torch.float32, True)):
        if device == "cpu" and dtype_name != "fp32":
            continue
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for m, n, k in gemm_shapes(small):
            a = torch.randn(m, k, device=device, dtype=torch_dtype)
            b = torch.randn(k, n, device=device, dtype=torch_dtype)
            seconds = _time(torch, lambda: a @ b, device, graph=10 if 2 * m * n * k < 2**36 else 0)
            predicted = gemm_seconds(1, m, n, k, dtype_name, gpu, eff, a.element_size())
            rows.append({"dtype": dtype_name, "m": m, "n": n, "k": k, "seconds": seconds,
                         "tflops": 2 * m * n * k / seconds / 1e12, "predicted_seconds": predicted,
                         "predicted_over_measured": predicted / seconds})
    torch.backends.cuda.matmul.allow_tf32 = False
    return rows


def measure_bandwidth(torch, gpu, eff, device: str, small: bool) -> dict:
    n = (64 if small else 1024) * MiB // 4
    x, y = torch.randn(n, device=device), torch.randn(n, device=device)
    copy = _time(torch, lambda: x.clone(), device)
    add = _time(torch, lambda: x + y, device)
    peak = gpu.hbm_bandwidth_GBps * 1e9
    return {"bytes": n * 4, "copy_GBps": 2 * n * 4 / copy / 1e9, "add_GBps": 3 * n * 4 / add / 1e9,
            "catalog_GBps": gpu.hbm_bandwidth_GBps, "planner_fraction": eff.hbm,
            "copy_fraction": 2 * n * 4 / copy / peak, "add_fraction": 3 * n * 4 / add / peak}


def measure_attention(torch, gpu, eff, device: str, small: bool) -> list[dict]:
    from torch.nn import functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
    if device == "cpu":
        backends = {"math": SDPBackend.MATH}
    for name, backend in backends.items():
        for d, causal in ((64, True), (128, True), (128, False)):
            b, heads, s = (1, 4, 256) if small else (8, 2048 // d, 2048)
            q, k, v = (torch.randn(b, heads, s, d, device=device, dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))

            def step():
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()

            seconds = _time(torch, step, device, reps=10)
            flops = 4 * b * heads * s * s * d * 3.5 / (2 if causal else 1)  # fwd 2 GEMMs + bwd 5 (FA2 paper)
            rows.append({"backend": name, "head_dim": d, "causal": causal, "batch": b, "heads": heads, "seq": s,
                         "seconds": seconds, "fraction_of_peak": flops / seconds / (gpu.peak_tflops_for("bf16")
                                                                                    * 1e12),
                         "planner_fraction": eff.attention})
    return rows


def measure_overheads(torch, device: str) -> dict:
    """Host-side costs per op (the GPU runs ahead; ops are tiny), measured by the planner's own micro-benchmark
    (planner/hardware/host.py `measure_host_costs`, what a plan runs on the GPU it plans for), and the GPU-side cost
    per kernel."""
    from planner.hardware.host import measure_host_costs

    costs = measure_host_costs(device)
    out = {"python_kernel_us": costs.dispatch_us, "python_view_us": costs.python_op_us,
           "engine_kernel_us": costs.engine_dispatch_us, "module_call_us": costs.module_call_us}
    if device == "cuda":
        graph, static = torch.cuda.CUDAGraph(), torch.ones(8, device="cuda")
        with torch.cuda.graph(graph):
            for _ in range(200):
                static.add_(1)
        out["gpu_kernel_in_graph_us"] = _time(torch, graph.replay, device) / 200 * 1e6
        stream_x = torch.ones(8, device="cuda")
        out["gpu_kernel_eager_us"] = _time(torch, lambda: [stream_x.add_(1) for _ in range(200)], device) / 200 * 1e6
    return out


SECTIONS = ("outside_allocator", "step_rules", "gemm", "bandwidth", "attention", "overheads")


def planner_overheads(eff) -> dict:
    return {"dispatch_us": eff.dispatch_us, "python_op_us": eff.python_op_us, "cpp_op_us": eff.cpp_op_us,
            "module_call_us": eff.module_call_us, "launch_us": eff.launch_us}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_name("results")))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true", help="small sizes (a check of the script)")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--gpu", default=None, help="catalog GPU to compare with (default: the detected one)")
    args = parser.parse_args()
    import torch

    from planner.hardware import detect_gpus, lookup_gpu
    from planner.hardware.efficiency_data import efficiency
    from planner.hardware.host import cpu_name

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU: this benchmark measures one", file=sys.stderr)
        return 2
    local = detect_gpus() if args.device == "cuda" else None
    gpu = lookup_gpu(args.gpu) if args.gpu else (local.gpu if local else lookup_gpu("H100-80GB"))
    eff = efficiency(gpu.name)
    result = {"gpu": gpu.name, "nvml_name": local.nvml_name if local else None, "date": dt.date.today().isoformat(),
              "torch": torch.__version__, "cuda": torch.version.cuda, "device": args.device,
              "host_cpu": cpu_name(), "planner_overheads": planner_overheads(eff)}
    sections = [("gemm", lambda: measure_gemms(torch, gpu, eff, args.device, args.small)),
                ("bandwidth", lambda: measure_bandwidth(torch, gpu, eff, args.device, args.small)),
                ("attention", lambda: measure_attention(torch, gpu, eff, args.device, args.small)),
                ("overheads", lambda: measure_overheads(torch, args.device))]
    if args.device == "cuda":
        sections[:0] = [("outside_allocator", lambda: measure_outside_allocator(torch)),
                        ("step_rules", lambda: measure_step_rules(torch, gpu))]
    sections = [(name, fn) for name, fn in sections if name in args.sections.split(",")]
    out = Path(args.out) / f"gpu_mechanisms-{gpu.name}-{result['date']}{'-cpu' if args.device == 'cpu' else ''}"
    every = len(sections) == len(SECTIONS) - (2 if args.device == "cpu" else 0)
    out = out.with_name(out.name + ("" if every else "-" + "-".join(n for n, _ in sections)) + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, fn in sections:
        t = time.monotonic()
        try:
            result[name] = fn()
        except Exception as err:  # noqa: BLE001 - one section failing is recorded, the rest still run
            result[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        print(f"{name}: {time.monotonic() - t:.1f} s", flush=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    summarise(result)
    print(f"wrote {out}")
    return 0


def summarise(result: dict) -> None:
    gemms = result.get("gemm")
    if isinstance(gemms, list):
        for dtype in ("bf16", "fp16", "fp32", "tf32"):
            ratios = [r["predicted_over_measured"] for r in gemms if r["dtype"] == dtype]
            if ratios:
                print(f"gemm {dtype}: predicted/measured median {statistics.median(ratios):.2f} "
                      f"(min {min(ratios):.2f}, max {max(ratios):.2f}); best "
                      f"{max(r['tflops'] for r in gemms if r['dtype'] == dtype):.0f} TFLOP/s")
    for key in ("bandwidth", "overheads", "outside_allocator", "step_rules"):
        if key in result:
            print(f"{key}: {json.dumps(result[key])[:600]}")
    if isinstance(result.get("attention"), list):
        for r in result["attention"]:
            print(f"attention {r['backend']} d={r['head_dim']} causal={r['causal']}: "
                  f"{r['fraction_of_peak']:.2f} of peak (planner {r['planner_fraction']:.2f})")


if __name__ == "__main__":
    sys.exit(main())
