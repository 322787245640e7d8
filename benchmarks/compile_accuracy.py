"""torch.compile as the planner models it, against the published measurements of compiled HF training steps.

    HF_HUB_OFFLINE=1 python benchmarks/compile_accuracy.py [--out benchmarks/results/compile_accuracy.json]

Rows: benchmarks/data/hf_throughput.json, the eager/compiled pairs (`compile` true/false, same configuration) and
the cold first-step compile times (`compile_time`). For each pair: the modelled eager and compiled step against the
published ones, and the modelled speed-up against the published one. `inductor.compile_seconds_per_op` is derived
from the two compile-time rows and `inductor.compiled_device_residual` from the Llama-3.1-8B forward+backward pair
(planner/facts/compile.json, whose `fitted_to` names them): those rows are in-sample, and are marked so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import throughput_accuracy as ta  # noqa: E402 - the same row interpretation and prediction

from planner.hardware import lookup_gpu  # noqa: E402
from planner.memory.estimate import Evaluation  # noqa: E402

IN_SAMPLE = {"mle-compile-b200-llama8b-fwdbwd", "mle-compile-b200-llama8b-fwdbwd-compiled",
             "mle-compile-cold-1b", "mle-compile-cold-8b"}


def pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    by_id = {r["id"]: r for r in rows}
    return [(by_id[r["id"].removesuffix("-compiled")], r) for r in rows
            if r.get("compile") and r["id"].endswith("-compiled") and r["id"].removesuffix("-compiled") in by_id]


def predict_pair(eager_row: dict, compiled_row: dict, models: dict, speed_models: dict) -> dict:
    eager = ta.interpret(eager_row, "hf", models)
    compiled = ta.interpret(compiled_row, "hf", models)
    eager.predicted, compiled.predicted = ta._predict(eager, speed_models), ta._predict(compiled, speed_models)
    return {"id": compiled_row["id"], "eager_published_s": eager.value, "eager_modelled_s": eager.predicted,
            "compiled_published_s": compiled.value, "compiled_modelled_s": compiled.predicted,
            "compiled_error": compiled.predicted / compiled.value - 1,
            "speedup_published": eager.value / compiled.value, "speedup_modelled": eager.predicted / compiled.predicted,
            "in_sample": compiled_row["id"] in IN_SAMPLE}


def predict_compile_time(row: dict) -> dict:
    resolved = ta.hf_model(row)
    gpu = lookup_gpu(ta.map_gpu(row["gpu"]))
    evaluation = Evaluation(resolved, seq_len=row["seq_len"], optimizer="adamw", attention="sdpa", gpu=gpu)
    cfg = ta.Config.of(micro_batch=row["micro_batch"], grad_accum=1, world_size=1, precision="bf16-true",
                       checkpointing="none", zero_stage=0, offload="none", compiled=True)
    effect = evaluation.workload.compile_effect(cfg)
    modelled = effect.compile_seconds(resolved.spec.layers)
    return {"id": row["id"], "published_s": row["value"], "modelled_s": modelled,
            "error": modelled / row["value"] - 1, "in_sample": row["id"] in IN_SAMPLE}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    data = json.loads((ta.DATA / "hf_throughput.json").read_text())
    models, speed_models = {}, {}
    steps = [predict_pair(e, c, models, speed_models) for e, c in pairs(data["rows"])]
    cold = [predict_compile_time(row) for row in data.get("compile_time", [])]
    for r in steps:
        print(f"{r['id']:45s} eager {r['eager_modelled_s'] * 1e3:7.1f} ms "
              f"(published {r['eager_published_s'] * 1e3:7.1f})"
              f"  compiled {r['compiled_modelled_s'] * 1e3:7.1f} ms (published {r['compiled_published_s'] * 1e3:7.1f},"
              f" {r['compiled_error']:+.1%})  speed-up {r['speedup_modelled']:.2f}x (published "
              f"{r['speedup_published']:.2f}x){'  [in-sample]' if r['in_sample'] else ''}")
    for r in cold:
        print(f"{r['id']:45s} compile {r['modelled_s']:5.1f} s (published {r['published_s']:.0f} s, {r['error']:+.1%})"
              f"{'  [in-sample]' if r['in_sample'] else ''}")
    if args.out:
        args.out.write_text(json.dumps({"steps": steps, "compile_time": cold}, indent=1) + "\n")


if __name__ == "__main__":
    main()
