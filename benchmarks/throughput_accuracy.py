"""How well `planner.throughput.step_time` reproduces published measured training throughput.

Reads benchmarks/data/throughput_calibration.json (rows from optimised stacks: llm-foundry, NVIDIA
DeepLearningExamples, torchtitan, IBM FSDP, flash-attention, ...), builds a `ModelSpec` for each row from
its model description, predicts the row's own metric (tokens/s per GPU, samples/s in total, or MFU %) and
reports, per source group, the median ratio predicted/published and the median |log ratio|.

It reports twice: as shipped (with HF_CODE_FACTOR, so predictions should sit ~HF_CODE_FACTOR below the
optimised stacks) and as a "shape fit" with HF_CODE_FACTOR = 1.0. With --fit it searches EFFICIENCY_CEILING_A/B,
EFFICIENCY_HALF_TOKENS, EFFICIENCY_HALF_HIDDEN, the full-checkpointing recompute factor and (when fp32
rows exist) FP32_EFFICIENCY_BOOST for the smallest median |log ratio| at HF_CODE_FACTOR = 1.0, by
monkeypatching the module's constants (the file is not edited), and prints the values and the accuracy.

Run from the repository root:
    HF_HUB_OFFLINE=1 python benchmarks/throughput_accuracy.py            # accuracy of the current constants
    HF_HUB_OFFLINE=1 python benchmarks/throughput_accuracy.py --fit      # + fit (well under 2 minutes)
Options: --data PATH (default: benchmarks/data/throughput_calibration.json),
--balance (fit with each source group weighted equally instead of each row), --worst N.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import planner.throughput as T
from planner.config import Config
from planner.hardware import GPU, lookup_gpu
from planner.models.spec import ModelSpec

REPO = Path(__file__).resolve().parents[1]
DATA_NAME = "throughput_calibration.json"
DATA = REPO / "benchmarks" / "data" / DATA_NAME

#: id prefix -> source group (first match wins).
GROUPS = (("llmf-a100", "llm-foundry A100"), ("llmf-h100", "llm-foundry H100"), ("dlebert", "NVIDIA BERT"),
          ("dlebart", "NVIDIA BART"), ("tt-", "torchtitan"), ("torchao", "torchtitan"), ("f8blog", "torchtitan"),
          ("ibmfsdp", "IBM FSDP"), ("fmsfsdp", "IBM FSDP"), ("flashattn", "flash-attn GPT"),
          ("tinyllama", "TinyLlama"), ("olmocore", "OLMo-core"), ("automodel", "NeMo Automodel"))


@dataclass(frozen=True)
class Family:
    key: str              # lower-case keyword in the model text
    model_type: str
    architecture: str
    gated: bool
    tied: bool
    biased: bool          # linear biases and LayerNorm (vs. bias-free RMSNorm)
    positions: int | None  # learned positions; 0 = as many as seq_len; None = rotary


#: Checked in order ("olmo" before "llama": OLMo's text says "Llama2-like").
FAMILIES = (Family("mpt", "mpt", "MptForCausalLM", False, True, False, 0),
            Family("olmo", "olmo", "OlmoForCausalLM", True, False, False, None),
            Family("llama", "llama", "LlamaForCausalLM", True, False, False, None),
            Family("gpt3", "gpt2", "GPT2LMHeadModel", False, True, True, 0),
            Family("bart", "bart", "BartForConditionalGeneration", False, True, True, 1024),
            Family("bert", "bert", "BertForPreTraining", False, True, True, 512))

#: Shape numbers in the model text, in the spellings the data use; first pattern that matches wins.
FIELDS = {"hidden": (r"d_model[= ](\d+)", r"hidden (\d+)", r"(\d+) hidden"),
          "heads": (r"n_heads=(\d+)", r"(\d+) heads"),
          "ffn": (r"ffn[= ](\d+)",),
          "vocab": (r"padded to (\d+)", r"vocab[= ]~?(\d+)")}


class Skip(Exception):
    """A row the script cannot interpret; the message is the reason."""


@dataclass
class Case:
    id: str
    group: str
    metric: str
    value: float
    spec: ModelSpec
    gpu: GPU
    setup: dict              # keyword arguments of step_time
    assumed: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------- parsing

def find_int(text: str, patterns) -> int | None:
    for pattern in patterns:
        match = re.search(pattern, text, re.I)
        if match:
            return int(match.group(1))
    return None


def parse_layers(text: str) -> tuple[int, bool]:
    """(layers, encoder-decoder): `n_layers=32`, `32 layers`, `32L`, `12 enc + 12 dec layers`."""
    match = re.search(r"(\d+) enc \+ (\d+) dec", text)
    if match:
        return int(match.group(1)) + int(match.group(2)), True
    layers = find_int(text, (r"n_layers=(\d+)", r"(\d+)\s*layers")) or find_int(text, (r"(\d+)L\b",))
    if layers is None:
        raise Skip("model dims not published")
    return layers, False


def count_parameters(fam: Family, layers: int, hidden: int, kv_dim: int, ffn: int, vocab: int,
                     positions: int, enc_dec: bool) -> tuple[int, int]:
    """(total, embedding) parameters of a standard block stack, for rows that do not state NumParams."""
    bias = 1 if fam.biased else 0
    attn = 2 * hidden * hidden + 2 * hidden * kv_dim + bias * (2 * hidden + 2 * kv_dim)
    mlp = (3 if fam.gated else 2) * hidden * ffn + bias * (ffn + hidden)
    norm = (1 + bias) * hidden
    blocks = layers * (attn + mlp + 2 * norm)
    if enc_dec:  # decoder blocks add cross-attention
        blocks += layers // 2 * (attn + norm)
    embedding = (vocab + positions) * hidden
    head = 0 if fam.tied else vocab * hidden
    return blocks + embedding + head + norm, embedding


def parse_model(text: str, seq_len: int) -> ModelSpec:
    fam = next((f for f in FAMILIES if f.key in text.lower()), None)
    if fam is None:
        raise Skip("model family not recognised")
    layers, enc_dec = parse_layers(text)
    dims = {name: find_int(text, patterns) for name, patterns in FIELDS.items()}
    if None in dims.values():
        raise Skip("model dims not published")
    hidden, heads = dims["hidden"], dims["heads"]
    kv_heads = find_int(text, (r"/\s*(\d+)\s*KV",)) or heads
    positions = seq_len if fam.positions == 0 else (fam.positions or 0)
    params, embedding = count_parameters(fam, layers, hidden, kv_heads * hidden // heads, dims["ffn"],
                                         dims["vocab"], positions, enc_dec)
    params = find_int(text, (r"NumParams=(\d+)",)) or params
    architecture = "BertForQuestionAnswering" if "QuestionAnswering" in text else fam.architecture
    return ModelSpec(
        name=text.split(" (")[0].split(" - ")[0][:40], source="config", architecture=architecture,
        model_type=fam.model_type, parameters=params, trainable_parameters=params, layers=layers,
        hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=dims["ffn"], vocab=dims["vocab"],
        tied_embeddings=fam.tied, max_positions=positions or seq_len, seq_len=seq_len,
        is_encoder_decoder=enc_dec, gated_mlp=fam.gated, embedding_parameters=embedding,
        largest_layer_parameters=max(dims["vocab"] * hidden, hidden * dims["ffn"]),
        position="learned" if positions else "rope")


def map_gpu(text: str) -> GPU:
    name = text.upper()
    for prefix, catalog in (("H100", "H100-80GB"), ("V100", "V100-32GB")):
        if name.startswith(prefix):
            return lookup_gpu(catalog)
    if name.startswith("A100"):
        return lookup_gpu("A100-40GB" if "40G" in name else "A100-80GB")
    raise Skip(f"GPU {text!r} not mapped")


def map_precision(text: str) -> str:
    t = text.lower()
    if "fp8" in t:
        raise Skip("fp8 not modelled")
    if "tf32" in t:
        raise Skip("TF32 tensor cores not modelled (planner fp32 = FP32 pipes)")
    if "amp" in t:
        return "bf16-mixed" if "bf16" in t else "fp16-mixed"
    for precision in ("bf16-mixed", "fp16-mixed", "fp32"):
        if t.startswith(precision):
            return precision
    if t.startswith("bf16"):
        return "bf16-true"
    raise Skip(f"precision {text!r} not mapped")


def map_sharding(row: dict) -> int:
    s = row["sharding"].lower()
    if "context parallel" in s:
        raise Skip("context parallelism not modelled")
    if s.startswith("fsdp"):  # FULL_SHARD (and HSDP, approximated) = ZeRO-3; SHARD_GRAD_OP = ZeRO-2
        return 2 if "sharding_strategy=SHARD_GRAD_OP" in row["notes"] else 3
    if re.fullmatch(r"zero[0-3]", s):
        return int(s[-1])
    if s in ("ddp", "none"):
        return 0
    raise Skip(f"sharding {row['sharding']!r} not mapped")


def map_checkpointing(text: str) -> str:
    for mode in ("none", "full", "selective"):
        if text.lower().startswith(mode):
            return mode
    raise Skip("checkpointing not stated")


def map_batch(row: dict, world: int) -> tuple[int, int, list[str]]:
    """(micro_batch, grad_accum, assumptions)."""
    micro, accum, total = row["micro_batch"], row["grad_accum"], row["global_batch"]
    if micro is None:
        raise Skip("micro-batch not published")
    if accum is not None:
        return micro, accum, []
    if total is not None and total % (micro * world) == 0:
        return micro, total // (micro * world), ["grad_accum from global batch"]
    return micro, 1, ["grad_accum=1 assumed"]


def interpret(row: dict) -> Case:
    if row["gpus"] is None:
        raise Skip("GPU count not published")
    world = row["gpus"]
    per_node = world // row["nodes"] if row["nodes"] else min(world, 8)
    micro, accum, assumed = map_batch(row, world)
    setup = dict(micro_batch=micro, grad_accum=accum, seq_len=row["seq_len"],
                 precision=map_precision(row["precision"]), checkpointing=map_checkpointing(row["checkpointing"]),
                 zero_stage=map_sharding(row), offload="none", world_size=world, gpus_per_node=per_node,
                 attention="eager" if row["attention"].lower().startswith("eager") else "sdpa")
    group = next((g for prefix, g in GROUPS if row["id"].startswith(prefix)), "other")
    return Case(row["id"], group, row["metric"], float(row["value"]), parse_model(row["model"], row["seq_len"]),
                map_gpu(row["gpu"]), setup, assumed)


def load_cases(path: Path) -> tuple[list[Case], Counter, int]:
    rows = json.loads(path.read_text())["cases"]
    cases, skipped = [], Counter()
    for row in rows:
        try:
            cases.append(interpret(row))
        except Skip as reason:
            skipped[str(reason)] += 1
    return cases, skipped, len(rows)


# ------------------------------------------------------------------------------------------ evaluation

@contextmanager
def constants(values: dict):
    """Temporarily set planner.throughput's module constants; `RECOMPUTE_FULL` patches the dict entry."""
    values = dict(values)
    if "RECOMPUTE_FULL" in values:
        values["RECOMPUTE_FACTOR"] = {**T.RECOMPUTE_FACTOR, "full": values.pop("RECOMPUTE_FULL")}
    old = {name: getattr(T, name) for name in values}
    try:
        for name, value in values.items():
            setattr(T, name, value)
        yield
    finally:
        for name, value in old.items():
            setattr(T, name, value)


def predict(case: Case) -> float:
    setup = dict(case.setup)
    seq_len, per_node = setup.pop("seq_len"), setup.pop("gpus_per_node")
    tp = T.step_time(case.spec, case.gpu, Config(**setup), seq_len=seq_len, gpus_per_node=per_node)
    if case.metric == "tokens_per_s_per_gpu":
        return tp.tokens_per_s / case.setup["world_size"]
    if case.metric == "samples_per_s_total":
        return tp.samples_per_s
    if case.metric == "mfu":
        return tp.mfu * 100
    raise ValueError(case.metric)


def log_ratios(cases: list[Case], values: dict | None = None) -> list[float]:
    with constants(values or {}):
        return [math.log(predict(c) / c.value) for c in cases]


def weighted_median(xs: list[float], weights: list[float] | None = None) -> float:
    weights = weights or [1.0] * len(xs)
    pairs = sorted(zip(xs, weights))
    half, acc = sum(weights) / 2, 0.0
    for x, w in pairs:
        acc += w
        if acc >= half:
            return x
    return pairs[-1][0]


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return (s[(n - 1) // 2] + s[n // 2]) / 2 if n else float("nan")


# --------------------------------------------------------------------------------------------- reports

def stats_line(label: str, logs: list[float], extra: str = "", width: int = 24) -> str:
    return (f"  {label:<{width}} {len(logs):>4}  {math.exp(median(logs)):>7.3f}  "
            f"{median([abs(x) for x in logs]):>7.3f}  {extra}").rstrip()


def report_groups(title: str, cases: list[Case], logs: list[float], worst: int) -> None:
    print(f"\n{title}\n  {'group':<24} {'n':>4}  {'med r':>7}  {'med|lg|':>7}  worst (pred/published)")
    by_group = defaultdict(list)
    for case, x in zip(cases, logs):
        by_group[case.group].append((case.id, x))
    for group, items in sorted(by_group.items(), key=lambda kv: -len(kv[1])):
        bad = sorted(items, key=lambda item: -abs(item[1]))[:worst]
        extra = ", ".join(f"{cid} x{math.exp(x):.2f}" for cid, x in bad)
        print(stats_line(group, [x for _, x in items], extra))
    print(stats_line("ALL", logs, f"(r = pred/published; {sum(abs(x) < math.log(1.25) for x in logs)}"
                                  f"/{len(logs)} within 25%)"))


def bucket(value: float, edges: tuple, labels: tuple) -> str:
    """labels[i] for the first edge value lies below; the last label past all edges."""
    return next((label for edge, label in zip(edges, labels) if value < edge), labels[-1])


def scale(case: Case) -> str:
    nodes = "1 node" if case.setup["world_size"] <= case.setup["gpus_per_node"] else "multi-node"
    return f"zero{case.setup['zero_stage']} {nodes}"


#: Slices of the data in which a systematic misfit points at the model's structure rather than its constants.
BREAKDOWNS = {
    "gpu": lambda c: c.gpu.name,
    "precision": lambda c: c.setup["precision"],
    "checkpointing": lambda c: c.setup["checkpointing"],
    "model size": lambda c: bucket(c.spec.parameters / 1e9, (0.5, 3, 15), ("<0.5B", "0.5-3B", "3-15B", ">15B")),
    "seq_len": lambda c: bucket(c.setup["seq_len"], (2049, 8193), ("<=2k", "4k-8k", ">=16k")),
    "tokens/micro": lambda c: bucket(c.setup["micro_batch"] * c.setup["seq_len"], (8192, 32768),
                                     ("<8k", "8k-32k", ">=32k")),
    "zero x scale": scale,
    "metric": lambda c: c.metric,
}


def report_breakdowns(cases: list[Case], logs: list[float]) -> None:
    print(f"\n  {'breakdown':<32} {'n':>4}  {'med r':>7}  {'med|lg|':>7}")
    for name, key in BREAKDOWNS.items():
        buckets = defaultdict(list)
        for case, x in zip(cases, logs):
            buckets[key(case)].append(x)
        for value, xs in sorted(buckets.items()):
            print(stats_line(f"{name}={value}", xs, width=32))


# ------------------------------------------------------------------------------------------------- fit

def fit_space(cases: list[Case]) -> dict[str, tuple[float, float, float]]:
    """name -> (start, low, high); searched in log space."""
    space = {"EFFICIENCY_CEILING_A": (T.EFFICIENCY_CEILING_A, 0.3, 3.0),
             "EFFICIENCY_CEILING_B": (T.EFFICIENCY_CEILING_B, 0.0002, 0.02),
             "EFFICIENCY_HALF_TOKENS": (float(T.EFFICIENCY_HALF_TOKENS), 8.0, 65536.0),
             "EFFICIENCY_HALF_HIDDEN": (float(T.EFFICIENCY_HALF_HIDDEN), 8.0, 16384.0),
             "RECOMPUTE_FULL": (T.RECOMPUTE_FACTOR["full"], 1.0, 2.0)}
    if any(c.setup["precision"] == "fp32" for c in cases):
        space["FP32_EFFICIENCY_BOOST"] = (T.FP32_EFFICIENCY_BOOST, 0.3, 6.0)
    return space


def objective(cases: list[Case], weights: list[float], values: dict) -> float:
    """Weighted median |log ratio|, plus a small mean term that breaks the median's flat ties."""
    errors = [abs(x) for x in log_ratios(cases, {**values, "HF_CODE_FACTOR": 1.0})]
    mean = sum(w * e for w, e in zip(weights, errors)) / sum(weights)
    return weighted_median(errors, weights) + 0.02 * mean


GRID = {"EFFICIENCY_CEILING_A": (0.6, 0.8, 1.0, 1.3),
        "EFFICIENCY_CEILING_B": (0.001, 0.002, 0.004, 0.008),
        "EFFICIENCY_HALF_TOKENS": (16.0, 64.0, 256.0, 1024.0, 4096.0),
        "EFFICIENCY_HALF_HIDDEN": (16.0, 64.0, 256.0, 512.0, 1024.0, 2048.0),
        "RECOMPUTE_FULL": (1.0, 1.15, 4.0 / 3.0, 1.5)}


def coarse_grid(cases, weights, space, keep: int = 3) -> list[dict]:
    """The `keep` best points of GRID (other constants at their start values), best first."""
    start = {name: s for name, (s, _, _) in space.items()}
    scored = []
    for point in itertools.product(*GRID.values()):
        values = {**start, **dict(zip(GRID, point))}
        scored.append((objective(cases, weights, values), len(scored), values))
    return [values for _, _, values in sorted(scored)[:keep]]


def pattern_search(cases, weights, space, values: dict, deadline: float) -> tuple[float, dict]:
    """Coordinate search in log space, halving the step when no move helps."""
    best_value, step = objective(cases, weights, values), math.log(2.0)
    while step > 0.002 and time.monotonic() < deadline:
        improved = False
        for name, (_, low, high) in space.items():
            for sign in (1, -1):
                trial = {**values, name: min(high, max(low, values[name] * math.exp(sign * step)))}
                value = objective(cases, weights, trial)
                if value < best_value - 1e-9:
                    values, best_value, improved = trial, value, True
                    break
        if not improved:
            step /= 2
    return best_value, values


def fit(cases: list[Case], weights: list[float], budget_s: float = 90.0) -> dict:
    """Grid over the efficiency curve and recompute factor, then pattern search from the best 3 points."""
    space = fit_space(cases)
    deadline = time.monotonic() + budget_s
    results = [pattern_search(cases, weights, space, start, deadline)
               for start in coarse_grid(cases, weights, space)]
    return {**min(results, key=lambda r: r[0])[1], "HF_CODE_FACTOR": 1.0}


def group_weights(cases: list[Case], balance: bool) -> list[float]:
    sizes = Counter(c.group for c in cases)
    return [1.0 / sizes[c.group] if balance else 1.0 for c in cases]


def report_fit(cases: list[Case], weights: list[float], values: dict) -> None:
    """The fitted values, each with the objective when it alone moves x1.25 and /1.25 (flat = unconstrained)."""
    def score(trial):
        return weighted_median([abs(x) for x in log_ratios(cases, trial)], weights)
    base = score(values)
    print(f"  {'constant':<24}   {'value':>8}   med|lg| at x1.25 / at /1.25 (fit: {base:.4f})")
    for name, value in values.items():
        if name == "HF_CODE_FACTOR":
            continue
        up, down = score({**values, name: value * 1.25}), score({**values, name: value / 1.25})
        print(f"  {name:<24} = {value:>8.4g}   {up:.4f} / {down:.4f}")


# ------------------------------------------------------------------------------------------------ main

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA, help=f"calibration JSON (default {DATA})")
    parser.add_argument("--fit", action="store_true", help="fit the efficiency constants (HF_CODE_FACTOR = 1)")
    parser.add_argument("--balance", action="store_true", help="fit with every source group weighted equally")
    parser.add_argument("--worst", type=int, default=2, help="worst cases listed per group")
    return parser.parse_args()


def report_skips(skipped: Counter, used: int, total: int) -> None:
    print(f"{total} rows: {used} interpreted, {sum(skipped.values())} skipped")
    for reason, count in skipped.most_common():
        print(f"  skipped {count:>3}: {reason}")


def main() -> None:
    args = parse_args()
    cases, skipped, total = load_cases(args.data)
    print(f"data: {args.data}")
    report_skips(skipped, len(cases), total)
    assumed = Counter(a for c in cases for a in c.assumed)
    for note, count in assumed.items():
        print(f"  assumed {count:>3}: {note}")
    report_groups(f"As shipped (HF_CODE_FACTOR={T.HF_CODE_FACTOR})", cases, log_ratios(cases), args.worst)
    shape = log_ratios(cases, {"HF_CODE_FACTOR": 1.0})
    report_groups("Shape fit (HF_CODE_FACTOR=1.0, other constants as shipped)", cases, shape, args.worst)
    if not args.fit:
        report_breakdowns(cases, shape)
        return
    started, weights = time.monotonic(), group_weights(cases, args.balance)
    values = fit(cases, weights)
    print(f"\nFitted in {time.monotonic() - started:.0f} s ({'group-balanced' if args.balance else 'per-row'} "
          f"median |log ratio|, HF_CODE_FACTOR held at 1.0):")
    report_fit(cases, weights, values)
    fitted = log_ratios(cases, values)
    report_groups("Fitted constants (HF_CODE_FACTOR=1.0)", cases, fitted, args.worst)
    report_breakdowns(cases, fitted)


if __name__ == "__main__":
    main()
