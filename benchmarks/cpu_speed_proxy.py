"""The speed model's accounting checked on the CPU: the same per-op model (planner/speed/ on the traced op
profile) with this machine's own rates predicts the real CPU step times of cpu_memory_accuracy.py's cases.

A GPU's rates come from efficiency.json; here they are measured first by micro-benchmarks on this CPU (fp32 and
bf16 matmul FLOP/s, fused attention's forward + backward as a fraction of the matmul rate of its dtype, as
efficiency.json gives each GPU's, copy bandwidth, the host cost of an eager op, of an op the autograd engine issues,
of a view and of a module call). On a CPU the host issues and runs every op itself, so a micro-step (and the
optimizer step: AdamW's as the Python loop torch runs on CPU tensors, SGD's as its CUDA foreach program, which differs
by one op per tensor) is the sum of the modelled kernel time and dispatch time, not their maximum. The GEMM shape model (wave quantization over SMs) has no
meaning here: the CPU is one "SM" with one tile. A checkpointed block's extra host cost is efficiency.json's count of
Python view ops per block times this CPU's view op; that count was measured on a CPU like this one
(benchmarks/checkpoint_host_cost.py), so the checkpointed cases are in-sample for it. Nothing is fitted to the
measured steps.

Run:  HF_HUB_OFFLINE=1 python benchmarks/cpu_speed_proxy.py [--out benchmarks/results/cpu_speed_proxy.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from cpu_memory_accuracy import CASES, small_configs  # noqa: E402
from planner.hardware.host import cpu_name  # noqa: E402


def _best(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_rates() -> dict:
    """This CPU's rates, as the speed model's inputs."""
    n = 1024
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        # the best of two operand layouts, as a GPU's peak is the best case: this CPU's bf16 GEMM runs ~14x faster
        # with the second operand transposed (as nn.Linear's weight is) than contiguous
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        best = min(_best(lambda: torch.mm(a, b)), _best(lambda: torch.mm(a, b.t())))
        rates[f"matmul_tflops_{str(dtype).split('.')[-1]}"] = 2 * n**3 / best / 1e12
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[-1]
        rates[f"attention_fraction_{name}"] = attention_tflops(dtype) / rates[f"matmul_tflops_{name}"]
    src, dst = torch.randn(2**25), torch.empty(2**25)
    rates["copy_GBps"] = 2 * src.numel() * 4 / _best(lambda: dst.copy_(src)) / 1e9
    x, count = torch.ones(16), 2000

    def eager():
        for _ in range(count):
            torch.add(x, 1)

    def views():
        for _ in range(count):
            x.view(4, 4)

    identity = torch.nn.Identity()

    def modules():
        for _ in range(count):
            identity(x)

    def engine():
        y = torch.ones(16, requires_grad=True)
        z = y
        for _ in range(200):
            z = z * 1.0001
        z.sum().backward()

    rates["eager_dispatch_us"] = _best(eager) / count * 1e6
    rates["python_op_us"] = _best(views) / count * 1e6
    rates["module_call_us"] = _best(modules) / count * 1e6
    # 200 forward muls (eager) then 200 backward muls from the engine: the engine's share is what is left
    rates["engine_dispatch_us"] = max(0.0, (_best(engine) * 1e6 - 200 * rates["eager_dispatch_us"]) / 200)
    return rates


def attention_tflops(dtype, batch: int = 4, heads: int = 8, seq: int = 256, head_dim: int = 32) -> float:
    """SDPA's causal forward + backward on this CPU (the cases' attention shape: 8 heads of 32, 256 tokens), in
    TFLOP/s counted as the traced profile counts them (torch.utils.flop_counter's SDPA formulas, halved for causal
    masking: planner/program/profile.py `OpRecorder._attention`)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    q, k, v = (torch.randn(batch, heads, seq, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
    flops = sdpa_flop_count(q.shape, k.shape, v.shape) + sdpa_backward_flop_count(q.shape, q.shape, k.shape, v.shape)
    flops /= 2

    def step():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return flops / _best(step) / 1e12


def cpu_model(rates: dict):
    """The per-op model's inputs for this CPU: a GPU catalog entry and efficiencies made of the measured rates."""
    from planner.hardware import GPU
    from planner.hardware.efficiency_data import efficiency

    gpu = GPU(name="this-cpu", vendor="cpu", memory_bytes=2**40, compute_capability="cpu", bf16=True,
              peak_tflops_fp32=rates["matmul_tflops_float32"], peak_tflops_fp16=rates["matmul_tflops_bfloat16"],
              peak_tflops_bf16=rates["matmul_tflops_bfloat16"], hbm_bandwidth_GBps=rates["copy_GBps"],
              intra_node_link="none", intra_node_bandwidth_GBps=1.0, source="benchmarks/cpu_speed_proxy.py")
    base = efficiency("H100-80GB")
    eff = base.model_copy(update=dict(
        gpu=gpu.name, sm_count=1, matmul={k: 1.0 for k in base.matmul}, misaligned=1.0,
        misaligned_align2=1.0, hbm=1.0, launch_us=0.0, dispatch_us=rates["eager_dispatch_us"],
        engine_dispatch_us=rates["engine_dispatch_us"], python_op_us=rates["python_op_us"],
        cpp_op_us=rates["python_op_us"], module_call_us=rates["module_call_us"],
        attention=rates["attention_fraction_float32"], tiles=((256, 128),)))  # checkpointing follows python_op_us
    return gpu, eff


def predict(config, mb, seq, precision, optimizer, ckpt, n, gpu, eff, rates: dict) -> float:
    from planner.config import Config
    from planner.models import resolve_model
    from planner.program.workload import Workload
    from planner.speed.kernels import micro_step
    from planner.speed.model import speed_profile
    from planner.speed.optimizer import optimizer_step
    from planner.vocab import CHECKPOINTING, FOR_LOOP_STEP, PRECISION

    resolved = resolve_model(config)
    cfg = Config(micro_batch=mb, grad_accum=n, world_size=1, precision=precision, checkpointing=ckpt,
                 zero_stage=0, offload="none")
    if PRECISION[precision].weight_bytes == 2 or PRECISION[precision].autocast:  # attention runs in bf16
        eff = eff.model_copy(update={"attention": rates["attention_fraction_bfloat16"]})
    profile, anchor = speed_profile(Workload(resolved, seq_len=seq, optimizer=optimizer, device="cpu"), cfg)
    blocks = resolved.spec.layers if CHECKPOINTING[ckpt].enabled else 0
    micro = micro_step(profile, mb / anchor, precision, gpu, eff, blocks)
    # torch steps CPU tensors in a Python loop (`_default_to_fused_or_foreach` picks foreach for CUDA tensors only);
    # vocab.OPTIMIZER_STEP describes SGD's CUDA program only
    opt = optimizer_step(resolved.spec, cfg, optimizer, gpu, eff, 1, FOR_LOOP_STEP)
    return n * (micro.gpu_s + micro.cpu_s) + opt.gpu_s + opt.cpu_s


def measure_step(config, mb, seq, precision, optimizer, ckpt, n, repeats: int = 5) -> float:
    """The case's real step time on this CPU: the best of `repeats`, as its rates are the best of their runs (a
    shared host only ever adds time)."""
    from planner.program.step import enable_checkpointing, make_batch, make_optimizer, micro_step
    from planner.vocab import PRECISION

    torch.manual_seed(0)
    dtype = torch.bfloat16 if PRECISION[precision].weight_bytes == 2 else torch.float32
    model = getattr(transformers, config.architectures[0])._from_config(config, dtype=dtype)
    model.train()
    enable_checkpointing(model, ckpt)
    opt = make_optimizer(model, optimizer)
    batch = make_batch(model, mb, seq)

    def step():
        for _ in range(n):
            micro_step(model, batch, PRECISION[precision].autocast)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: optimizer states exist
    return _best(step, repeats)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rates and the rows as JSON")
    args = parser.parse_args()
    rates = measure_rates()
    print("this CPU: " + ", ".join(f"{k} {v:.3g}" for k, v in rates.items()), flush=True)
    gpu, eff = cpu_model(rates)
    configs, rows = small_configs(), []
    for name, mb, seq, precision, optimizer, ckpt, n in CASES:
        measured = measure_step(configs[name], mb, seq, precision, optimizer, ckpt, n)
        predicted = predict(configs[name], mb, seq, precision, optimizer, ckpt, n, gpu, eff, rates)
        rows.append({"model": name, "micro_batch": mb, "seq_len": seq, "precision": precision, "optimizer": optimizer,
                     "checkpointing": ckpt, "grad_accum": n, "measured_s": measured, "predicted_s": predicted,
                     "error": predicted / measured - 1})
        print(f"{name:12s} mb={mb:<2d} s={seq:<4d} {precision:10s} {optimizer:12s} {ckpt:9s} N={n}  measured "
              f"{measured:7.3f} s  predicted {predicted:7.3f} s  {predicted / measured - 1:+6.1%}", flush=True)
    errors = [abs(r["error"]) for r in rows]
    summary = {"median_abs_error": statistics.median(errors), "worst": max((r["error"] for r in rows), key=abs),
               "rows": len(rows), "torch_threads": torch.get_num_threads()}
    print(f"\n{len(rows)} cases: median |error| {summary['median_abs_error']:.1%}, worst {summary['worst']:+.1%} "
          f"(inputs: the micro-benchmarked rates above, and for checkpointed cases the view-op count of a "
          f"checkpointed block, measured on a CPU like this one)")
    if args.out:
        Path(args.out).write_text(json.dumps({"torch": torch.__version__, "host": cpu_name(), "rates": rates,
                                              "summary": summary, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
