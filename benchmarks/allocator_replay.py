"""Caching-allocator model vs. the real allocator: replay the same events on a CUDA GPU and through
planner.allocator.replay, and compare peak allocated / requested / reserved bytes and device-call counts.

Needs a CUDA GPU (exits 2 without one). Events come from a JSON file (a list of [op, key, size] with op "alloc" or
"free", or the compact int form of planner.allocator.iter_events) or from built-in synthetic patterns. Each
workload runs under the default settings and with expandable_segments:True; on the GPU every alloc is
torch.cuda.caching_allocator_alloc(size) and every free torch.cuda.caching_allocator_delete(ptr), after
torch.cuda.empty_cache() and torch.cuda.reset_peak_memory_stats(). Results (with versions) go to --out as JSON.

`compare_on_cuda(events, settings)` is importable by other benchmark scripts.

Run:  python benchmarks/allocator_replay.py [--events FILE.json] [--patterns NAME ...] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import random
import sys
import time
from pathlib import Path

from planner.allocator import AllocatorSettings, iter_events, replay

KiB = 1024
MiB = 1024 * KiB
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "allocator_replay.json"


# --- synthetic workloads ----------------------------------------------------------------------------------------
def _small_churn(rng: random.Random, n: int = 20_000) -> list:
    """Many small (<= 1 MiB) tensors freed in random order: exercises the small pool."""
    events, live = [], []
    for key in range(n):
        if live and (rng.random() < 0.5 or len(live) > 2000):
            events.append(("free", live.pop(rng.randrange(len(live))), 0))
        events.append(("alloc", key, rng.randint(1, MiB)))
        live.append(key)
    return events + [("free", k, 0) for k in live]


def _training_step(rng: random.Random, layers: int = 24, hidden: int = 2048, tokens: int = 4096) -> list:
    """Forward keeps a few activations per layer and frees temporaries; backward frees activations in reverse
    while allocating and freeing gradients: the LIFO shape of a transformer step."""
    events, key, saved = [], 0, []
    unit = tokens * hidden * 2  # one bf16 activation
    for _ in range(layers):
        for factor in (1, 3, 1, 4, 1):
            events.append(("alloc", key, unit * factor // 2 + rng.randint(0, 4 * KiB)))
            if factor == 4:  # a temporary, freed at once
                events.append(("free", key, 0))
            else:
                saved.append(key)
            key += 1
    for layer_keys in reversed([saved[i:i + 4] for i in range(0, len(saved), 4)]):
        grad = key
        events.append(("alloc", grad, unit * 4))
        key += 1
        for k in reversed(layer_keys):
            events.append(("free", k, 0))
        events.append(("free", grad, 0))
    return events


def _growing_batch(rng: random.Random, layers: int = 16) -> list:
    """Iterations with batch 8, 9, ..., 16: each tensor is slightly bigger than last time (the case expandable
    segments were made for)."""
    events, key = [], 0
    for batch in range(8, 17):
        live = []
        for _ in range(layers):
            for per_sample in (3 * MiB, 5 * MiB + 512 * KiB, 700 * KiB):
                events.append(("alloc", key, batch * per_sample + rng.randint(0, 512)))
                live.append(key)
                key += 1
        events += [("free", k, 0) for k in reversed(live)]
    return events


def _random_mixed(rng: random.Random, n: int = 30_000, live_limit: int = 8 * 1024 * MiB) -> list:
    """Log-uniform sizes from 512 B to 256 MiB, random frees, live bytes kept under live_limit."""
    events, live, sizes, live_bytes = [], [], {}, 0
    for key in range(n):
        while live and (live_bytes > live_limit or rng.random() < 0.45):
            victim = live.pop(rng.randrange(len(live)))
            live_bytes -= sizes.pop(victim)
            events.append(("free", victim, 0))
            if live_bytes <= live_limit:
                break  # at most one random free per allocation
        size = int(2 ** rng.uniform(9, 28))
        events.append(("alloc", key, size))
        live.append(key)
        sizes[key] = size
        live_bytes += size
    return events + [("free", k, 0) for k in live]


PATTERNS = {
    "small_churn": _small_churn,
    "training_step": _training_step,
    "growing_batch": _growing_batch,
    "random_mixed": _random_mixed,
}


def synthetic_events(name: str, seed: int = 0) -> list:
    return PATTERNS[name](random.Random(seed))


# --- GPU replay -------------------------------------------------------------------------------------------------
def _settings_string(settings: AllocatorSettings) -> str:
    """PYTORCH_CUDA_ALLOC_CONF text for the knobs the model uses (parseArgs resets the others to defaults)."""
    parts = [f"expandable_segments:{settings.expandable_segments}"]
    if settings.max_split_size is not None:
        parts.append(f"max_split_size_mb:{settings.max_split_size // MiB}")
    if settings.max_non_split_rounding_size != AllocatorSettings().max_non_split_rounding_size:
        parts.append(f"max_non_split_rounding_mb:{settings.max_non_split_rounding_size // MiB}")
    if settings.roundup_power2_divisions:
        table = ",".join(f"{1 << i}:{d}" for i, d in enumerate(settings.roundup_power2_divisions))
        parts.append(f"roundup_power2_divisions:[{table}]")
    return ",".join(parts)


def _apply_settings(torch, settings: AllocatorSettings) -> list[str]:
    """Set the allocator options on the live allocator; returns notes about what could not be matched."""
    notes = []
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is not None:
        setter(_settings_string(settings))
    elif settings != AllocatorSettings():
        notes.append("torch.cuda.memory._set_allocator_settings missing: GPU ran with the process's settings")
    if settings.large_segment_size != AllocatorSettings().large_segment_size:
        notes.append("large_segment_size is not set on the GPU (startup-only option)")
    fraction = 1.0
    if settings.capacity_bytes is not None:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        fraction = min(1.0, settings.capacity_bytes / total)
        notes.append("capacity via set_per_process_memory_fraction: same check as the model for cudaMalloc "
                     "segments, but with expandable segments torch checks the rounded request, not the pages")
    torch.cuda.set_per_process_memory_fraction(fraction)
    return notes


def _run_on_gpu(torch, events: list) -> tuple[int | None, float]:
    """Replay events through the real caching allocator; returns (index of the OOM event or None, seconds)."""
    live: dict = {}
    oom_event = None
    start = time.perf_counter()
    try:
        for index, (op, key, size) in enumerate(events):
            if op == "alloc":
                live[key] = torch.cuda.caching_allocator_alloc(int(size)) if size else 0
            else:
                ptr = live.pop(key, 0)
                if ptr:
                    torch.cuda.caching_allocator_delete(ptr)
    except torch.OutOfMemoryError:
        oom_event = index
    elapsed = time.perf_counter() - start
    for ptr in live.values():
        if ptr:
            torch.cuda.caching_allocator_delete(ptr)
    return oom_event, elapsed


def compare_on_cuda(events, settings: AllocatorSettings | None = None) -> dict:
    """Replay `events` on the current CUDA device and through the model (default settings when None); returns
    measured and predicted numbers, their differences, and notes on settings the GPU run could not match."""
    import torch

    settings = AllocatorSettings() if settings is None else settings
    if not torch.cuda.is_available():
        raise RuntimeError("compare_on_cuda needs a CUDA GPU")
    events = list(iter_events(events))
    notes = _apply_settings(torch, settings)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.reset_accumulated_memory_stats()  # num_device_alloc / num_alloc_retries are accumulated counters
    if settings.expandable_segments:
        notes.append("measured 'segments' is torch's segment stat, which expandable segments do not increment")
    base_allocated, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    base_requested = torch.cuda.memory_stats().get("requested_bytes.all.current", 0)
    if base_allocated or base_reserved:
        notes.append(f"allocator not empty at start: {base_allocated} B allocated, {base_reserved} B reserved")
    oom_event, gpu_seconds = _run_on_gpu(torch, events)
    stats = torch.cuda.memory_stats()
    measured = {
        "peak_allocated": torch.cuda.max_memory_allocated() - base_allocated,
        "peak_requested": stats.get("requested_bytes.all.peak", 0) - base_requested,
        "peak_reserved": torch.cuda.max_memory_reserved() - base_reserved,
        "segments": stats.get("segment.all.peak"), "cuda_mallocs": stats.get("num_device_alloc"),
        "cuda_frees": stats.get("num_device_free"), "alloc_retries": stats.get("num_alloc_retries"),
        "oom_event": oom_event, "seconds": gpu_seconds,
    }
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)
    start = time.perf_counter()
    predicted = replay(events, settings)
    model_seconds = time.perf_counter() - start
    return {
        "settings": _settings_string(settings), "capacity_bytes": settings.capacity_bytes, "events": len(events),
        "measured": measured, "predicted": {**dataclasses.asdict(predicted), "seconds": model_seconds},
        "error_allocated": predicted.peak_allocated - measured["peak_allocated"],
        "error_requested": predicted.peak_requested - measured["peak_requested"],
        "error_reserved": predicted.peak_reserved - measured["peak_reserved"], "notes": notes,
    }


# --- command line -----------------------------------------------------------------------------------------------
def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Replay allocation events on a CUDA GPU and through planner.allocator.replay; compare "
                    "peak allocated/reserved bytes under default settings and expandable_segments:True.")
    parser.add_argument("--events", type=Path, help="JSON file: a list of [op, key, size] (or compact ints)")
    parser.add_argument("--patterns", nargs="*", choices=sorted(PATTERNS), default=None,
                        help="synthetic workloads (default: all, unless --events is given)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-split-size-mb", type=int, default=None, help="also set max_split_size_mb")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results (default {DEFAULT_OUT})")
    return parser.parse_args(argv)


def _workloads(args: argparse.Namespace) -> dict[str, list]:
    workloads = {}
    if args.events is not None:
        workloads[args.events.stem] = json.loads(args.events.read_text())
    names = args.patterns if args.patterns is not None else ([] if args.events else sorted(PATTERNS))
    for name in names:
        workloads[name] = synthetic_events(name, args.seed)
    return workloads


def _row(name: str, mode: str, r: dict) -> str:
    m, p = r["measured"], r["predicted"]
    return (f"{name:16s} {mode:10s} {r['events']:>8d} {m['peak_allocated'] / MiB:>10.1f} "
            f"{p['peak_allocated'] / MiB:>10.1f} {m['peak_reserved'] / MiB:>10.1f} {p['peak_reserved'] / MiB:>10.1f} "
            f"{m['cuda_mallocs']!s:>7s} {p['cuda_mallocs']:>7d}")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("allocator_replay: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    mss = None if args.max_split_size_mb is None else args.max_split_size_mb * MiB
    modes = {"default": AllocatorSettings(max_split_size=mss),
             "expandable": AllocatorSettings(max_split_size=mss, expandable_segments=True)}
    print(f"{'workload':16s} {'mode':10s} {'events':>8s} {'alloc MiB':>10s} {'model':>10s} {'resv MiB':>10s} "
          f"{'model':>10s} {'mallocs':>7s} {'model':>7s}")
    rows = []
    for name, events in _workloads(args).items():
        for mode, settings in modes.items():
            result = compare_on_cuda(events, settings)
            rows.append({"workload": name, "mode": mode, **result})
            print(_row(name, mode, result))
    report = {"date": dt.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
              "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(), "seed": args.seed, "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
