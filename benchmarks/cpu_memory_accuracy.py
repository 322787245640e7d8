"""`estimate_memory(device="cpu")` against real `transformers.Trainer` steps on the CPU, judged by two instruments that
share no code with the planner (imported only for its prediction, in the parent process).

Each case runs in a fresh subprocess: a small random-weight model built from a config, the Trainer (use_cpu, fp32,
optim="adamw_torch", otherwise its defaults) on fixed-length random token ids, max_steps 3. Step 0 warms up (AdamW's
states appear); step 1 is measured by B, step 2 by A, each from `on_step_begin` to `on_step_end`.
  A: torch.profiler (profile_memory, record_shapes) and its CPU memory timeline: the peak of total live bytes,
     pre-existing tensors the step touches included, against `peak_allocated`.
  B: resident memory, VmHWM (reset by 5 > /proc/self/clear_refs) minus VmRSS just before the step, glibc told to mmap
     and unmap blocks >= 64 KiB, against `peak_allocated` minus what the prediction has alive before a step
     (parameters, optimizer states, buffers). RSS also counts allocator slack and memory outside torch's allocator.

Run:  HF_HUB_OFFLINE=1 python benchmarks/cpu_memory_accuracy.py [--out benchmarks/results/cpu_memory.json]
About 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

OPTIONS = ("lr", "betas", "eps", "weight_decay", "foreach", "fused")  # the Trainer's AdamW, recorded per case
MEASURED_STEPS = {"B": 1, "A": 2}  # global_step at on_step_begin; step 0 is the warm-up
CHILD_ENV = {  # glibc: no dynamic mmap threshold, blocks >= 64 KiB mmap'd and unmapped on free; one arena
    "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072", "MALLOC_ARENA_MAX": "1",
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
WHAT_IT_CANNOT_SHOW = (
    "CUDA: CPU kernels differ from CUDA's (attention backends, matmul workspaces, fused AdamW instead of the CPU's "
    "for-loop), and the CPU allocator has no caching, rounding or fragmentation like CUDA's caching allocator, so "
    "agreement here says nothing about reserved memory, the CUDA context or NCCL. Only fp32 AdamW on one process is "
    "run, and only small models: bf16 autocast, other optimizers, ZeRO/FSDP, offload and large-model effects are "
    "not tested. Instrument A sees only what torch's CPU allocator reports (tensor storages), not memory taken by "
    "libraries outside it; B sees everything resident but cannot tell live bytes from allocator slack.")


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


TRAINER_CASES = [  # model, micro_batch, seq_len, checkpointing, grad_accum (fp32, Trainer's adamw_torch = "adamw")
    ("gpt2-4L", 4, 256, "none", 1),
    ("llama-4L", 4, 256, "none", 1),
    ("bloom-6L", 4, 256, "none", 1),
    ("bert-cls-4L", 8, 256, "none", 1),
    ("llama-8L", 2, 512, "none", 1),
    ("llama-4L", 4, 256, "full", 1),
    ("gpt2-4L", 4, 256, "none", 2),
    ("llama-8L", 2, 512, "full", 2),
]

# The previous version of this benchmark's cases (precision and optimizer varied), kept because
# benchmarks/cpu_speed_proxy.py imports `CASES` and `small_configs` from here; this benchmark runs TRAINER_CASES.
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


# ---- instrument A: torch.profiler's memory timeline --------------------------------------------------------------

def memory_profiler():
    """torch.profiler as instrument A uses it. with_stack=False: `profile.export_memory_timeline` would refuse it
    (torch/profiler/profiler.py:574-585, `_memory_profile` requires record_shapes, profile_memory and with_stack),
    so `timeline_live_bytes` builds the same MemoryProfile from the profiler's results itself; with_stack only adds
    the Python tracer, which names parameters by module (categories), not what the timeline's totals count."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=False)


def timeline_live_bytes(prof, device: str = "cpu") -> dict:
    """Live bytes on `device` over a finished profile, from torch's memory timeline: MemoryProfile
    (torch/profiler/_memory_profiler.py:685; `timeline` at :701 turns allocation events into CREATE / DESTROY and
    adds a PREEXISTING entry for every tensor an op touched whose allocation came before the profile) exported by
    MemoryProfileTimeline.export_memory_timeline (:1085, as `profile.export_memory_timeline(path, device)` does,
    profiler.py:591-640) as [times, sizes by category]. `start`: bytes live at the first point (the pre-existing
    tensors), `peak`: the largest total, `end`: the last. `events_peak_delta` checks the timeline from the raw
    allocation events alone: the running sum of their signed sizes in time order, at its maximum."""
    from torch._C._profiler import _EventType
    from torch.profiler._memory_profiler import MemoryProfile, MemoryProfileTimeline

    timeline = MemoryProfileTimeline(MemoryProfile(prof.profiler.kineto_results))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "timeline.json")
        timeline.export_memory_timeline(path, device)
        with open(path) as f:
            _, sizes = json.load(f)
    totals = [sum(point) for point in sizes] or [0]
    allocations, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.typed[0] == _EventType.Allocation and event.typed[1].device == torch.device(device):
            allocations.append((event.start_time_ns, event.typed[1].alloc_size))
    running = peak_delta = 0
    for _, size in sorted(allocations, key=lambda a: a[0]):
        running += size
        peak_delta = max(peak_delta, running)
    return {"start": totals[0], "peak": max(totals), "end": totals[-1], "events_peak_delta": peak_delta,
            "allocation_events": len(allocations)}


# ---- instrument B: resident memory -------------------------------------------------------------------------------

def resident() -> dict:
    """VmRSS and VmHWM of this process, bytes."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(value.split()[0]) * 1024
    return values


def reset_peak_resident() -> None:
    """Linux: VmHWM := VmRSS (proc(5), /proc/pid/clear_refs, value 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# ---- the measured Trainer run (child process) -------------------------------------------------------------------

class TokenDataset(torch.utils.data.Dataset):
    """Fixed-length random token ids with the labels the model's head trains on."""

    def __init__(self, n: int, seq_len: int, vocab: int, classes: int | None):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=generator)
        self.labels = torch.randint(0, classes, (n,), generator=generator) if classes else None

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i] if self.labels is not None else self.ids[i]}


class StepInstruments(transformers.TrainerCallback):
    """B around step MEASURED_STEPS["B"], A (the profiler) around step MEASURED_STEPS["A"]. on_step_begin comes
    before the step's first micro-batch, on_step_end after the optimizer step, the scheduler and zero_grad."""

    def __init__(self):
        self.profiler, self.result = memory_profiler(), {}

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == MEASURED_STEPS["B"]:
            self.result["rss_before"] = resident()["VmRSS"]
            reset_peak_resident()
            self.result["hwm_reset_to"] = resident()["VmHWM"]
            self._t = time.perf_counter()
        elif state.global_step == MEASURED_STEPS["A"]:
            self._t = time.perf_counter()
            self.profiler.start()

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step - 1  # incremented before on_step_end
        if step == MEASURED_STEPS["B"]:
            self.result["hwm"] = resident()["VmHWM"]
            self.result["b_step_s"] = round(time.perf_counter() - self._t, 2)
        elif step == MEASURED_STEPS["A"]:
            self.profiler.stop()
            self.result["a_step_s"] = round(time.perf_counter() - self._t, 2)


def training_arguments(output_dir: str, micro_batch: int, checkpointing: str, grad_accum: int):
    fields = transformers.TrainingArguments.__dataclass_fields__
    flag = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    return transformers.TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=micro_batch, gradient_accumulation_steps=grad_accum,
        max_steps=max(MEASURED_STEPS.values()) + 1, use_cpu=True, optim="adamw_torch", report_to=[],
        dataloader_num_workers=0, save_strategy="no", eval_strategy="no", disable_tqdm=True,
        **{flag: checkpointing == "full"})


def measure(name: str, micro_batch: int, seq_len: int, checkpointing: str, grad_accum: int) -> dict:
    """One Trainer run of the case in this process; both instruments' readings."""
    config = small_configs()[name]
    torch.manual_seed(0)
    model = getattr(transformers, config.architectures[0])(config)
    classes = config.num_labels if "Classification" in config.architectures[0] else None
    steps = max(MEASURED_STEPS.values()) + 1
    data = TokenDataset(steps * grad_accum * micro_batch, seq_len, config.vocab_size, classes)
    instruments = StepInstruments()
    with tempfile.TemporaryDirectory() as folder:
        trainer = transformers.Trainer(model=model, args=training_arguments(folder, micro_batch, checkpointing,
                                                                            grad_accum),
                                       train_dataset=data, callbacks=[instruments])
        trainer.train()
    out = dict(instruments.result)
    out["a"] = timeline_live_bytes(instruments.profiler)
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # inside accelerate's wrapper
    out["optimizer"] = f"{type(optimizer).__name__}({', '.join(f'{k}={optimizer.defaults.get(k)}' for k in OPTIONS)})"
    out["gradient_checkpointing"] = bool(getattr(model, "is_activation_checkpointing",
                                                 getattr(model, "is_gradient_checkpointing", False)))
    out["attention"] = model.config._attn_implementation
    out["parameter_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return out


# ---- the benchmark (parent process) ------------------------------------------------------------------------------

def run_case(case: tuple) -> dict:
    """The prediction here, the measurement in a fresh subprocess (clean RSS, glibc set by CHILD_ENV)."""
    from planner import estimate_memory

    name, mb, seq, ckpt, n = case
    t0 = time.time()
    est = estimate_memory(small_configs()[name], micro_batch=mb, seq_len=seq, precision="fp32", optimizer="adamw",
                          checkpointing=ckpt, grad_accum=n, device="cpu", method="trace")
    t1 = time.time()
    done = subprocess.run([sys.executable, __file__, "--measure", json.dumps(case)], capture_output=True, text=True,
                          env={**os.environ, **CHILD_ENV}, timeout=600, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("MEASURED ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{case}: measurement failed\n{done.stderr[-3000:]}")
    real = json.loads(lines[-1][len("MEASURED "):])
    before = est.parameters + est.optimizer_states + est.terms.model_buffers
    a_peak, b_delta = real["a"]["peak"], real["hwm"] - real["rss_before"]
    return {
        "model": name, "micro_batch": mb, "seq_len": seq, "grad_accum": n, "checkpointing": ckpt,
        "precision": "fp32", "optimizer": "adamw", "method": est.method,
        "predicted_peak": est.peak_allocated, "predicted_states": est.model_states,
        "predicted_before_step": before, "predicted_peak_delta": est.peak_allocated - before,
        "a_peak": a_peak, "a_start": real["a"]["start"], "a_end": real["a"]["end"],
        "a_peak_delta": a_peak - real["a"]["start"], "a_events_peak_delta": real["a"]["events_peak_delta"],
        "a_error": (est.peak_allocated - a_peak) / a_peak,
        "b_rss_before": real["rss_before"], "b_hwm": real["hwm"], "b_peak_delta": b_delta,
        "b_error": (est.peak_allocated - before - b_delta) / b_delta,
        "trainer_optimizer": real["optimizer"], "attention": real["attention"],
        "gradient_checkpointing": real["gradient_checkpointing"],
        "predict_s": round(t1 - t0, 2), "measure_s": round(time.time() - t1, 2),
        "a_step_s": real["a_step_s"], "b_step_s": real["b_step_s"]}


def summarize(rows: list[dict], key: str) -> dict:
    errors = [r[key] for r in rows]
    worst = max(rows, key=lambda r: abs(r[key]))
    return {"median_abs_error": statistics.median(abs(e) for e in errors), "worst_abs_error": abs(worst[key]),
            "worst_case": f"{worst['model']} mb={worst['micro_batch']} s={worst['seq_len']} "
                          f"{worst['checkpointing']} N={worst['grad_accum']}",
            "mean_signed_error": statistics.fmean(errors), "median_signed_error": statistics.median(errors),
            "share_under_predicted": sum(e < 0 for e in errors) / len(errors), "cases": len(errors)}


INSTRUMENTS = {
    "A": "torch.profiler(profile_memory=True, record_shapes=True, with_stack=False) around the Trainer's third step "
         "(on_step_begin..on_step_end); torch's memory timeline of device cpu (MemoryProfile -> "
         "MemoryProfileTimeline.export_memory_timeline); the peak of total live bytes, pre-existing tensors the step "
         "touches included. Compared with predicted peak_allocated. a_events_peak_delta cross-checks a_peak - a_start "
         "from the raw allocation events' running sum.",
    "B": "Resident memory around the Trainer's second step: VmHWM after it (reset with 5 > /proc/self/clear_refs at "
         "its start) minus VmRSS at its start, with MALLOC_MMAP_THRESHOLD_=65536, MALLOC_TRIM_THRESHOLD_=131072, "
         "MALLOC_ARENA_MAX=1. Compared with predicted peak_allocated - (parameters + optimizer_states + "
         "model_buffers), what the prediction has alive before a step (gradients are None then: zero_grad sets "
         "them to None).",
}


def run(out: str | None) -> list[dict]:
    rows = []
    for case in TRAINER_CASES:
        row = run_case(case)
        rows.append(row)
        print(f"{row['model']:12s} mb={row['micro_batch']:<2d} s={row['seq_len']:<4d} {row['checkpointing']:5s} "
              f"N={row['grad_accum']}  predicted {row['predicted_peak'] / 2**20:7.2f} MiB"
              f"  A {row['a_peak'] / 2**20:7.2f} MiB {row['a_error']:+7.3%}"
              f"  | predicted delta {row['predicted_peak_delta'] / 2**20:7.2f} MiB"
              f"  B {row['b_peak_delta'] / 2**20:7.2f} MiB {row['b_error']:+7.3%}  ({row['measure_s']:.0f} s)",
              flush=True)
    summary = {name: summarize(rows, f"{name.lower()}_error") for name in INSTRUMENTS}
    for name, s in summary.items():
        print(f"{name}: median |error| {s['median_abs_error']:.3%}, worst {s['worst_abs_error']:.3%} "
              f"({s['worst_case']}), mean signed {s['mean_signed_error']:+.3%}, "
              f"under-predicted {s['share_under_predicted']:.0%}")
    if out:
        write(out, rows, summary)
    return rows


def _commit() -> str | None:
    """HEAD of the checkout the prediction came from, '+dirty' where planner/ has uncommitted changes."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "planner"], cwd=root, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def write(out: str, rows: list[dict], summary: dict) -> None:
    environment = {
        "torch": torch.__version__, "transformers": transformers.__version__,
        "accelerate": __import__("accelerate").__version__, "python": sys.version.split()[0],
        "cpu_threads": torch.get_num_threads(), "os_cpu_count": os.cpu_count(),
        "command": "HF_HUB_OFFLINE=1 python benchmarks/cpu_memory_accuracy.py --out benchmarks/results/cpu_memory.json",
        "child_env": CHILD_ENV, "date": time.strftime("%Y-%m-%d"), "commit": _commit()}
    with open(out, "w") as f:
        json.dump({"environment": environment, "instruments": INSTRUMENTS, "summary": summary,
                   "what_it_cannot_show": WHAT_IT_CANNOT_SHOW, "cases": rows}, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the per-case results as JSON")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # child: one case, as JSON
    cli = parser.parse_args()
    if cli.measure:
        print("MEASURED " + json.dumps(measure(*json.loads(cli.measure))), flush=True)
    else:
        run(cli.out)
