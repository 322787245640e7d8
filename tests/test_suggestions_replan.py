"""Advice that works: every flag set trainplan prints, given back to `plan`, fits or gets past what it answers.

A zoo of requests that fit nowhere (pinned precision and checkpointing, fp8, split sequences, contexts of 131k and 1M
tokens) re-plans every suggestion; a zoo of refused requests re-plans every error's hint; notes that offer flags
re-plan them; install hints name pyproject.toml's extras. Another GPU is sought among the user's kind first; adapters
come before a suggestion of hundreds of GPUs; a dataset's rows are shortened with --max-length; advice for long
sequences is computed with the split the plan would use or the user pinned."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from planner import NoFitError, PlanRequest
from planner.errors import InputError
from planner.hardware import lookup_gpu
from planner.planning import plan_request
from planner.render import note_text, suggestion_text
from planner.request import as_flags, flag_of
from planner.vocab import PACKAGE

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
LLAMA_8B = "meta-llama/Llama-3.1-8B"
LONG = dict(model=LLAMA_8B, global_batch=8, seq_len=131072, gpu="H100-80GB", gpus_per_node=8)

#: requests that fit nowhere, each a kind of pin or sequence the advice must keep
REQUESTS = {
    "8b-on-l40s": dict(model=LLAMA_8B, global_batch=256, gpu="L40S-48GB"),
    "70b-on-a-4090": dict(model="meta-llama/Llama-3.1-70B", global_batch=64, gpu="RTX4090-24GB"),
    "8b-no-checkpointing-on-l40s": dict(model=LLAMA_8B, global_batch=8, gpu="L40S-48GB", checkpointing="none"),
    "8b-zero-2-on-two-l40s": dict(model=LLAMA_8B, global_batch=8, gpu="L40S-48GB", gpus_per_node=2, zero_stage=2,
                                  host_memory=64 * 10**9),
    "8b-fp32-on-two-t4s": dict(model=LLAMA_8B, global_batch=8, gpu="T4-16GB", gpus_per_node=2, precision="fp32"),
    "70b-fp8-without-offload": dict(model="meta-llama/Llama-3.1-70B", global_batch=8, gpu="H100-80GB",
                                    precision="fp8", offload="none"),
    "131k-ring-4-pinned": dict(LONG, context_parallel="4"),
    "131k-splits-off": dict(LONG, context_parallel="off", sequence_parallel="off"),
}


def _levers(fields: dict):
    request = PlanRequest.of(**fields)
    with pytest.raises(NoFitError) as info:
        plan_request(request, detect=False)
    return request, info.value.levers


def _re_planned_fits(request: PlanRequest, levers) -> None:
    actionable = [lv for lv in levers if lv.changes]
    assert actionable, [lv.kind for lv in levers]
    for lv in actionable:
        replanned = plan_request(request.model_copy(update=lv.changes), detect=False)
        assert replanned.choice.fits, (lv.kind, lv.changes)
        assert suggestion_text(lv).endswith(f"({as_flags(lv.changes)})."), suggestion_text(lv)


@pytest.mark.parametrize("name", REQUESTS)
@pytest.mark.long
def test_every_suggestion_re_planned_fits(name):
    _re_planned_fits(*_levers(REQUESTS[name]))


@pytest.mark.long
def test_advice_for_a_pinned_ring_keeps_its_split_and_offers_a_wider_one():
    """With ring attention pinned at 4 GPUs at 131k tokens, what the smallest configuration needs, offload and a shorter
    sequence are all computed with each sequence split 4 ways; splitting 8 ways fits."""
    _, levers = _levers(REQUESTS["131k-ring-4-pinned"])
    by_kind = {lv.kind: lv for lv in levers}
    for kind in ("smallest", "offload-short", "shorter-sequence"):
        assert (by_kind[kind]["ways"], by_kind[kind]["by"]) == (4, "context"), kind
    assert by_kind["shorter-sequence"]["seq_len"] > 65536  # a quarter of the sequence per GPU, not all of it
    wider = by_kind["split"]
    assert wider["ways"] == 8 and wider["peak"] <= wider["budget"]
    assert "each sequence split 4 ways (ring attention)" in suggestion_text(by_kind["smallest"])


@pytest.mark.long
def test_splitting_is_offered_where_the_user_turned_it_off():
    _, levers = _levers(REQUESTS["131k-splits-off"])
    assert levers[0].kind == "smallest" and levers[0]["ways"] == 1
    split = next(lv for lv in levers if lv.kind == "split")
    assert split["ways"] > 1 and set(split.changes) & {"context_parallel", "sequence_parallel"}


@pytest.fixture(scope="module")
def million_token_qwen3(tmp_path_factory):
    """A Qwen3-8B-shaped model (its published sizes) whose positions reach 1,048,576 tokens, as a config folder."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("qwen3-1m")
    transformers.Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                             num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=2**20,
                             rope_theta=1e6, tie_word_embeddings=False,
                             architectures=["Qwen3ForCausalLM"]).save_pretrained(folder)
    return str(folder)


@pytest.mark.long
def test_a_million_token_sequence_is_told_to_split(million_token_qwen3):
    """On one node nothing fits a 1M-token sequence, split or not: more GPUs are offered with each sequence split
    across them (one GPU's share of the sequence is what fits), and the re-plan with those flags fits."""
    request, levers = _levers(dict(model=million_token_qwen3, global_batch=8, seq_len=2**20, gpu="H100-80GB",
                                   gpus_per_node=8))
    assert levers[0].kind == "smallest" and levers[0]["ways"] == 8  # the widest split a node has
    more = next(lv for lv in levers if lv.kind == "more-gpus")
    assert more["ways"] > 8 and "each sequence split" in suggestion_text(more)
    assert plan_request(request.model_copy(update=more.changes), detect=False).choice.fits


def test_a_consumer_card_is_offered_consumer_cards_first_and_adapters_before_hundreds_of_gpus():
    _, levers = _levers(REQUESTS["70b-on-a-4090"])
    kinds = [lv.kind for lv in levers]
    assert "adapters" in kinds
    adapters = levers[kinds.index("adapters")]
    assert adapters.changes["peft"] == "qlora" and lookup_gpu(adapters.changes["gpu"]).vendor == "nvidia"
    more = [lv for lv in levers if lv.kind == "more-gpus"]
    if more and more[0]["gpus"] >= 64:
        assert kinds.index("adapters") < kinds.index("more-gpus")
    assert all(lookup_gpu(lv.changes["gpu"]).vendor == "nvidia" for lv in levers if "gpu" in lv.changes)


@pytest.mark.long
def test_more_gpus_fill_a_node_before_adding_nodes():
    """An L40S usually comes one to a cloud instance, but AWS sells nodes of 4 and 8 (systems.json): 4 L40S in one
    node, not 4 nodes of one, and that node's host RAM is the 4-GPU instance's."""
    _, levers = _levers(dict(model=LLAMA_8B, global_batch=8, gpu="L40S-48GB"))
    more = next(lv for lv in levers if lv.kind == "more-gpus")
    assert (more["nodes"], more["per_node"]) == (1, more["gpus"]) and "nodes" not in more.changes
    assert "in one node" in suggestion_text(more)
    four = plan_request(PlanRequest.of(model=LLAMA_8B, global_batch=8, gpu="L40S-48GB", gpus_per_node=4),
                        detect=False)
    assert four.hardware.host_system == "AWS g6e.12xlarge" and four.hardware.host_memory_bytes == 384 * 2**30


@pytest.mark.long
def test_a_dataset_plan_is_told_a_max_length_not_a_seq_len(tmp_path):
    pytest.importorskip("datasets", reason="a dataset plan reads its rows through datasets")
    rows = tmp_path / "long.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": [1] * n}) + "\n" for n in (2000, 8000, 32000, 30000)))
    request, levers = _levers(dict(model=LLAMA_8B, global_batch=8, gpu="T4-16GB", dataset=str(rows), peft="qlora"))
    shorter = [lv for lv in levers if "sequence" in lv.kind]
    assert shorter and all("seq_len" not in lv.changes for lv in levers)
    assert "max_length" in shorter[0].changes and "--max-length" in suggestion_text(shorter[0])
    assert plan_request(request.model_copy(update=shorter[0].changes), detect=False).choice.fits


# --- refusals: each error's hint names flags (`changes`) that get past it

QWEN = dict(model="Qwen/Qwen2.5-0.5B", global_batch=16, seq_len=512)
REFUSED = {
    "fp8-on-an-a100": (dict(QWEN, gpu="A100-80GB", precision="fp8"), "--precision"),
    "fp8-lora-on-a-t4": (dict(QWEN, gpu="T4-16GB", precision="fp8", peft="lora"), "--precision"),
    "fp8-lora-on-an-h100": (dict(QWEN, gpu="H100-80GB", precision="fp8", peft="lora"), "--precision"),
    "fp8-on-an-mi300x": (dict(QWEN, gpu="MI300X-192GB", precision="fp8"), "--precision"),
    "bf16-on-a-v100": (dict(QWEN, gpu="V100-32GB", precision="bf16-mixed"), "--precision"),
    "qlora-in-fp32": (dict(QWEN, gpu="A100-80GB", precision="fp32", peft="qlora"), "--precision"),
    "flash-on-a-t4": (dict(QWEN, gpu="T4-16GB", attention="flash"), "--attention"),
    "batch-of-7-on-2-gpus": (dict(QWEN, global_batch=7, gpu="A100-80GB", gpus_per_node=2), "--batch"),
    "zero-2-on-one-gpu-without-offload": (dict(QWEN, gpu="A100-80GB", zero_stage=2, offload="none"), "--zero-stage"),
    "liger-on-gpt2": (dict(model="gpt2", global_batch=16, seq_len=512, gpu="A100-80GB", liger="on"), "--liger"),
    "ring-of-3-on-4-gpus": (dict(model="meta-llama/Llama-3.2-1B", global_batch=4, seq_len=32768, gpu="A100-80GB",
                                 gpus_per_node=4, context_parallel="3"), "--context-parallel"),
    "micro-batch-3-of-16": (dict(QWEN, gpu="A100-80GB", micro_batch=3), "--micro-batch"),
    "fsdp-stage-1": (dict(QWEN, gpu="A100-80GB", gpus_per_node=2, engine="fsdp", zero_stage=1), "--zero-stage"),
    "ring-and-ulysses": (dict(model="meta-llama/Llama-3.2-1B", global_batch=4, seq_len=32768, gpu="A100-80GB",
                              gpus_per_node=4, context_parallel="2", sequence_parallel="2"), "--sequence-parallel"),
    "past-the-models-positions": (dict(QWEN, gpu="A100-80GB", seq_len=65536), "--seq-len"),
    "lr-without-its-batch": (dict(QWEN, gpu="A100-80GB", lr=1e-4), "--lr-batch"),
    "steps-and-tokens": (dict(QWEN, gpu="A100-80GB", train_steps=10, train_tokens=1e6, compile="off"),
                         "--train-steps"),
    "lora-rank-without-peft": (dict(QWEN, gpu="A100-80GB", lora_rank=8), "--lora-rank"),
    "no-double-quant-with-lora": (dict(QWEN, gpu="A100-80GB", peft="lora", double_quant=False), "--no-double-quant"),
}


def _refusal(fields: dict) -> InputError:
    with pytest.raises(InputError) as info:
        plan_request(PlanRequest.of(**fields), detect=False)
    return info.value


@pytest.mark.parametrize("name", REFUSED)
def test_every_refusal_hint_prints_the_flags_it_carries(name):
    fields, flag = REFUSED[name]
    err = _refusal(fields)
    assert err.flag == flag and err.changes, (err.flag, err.hint)
    for field, value in err.changes.items():  # the flags the hint prints are the ones re-planned below
        assert (f"Drop {flag_of(PlanRequest, field)}" if value is None else as_flags({field: value})) in err.hint


@pytest.mark.parametrize("name", REFUSED)
@pytest.mark.long
def test_every_refusal_hint_re_planned_gets_past_it(name):
    fields, _ = REFUSED[name]
    err = _refusal(fields)
    try:
        plan_request(PlanRequest.of(**{**fields, **err.changes}), detect=False)
    except NoFitError:
        pass  # a valid request that fits nowhere: its own advice takes over


@pytest.mark.parametrize("name, nearest", [("fp8-on-an-a100", "bf16-mixed"), ("fp8-lora-on-a-t4", "fp16-mixed"),
                                           ("fp8-on-an-mi300x", "bf16-mixed")])
def test_fp8_refusals_say_fp8_the_gpus_fp8_support_and_the_nearest_precision_it_runs(name, nearest):
    fields, _ = REFUSED[name]
    err = _refusal(fields)
    gpu = lookup_gpu(fields["gpu"])
    assert err.message.startswith("fp8 ") and "8.9" in err.message and "SM89+" in err.message
    assert gpu.compute_capability in err.message and gpu.name in err.message
    assert err.changes == {"precision": nearest} and "bf16" not in err.message  # FP8 support, not bf16's


def test_fp8_with_adapters_offers_both_ways_out():
    err = _refusal(REFUSED["fp8-lora-on-an-h100"][0])
    assert "--precision bf16-mixed" in err.hint and "with --peft lora" in err.hint and "drop --peft" in err.hint


# --- notes that offer flags

NOTES = {
    "tf32-gain": dict(model="bigscience/bloom-560m", global_batch=64, gpu="A100-80GB", precision="fp32"),
    "compile-not-weighed": dict(model="gpt2", global_batch=32, seq_len=512, gpu="A100-80GB"),
    "fp8-available": dict(QWEN, gpu="H100-80GB"),
    "liger-available": dict(QWEN, gpu="H100-80GB"),
}


@pytest.mark.parametrize("kind", NOTES)
@pytest.mark.long
def test_every_note_that_offers_flags_re_plans_with_them(kind):
    request = PlanRequest.of(**NOTES[kind])
    n = next(n for n in plan_request(request, detect=False).notes if n.kind == kind)
    assert n.changes and as_flags(n.changes) in note_text(n), note_text(n)
    assert plan_request(request.model_copy(update=n.changes), detect=False).choice.fits


# --- install hints

def _extras() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def test_every_install_hint_names_an_extra_pyproject_defines():
    extras = _extras()
    hinted = [re.fullmatch(r'pip install -e "\.\[([\w-]+)\]"', info.install) for info in PACKAGE.values()]
    assert {m.group(1) for m in hinted if m} <= extras and sum(m is not None for m in hinted) >= 8
    files = [*ROOT.glob("planner/**/*.py"), *ROOT.glob("emit/**/*.py"), *ROOT.glob("probes/**/*.py"),
             ROOT / "README.md", *ROOT.glob("docs/*.md")]
    hints = r'pip install -e \\?"\.\[([\w,-]+)\]'
    named = {(path.name, extra) for path in files
             for group in re.findall(hints, path.read_text()) for extra in group.split(",")}
    assert named and {extra for _, extra in named} <= extras, sorted(e for e in named if e[1] not in extras)


def test_the_report_page_hint_prints_its_extra(tmp_path, monkeypatch):
    """Rich reads `[report]` as markup unless it is escaped: the hint must reach the terminal whole."""
    from tests.test_cli import invoke

    monkeypatch.setattr("planner.cli.report_available", lambda: False)
    result = invoke("--model", "gpt2", "--batch", "8", "--seq-len", "128", "--gpu", "A100-80GB", "--no-probe",
                    "--emit", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    assert f"plan.html not written: {PACKAGE['matplotlib'].install} writes it" in " ".join(result.output.split())
