"""torch.compile as the planner models it, against the published measurements of compiled HF training steps.

    HF_HUB_OFFLINE=1 python benchmarks/compile_accuracy.py

Rows: benchmarks/data/hf_throughput.json, the eager/compiled pairs (`compile` true/false, same configuration) and
the cold first-step compile times (`compile_time`). For each pair: the modelled eager and compiled step against the
published ones, and the modelled speed-up (eager / compiled step time) against the published one
(benchmarks/results/compile_accuracy.json); for each cold step, the modelled compile time against the published one
(benchmarks/results/compile_time_accuracy.json). Both in benchmarks/evidence.py's format.

Whether a row is in-sample is computed, never listed: its prediction runs inside `planner.facts.recording()` and
`planner.facts.in_sample_by` names the facts fitted to it or its source (for a speed-up, to either row of its pair):
`inductor.compiled_device_residual` and `inductor.compile_seconds_per_op` name the rows they were derived from.
throughput_accuracy.py's leave-one-source-out folds predict each row again without any fact fitted to its source;
where a fact has no value without it (the compile seconds per op: no other source timed a cold compile), a row whose
prediction depends on it has none in its fold, and the report says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: the repository's packages import without an install
    sys.path.insert(0, str(REPO))

from benchmarks import evidence  # noqa: E402
from benchmarks import throughput_accuracy as ta  # noqa: E402 - the same row interpretation, prediction and folds
from planner import facts  # noqa: E402
from planner.hardware import lookup_gpu  # noqa: E402
from planner.memory.estimate import Evaluation  # noqa: E402

COMMAND = "HF_HUB_OFFLINE=1 python benchmarks/compile_accuracy.py"
STACK = "trainplan's speed model with its torch.compile model (planner/program/compiled.py, planner/speed/step.py)"


def pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    by_id = {r["id"]: r for r in rows}
    return [(by_id[r["id"].removesuffix("-compiled")], r) for r in rows
            if r.get("compile") and r["id"].endswith("-compiled") and r["id"].removesuffix("-compiled") in by_id]


def speedup_row(eager: ta.Case, compiled: ta.Case, speed_models: dict, fold: ta.Fold | None = None) -> evidence.Row:
    """The modelled speed-up of a pair against the published one, in-sample where a fact was fitted to either row."""
    return ta.judged_row(
        id=compiled.id, data_file=compiled.data_file, source=compiled.source, measured=eager.value / compiled.value,
        predict=lambda: ta.predict_step(eager, speed_models, fold) / ta.predict_step(compiled, speed_models, fold),
        group=compiled.group, fold=fold, also=[(eager.id, eager.source)])


def predict_pair(eager_row: dict, compiled_row: dict, models: dict, speed_models: dict,
                 folds: dict[str, ta.Fold]) -> tuple[evidence.Row, evidence.Row | None, dict]:
    """The pair's speed-up row, its leave-one-source-out row (None: no prediction without the source) and the
    steps' detail."""
    eager = ta.interpret(eager_row, "hf", models)
    compiled = ta.interpret(compiled_row, "hf", models)
    row = speedup_row(eager, compiled, speed_models)
    fold = folds.get(compiled.source_key)
    loso = row if fold is None else ta.in_fold(fold, lambda f: speedup_row(eager, compiled, speed_models, f))
    eager_s, compiled_s = ta.predict_step(eager, speed_models), ta.predict_step(compiled, speed_models)
    detail = {"id": compiled.id, "eager_published_s": eager.value, "eager_modelled_s": eager_s,
              "compiled_published_s": compiled.value, "compiled_modelled_s": compiled_s,
              "compiled_error": compiled_s / compiled.value - 1}
    return row, loso, detail


def compile_time_row(row: dict, fold: ta.Fold | None = None) -> evidence.Row:
    """The modelled cold compile time of a row's first compiled step against the published one."""
    def predict() -> float:
        resolved = ta.hf_model(row)
        gpu = lookup_gpu(ta.map_gpu(row["gpu"]))
        evaluation = Evaluation(resolved, seq_len=row["seq_len"], optimizer="adamw", attention="sdpa", gpu=gpu)
        with facts.overriding(fold.overrides if fold else {}):
            return evaluation.workload.compile_effect(config(row)).compile_seconds(resolved.spec.layers)

    cfg = config(row)
    return ta.judged_row(id=row["id"], data_file=ta.HF_FILE, source=row["source"], measured=row["value"],
                         predict=predict, fold=fold,
                         group=evidence.run_group(ta.HF_LOOP, ta.map_gpu(row["gpu"]), cfg))


def config(row: dict) -> ta.Config:
    return ta.Config.of(micro_batch=row["micro_batch"], grad_accum=1, world_size=1, precision="bf16-true",
                        checkpointing="none", zero_stage=0, offload="none", compiled=True)


def write(name: str, rows: list[evidence.Row], loso: dict[str, evidence.Row | None], metric: str,
          cannot_show: str, extra: dict) -> Path:
    path = evidence.write_results(name, rows, kind="other", metric=metric, stack=STACK, cannot_show=cannot_show,
                                  command=COMMAND)
    record = json.loads(path.read_text())
    judged = [r for r in loso.values() if r is not None]
    record["leave_one_source_out"] = {
        "summary": evidence.summary(r for r in judged if not r.in_sample),
        "no_prediction": sorted(k for k, r in loso.items() if r is None),
        "rows": [r.to_json() for r in judged if all(r is not x for x in rows)]}
    record.update(extra)
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return path


def sample_text(rows: list[evidence.Row], loso: dict[str, evidence.Row | None]) -> str:
    """The counts, computed: in-sample rows and by what, and what their folds give."""
    in_rows = [r for r in rows if r.in_sample]
    keys = sorted({k for r in in_rows for k in r.in_sample_by})
    honest = [loso[r.id] for r in in_rows if loso.get(r.id) is not None and not loso[r.id].in_sample]
    text = f"{len(in_rows)} of {len(rows)} rows are in-sample" + (f" (by {', '.join(keys)})" if keys else "") + "; "
    if not in_rows:
        return text
    if not honest:
        return text + "none of them has a prediction without its source (results key leave_one_source_out)."
    s = evidence.summary(honest)
    return text + (f"predicted again without any fact fitted to their source, {len(honest)} of them miss by median "
                   f"{s['median_abs']:.1%} (worst {s['worst_abs']:.1%}).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    data = json.loads((ta.DATA / ta.HF_FILE).read_text())
    folds = ta.make_folds()
    models, speed_models = {}, {}
    steps, loso, details = [], {}, []
    for eager_row, compiled_row in pairs(data["rows"]):
        row, loso[row.id], detail = predict_pair(eager_row, compiled_row, models, speed_models, folds)
        steps.append(row)
        details.append(detail)
    cold, cold_loso = [], {}
    for entry in data.get("compile_time", []):
        row = compile_time_row(entry)
        fold = folds.get(facts.source_key(entry["source"]))
        cold.append(row)
        cold_loso[row.id] = row if fold is None else ta.in_fold(fold, lambda f, e=entry: compile_time_row(e, f))

    def flag(row: evidence.Row, fold_row: evidence.Row | None) -> str:
        fold_text = "none" if fold_row is None else f"{fold_row.predicted:.2f} ({fold_row.error:+.1%})"
        return (f"  [in-sample by {', '.join(row.in_sample_by)}; without its source: {fold_text}]"
                if row.in_sample else f"  [no fact fitted to it among the {len(row.facts_used)} used]")

    for row, d in zip(steps, details):
        print(f"{row.id:45s} eager {d['eager_modelled_s'] * 1e3:7.1f} ms "
              f"(published {d['eager_published_s'] * 1e3:7.1f})  compiled {d['compiled_modelled_s'] * 1e3:7.1f} ms "
              f"(published {d['compiled_published_s'] * 1e3:7.1f},"
              f" {d['compiled_error']:+.1%})  speed-up {row.predicted:.2f}x (published {row.measured:.2f}x)"
              + flag(row, loso[row.id]))
    for row in cold:
        print(f"{row.id:45s} compile {row.predicted:5.1f} s (published {row.measured:.0f} s, {row.error:+.1%})"
              + flag(row, cold_loso[row.id]))
    print(f"speed-ups: {sample_text(steps, loso)}\ncompile times: {sample_text(cold, cold_loso)}")
    write("compile_accuracy", steps, loso,
          "torch.compile speed-up: eager / compiled step time of the same configuration, modelled vs published",
          "One source (stas00/ml-engineering, one B200) published every pair; a compiled step of another GPU or "
          f"host is not judged. {sample_text(steps, loso)}", {"steps": details})
    write("compile_time_accuracy", cold, cold_loso,
          "cold first compiled step's compile time (s), modelled vs published",
          "Compile time is a host-CPU cost; the published times are one host's, with a fresh Inductor cache. "
          + sample_text(cold, cold_loso), {})


if __name__ == "__main__":
    main()
