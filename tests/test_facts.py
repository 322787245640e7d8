"""planner.facts: every fact well formed, every `fitted_to` naming something the benchmarks judge, recording what a
prediction read (cached or not), and the provenance helpers benchmarks use to call a row in-sample."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest
import transformers

from planner import estimate_memory, facts
from planner.hardware import efficiency_data, lookup_gpu

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data"


def rows(path: Path) -> list[dict]:
    """Every row of a benchmarks/data file: the dicts in its top-level lists."""
    data = json.loads(path.read_text())
    return [r for v in data.values() if isinstance(v, list) for r in v if isinstance(r, dict)]


def judged_names() -> tuple[set[str], set[str]]:
    """("<file>#<row id>" and "<file>#*" of every data file; the source key of every row, and of the GEMM table
    tests/test_throughput.py judges the GEMM shape model against)."""
    names, sources = set(), set()
    for path in sorted(DATA.glob("*.json")):
        names.add(f"{path.name}#*")
        for row in rows(path):
            names |= {f"{path.name}#{row['id']}"} if "id" in row else set()
            sources |= {facts.source_key(row["source"])} if row.get("source") else set()
    table = efficiency_data.efficiency_json()["gpus"]["H100-80GB"]["shape_table_xla_sm90"]
    return names, sources | {facts.source_key(table["source"])}


def test_every_fact_holds_a_value_unit_source_and_provenance_of_the_right_types():
    found = facts.all_facts()
    assert len(found) > 250 and any(k.startswith("efficiency:") for k in found)
    for key, fact in found.items():
        assert fact.key == key
        assert isinstance(fact.value, (int, float, str, tuple, Mapping)) and not isinstance(fact.value, bool), key
        assert isinstance(fact.unit, str) and fact.unit.strip(), key
        assert isinstance(fact.source, str) and len(fact.source) > 10, key
        assert fact.measured_on is None or (isinstance(fact.measured_on, str) and fact.measured_on.strip()), key
        assert isinstance(fact.fitted_to, tuple) and all(isinstance(f, str) and f for f in fact.fitted_to), key
        assert fact.note is None or (isinstance(fact.note, str) and "\n" not in fact.note and len(fact.note) < 320), key


def test_every_fitted_to_names_a_judged_row_file_or_source():
    names, sources = judged_names()
    for key, fact in facts.all_facts().items():
        for target in fact.fitted_to:
            assert target in (names if "#" in target else sources), f"{key}: {target!r} names nothing judged"


def test_what_the_brief_says_was_fitted_says_so():
    assert facts.fact("memory.activation_margin").fitted_to == ("published_memory.json#*",)
    for key in ("cuda.step_modules_bytes", "cuda.blas_threads", "allocator.workspace_placement",
                "efficiency:H100-80GB:misaligned", "efficiency:defaults:misaligned_align2"):
        # the rows and their source: trainplan's GPU validation on the lent H100 (a new run there is in-sample too)
        assert facts.fact(key).fitted_to == ("gpu_measured_h100.json#*", "trainplan:gpu_validation-H100-80GB"), key
    for gpu in ("H200-141GB", "B200-192GB", "V100-16GB", "T4-16GB", "MI300X-192GB", "H100-PCIe-80GB"):
        assert "github:stas00/ml-engineering" in facts.fact(f"efficiency:{gpu}:attention").fitted_to, gpu
    assert facts.fact("inductor.compiled_device_residual").fitted_to == (
        "hf_throughput.json#mle-compile-b200-llama8b-fwdbwd", "hf_throughput.json#mle-compile-b200-llama8b-fwdbwd-compiled")
    # micro-benchmarks on the lent H100 are measurements, fitted to no judged row
    dispatch = facts.fact("efficiency:H100-80GB:dispatch_us")
    assert dispatch.fitted_to == () and "H100" in dispatch.measured_on


def test_every_packaged_fact_is_read_by_the_code():
    code = "\n".join(p.read_text() for p in (ROOT / "planner").rglob("*.py"))
    packaged = {key for key in facts.all_facts() if not key.startswith("efficiency:")}
    assert [key for key in sorted(packaged) if f'"{key}"' not in code] == []


def test_an_unknown_key_names_close_matches():
    with pytest.raises(KeyError, match="gemm.k_half"):
        facts.get("gemm.khalf")


def test_recording_nests_and_overriding_is_read_at_use_time():
    from planner.memory.gpu import cuda_context_bytes

    h100 = lookup_gpu("H100-80GB")
    with facts.recording() as outer:
        with facts.recording() as inner:
            before = cuda_context_bytes(h100)
        with facts.overriding({"cuda.step_modules_bytes": 0}):
            bare = cuda_context_bytes(h100)
    assert inner == {"cuda.bare_context_bytes", "cuda.step_modules_bytes"} <= outer
    assert before - bare == facts.get("cuda.step_modules_bytes") and cuda_context_bytes(h100) == before
    with pytest.raises(KeyError):
        with facts.overriding({"efficiency:H100-80GB:hbm": 0.5}):
            pass


def _read(predict) -> set[str]:
    with facts.recording() as used:
        predict()
    return used


def test_a_memory_estimate_records_what_it_read_every_time():
    def predict():
        return estimate_memory("gpt2", micro_batch=1, seq_len=128, gpu="H100-80GB", method="analytic")

    first, second = _read(predict), _read(predict)
    assert first == second
    assert {"cuda.bare_context_bytes", "cuda.step_modules_bytes", "cublas.workspace_bytes", "cuda.blas_threads",
            "memory.activation_margin", "memory.analytic_slack_fraction"} <= first
    assert "ddp.bucket_cap_bytes" not in first and not any(k.startswith("nccl.") for k in first)  # one GPU


def _tiny_gpt2():
    from planner.models import resolve_model

    return resolve_model(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=256,
                                                 architectures=["GPT2LMHeadModel"]))


def test_a_cached_whole_run_and_speed_prediction_still_record_their_facts():
    from planner.config import Config
    from planner.memory.estimate import Evaluation
    from planner.speed.model import SpeedModel

    gpu = lookup_gpu("H100-80GB")
    evaluation = Evaluation(_tiny_gpt2(), seq_len=128, optimizer="adamw", gpu=gpu, gpus_per_node=1)
    cfg = Config.of(micro_batch=2, grad_accum=1, world_size=1, precision="bf16-mixed", checkpointing="none",
                    zero_stage=0, offload="none")
    first, second = (_read(lambda: evaluation.estimate(cfg, "trace")) for _ in range(2))
    assert first == second and {"allocator.workspace_placement", "cuda.blas_threads"} <= first
    speed = SpeedModel(evaluation.workload, gpu, 1)
    first, second = (_read(lambda: speed(cfg)) for _ in range(2))
    assert first == second
    assert {"efficiency:H100-80GB:attention", "efficiency:H100-80GB:matmul.bf16", "efficiency:H100-80GB:hbm",
            "gemm.k_half", "gemm.latency_s"} <= first


def test_in_sample_by_matches_a_row_its_file_or_its_source(monkeypatch):
    made = {key: facts.Fact(key=key, value=1, unit="count", source="hand-made", measured_on=None, fitted_to=fitted)
            for key, fitted in (("test:row", ("a.json#r1",)), ("test:file", ("a.json#*",)),
                                ("test:source", ("github:owner/repo",)), ("test:none", ()))}
    monkeypatch.setitem(facts._PROVIDERS, "test:", lambda: made)
    keys = list(made)
    assert facts.in_sample_by(keys, "a.json", "r1", "https://example.org/x") == ["test:file", "test:row"]
    assert facts.in_sample_by(keys, "a.json", "r2", "Owner/Repo@abc:README.md (table)") == [
        "test:file", "test:source"]
    assert facts.in_sample_by(keys, "b.json", "r1", "https://github.com/owner/repo/issues/1") == ["test:source"]
    assert facts.in_sample_by(keys, "b.json", "r1", None) == []


def test_in_sample_by_on_the_published_rows():
    residual = ["inductor.compiled_device_residual", "efficiency:H200-141GB:attention", "cuda.blas_threads"]
    mle = "stas00/ml-engineering@744d01e18b79512572f64a6bbd8b5f4a725203a7:training/performance/README.md"
    assert facts.in_sample_by(residual, "hf_throughput.json", "mle-compile-b200-llama8b-fwdbwd-compiled", mle) == [
        "efficiency:H200-141GB:attention", "inductor.compiled_device_residual"]
    assert facts.in_sample_by(residual, "hf_throughput.json", "tfdocs-bert-a100-sdpa-b4-s256",
                              "huggingface/transformers docs/source/en/model_doc/bert.md") == []


@pytest.mark.parametrize("source,key", [
    ("stas00/ml-engineering@744d01e:insights/when-to-upgrade-gpus/README.md (table)", "github:stas00/ml-engineering"),
    ("https://github.com/huggingface/transformers/issues/15026 (stas00, comment)", "github:huggingface/transformers"),
    ("huggingface/transformers docs/source/en/model_doc/bert.md, section 'SDPA'", "github:huggingface/transformers"),
    ("github:NVIDIA/DeepLearningExamples PyTorch/LanguageModeling/BERT/README.md @7299",
     "github:nvidia/deeplearningexamples"),
    ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md", "github:pytorch/torchtitan"),
    ("Lightning-AI/litgpt@2685705:tutorials/resource-tables.md#L41 (added in ...)", "github:lightning-ai/litgpt"),
    ("https://huggingface.co/docs/transformers/v4.56.2/en/model_doc/gpt_neox (SDPA section)", "url:huggingface.co"),
    ("benchmarks/results/gpu_validation-H100-80GB-2026-11-23-matrix-14_32.json (python3 benchmarks/gpu_validation.py)",
     "trainplan:gpu_validation-H100-80GB"),
    ("ZeRO paper arXiv 1910.02054 Fig. 1 (model states only, computed not measured)", "url:arxiv.org"),
    ("same", "text:same"),
])
def test_source_key_normalises_the_sources_of_benchmarks_data(source, key):
    assert facts.source_key(source) == key


def test_every_row_source_normalises_to_a_repository_site_or_results_file():
    """Only memory_calibration.json's "same" (the row above's source) is left as text."""
    texts = {facts.source_key(r["source"]) for p in DATA.glob("*.json") for r in rows(p) if r.get("source")}
    assert {k for k in texts if k.startswith("text:")} <= {"text:same"}
