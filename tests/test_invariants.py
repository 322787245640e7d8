"""Physics on every candidate (planner/invariants.py): the rules themselves, and a property test over a model zoo.

The property test draws requests (dense decoders, a mixture of experts, an encoder, an encoder-decoder; full, LoRA and
QLoRA; Liger on and off; 1 to 64 GPUs; both sharding engines; padded and packed data) and plans each: no candidate
of any plan may break an invariant. Its examples are fixed (derandomized) so CI runs the same ones;
TRAINPLAN_ZOO_EXAMPLES=200 explores more.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis import strategies as st

from planner import plan
from planner.config import Config
from planner.errors import InputError, NoFitError
from planner.hardware import lookup_gpu
from planner.invariants import Physics, guarded, order_violations
from planner.memory.estimate import MemoryEstimate
from planner.models import resolve_model
from planner.notes import Verdict
from planner.speed.step import StepSize, ThroughputInfo
from planner.types import Candidate

GiB = 2**30
CFG = Config(micro_batch=2, grad_accum=2, world_size=1, precision="bf16-mixed", checkpointing="none", zero_stage=0,
             offload="none")


class FixedSteps:
    """A speed model stand-in: every step trains 4 samples of 1,000 tokens, attention over 1,000 keys."""

    def step_size(self, cfg):
        return StepSize(samples=4, tokens=4000, real_tokens=4000)

    def attention_length(self, cfg):
        return 1000


def memory(activations=GiB, **update) -> MemoryEstimate:
    states = 3 * GiB
    fields = dict(parameters=GiB, gradients=GiB, optimizer_states=GiB, activations=activations, overhead=GiB,
                  peak_allocated=states + activations + GiB, peak=states + activations + GiB, method="trace",
                  device="cuda")
    return MemoryEstimate(**{**fields, **update})


def speed(tokens_per_s=4000.0, step_s=1.0, samples_per_s=4.0) -> ThroughputInfo:
    return ThroughputInfo(tokens_per_s=tokens_per_s, samples_per_s=samples_per_s, mfu=0.0, step_time_s=step_s)


def candidate(cfg=CFG, mem=None, tp=None) -> Candidate:
    return Candidate(config=cfg, memory=mem or memory(), throughput=tp or speed(), verdict=Verdict(kind="fits"))


@pytest.fixture(scope="module")
def physics():
    return Physics(lookup_gpu("A100-80GB"), resolve_model("gpt2").spec, FixedSteps())


def kinds(physics, cand) -> set[str]:
    return {v.kind for v in physics.violations(cand)}


def test_a_sound_candidate_breaks_nothing(physics):
    assert kinds(physics, candidate()) == set()


@pytest.mark.parametrize("mem, expected", [
    (memory(activations=-GiB), "negative"),
    (memory(peak_allocated=2 * GiB), "below-states"),
    (memory(peak=GiB * 4), "peak-order"),
])
def test_memory_rules(physics, mem, expected):
    assert expected in kinds(physics, candidate(mem=mem))


def test_speed_rules(physics):
    # gpt2 costs about 6 x 124M FLOPs a token: 1e6 tokens/s needs ~750 TFLOPS, over the A100's 312
    assert "flops" in kinds(physics, candidate(tp=speed(tokens_per_s=1e6, step_s=0.004, samples_per_s=1000)))
    assert "step-tokens" in kinds(physics, candidate(tp=speed(tokens_per_s=5000.0)))
    assert "step-samples" in kinds(physics, candidate(tp=speed(samples_per_s=5.0)))


def test_memory_may_not_fall_with_a_larger_micro_batch():
    small, large = (candidate(CFG.model_copy(update={"micro_batch": mb, "grad_accum": 4 // mb}), memory(act))
                    for mb, act in ((1, 2 * GiB), (2, GiB)))
    found = order_violations([small, large], layers=12)
    assert [v.kind for v in found[large.config]] == ["micro-batch", "micro-batch"]  # activations and peak


def test_less_recomputation_may_not_keep_less():
    def broken(**modes):
        cands = [candidate(CFG.model_copy(update={"checkpointing": m}), memory(act)) for m, act in modes.items()]
        return {v["mode"] for vs in order_violations(cands, layers=12).values() for v in vs}

    assert broken(none=GiB, full=2 * GiB) == {"none"}
    assert broken(selective=GiB, full=6 * GiB, none=48 * GiB) == {"selective"}  # beyond one block of 4 GiB
    # the per-op policy saves matmul outputs autograd would free: selective over none is not a rule
    assert broken(none=GiB, selective=2 * GiB, full=GiB // 2) == set()


def test_full_checkpointing_may_hold_one_whole_block_over_selective():
    """A shallow model's full checkpointing recomputes a whole block, which can outweigh what selective saves: allowed
    up to one block of what no checkpointing keeps, not beyond."""
    def found(full_act):
        modes = {"none": 8 * GiB, "selective": 2 * GiB, "full": full_act}
        cands = [candidate(CFG.model_copy(update={"checkpointing": m}), memory(act)) for m, act in modes.items()]
        return order_violations(cands, layers=2)

    assert not found(5 * GiB)          # selective 2 + one block of 8 / 2 = 6 >= 5
    assert found(7 * GiB)              # beyond one block


def test_a_broken_candidate_is_never_a_fit(physics, caplog):
    bad = candidate(mem=memory(activations=-GiB))
    out = guarded([bad, candidate(CFG.model_copy(update={"micro_batch": 4, "grad_accum": 1}))], physics)
    assert out[0].verdict.kind == "invalid" and not out[0].fits
    assert "internal error" in caplog.text and "activations" in caplog.text
    assert "below zero" in out[0].reason


# --- the property over the zoo ---------------------------------------------------------------------------------

ZOO = {  # model -> whether Liger-Kernel patches it (its `on` is then drawn too)
    "meta-llama/Llama-3.2-1B": True, "Qwen/Qwen2.5-0.5B": True, "mistralai/Mixtral-8x7B-v0.1": True,
    "google-bert/bert-base-uncased": False, "google-t5/t5-small": False,
}
ENCODERS = {"google-bert/bert-base-uncased", "google-t5/t5-small"}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Pre-tokenised samples of 30 to 1,500 tokens (no tokenizer needed)."""
    path = tmp_path_factory.mktemp("zoo") / "data.jsonl"
    lengths = [30 + (i * 337) % 1470 for i in range(200)]
    path.write_text("".join(json.dumps({"input_ids": [1] * n}) + "\n" for n in lengths))
    return str(path)


@st.composite
def requests(draw):
    model = draw(st.sampled_from(sorted(ZOO)))
    gpus = draw(st.sampled_from([1, 2, 4, 8]))
    nodes = draw(st.sampled_from([1, 2, 8])) if gpus == 8 else 1
    fields = dict(gpu=draw(st.sampled_from(["A100-80GB", "H100-80GB", "RTX4090-24GB", "L40S-48GB"])),
                  gpus_per_node=gpus, nodes=nodes, engine=draw(st.sampled_from(["deepspeed", "fsdp"])),
                  liger=draw(st.sampled_from(["on", "off"])) if ZOO[model] else "off")
    if adapter := draw(st.sampled_from([None, "lora", "qlora"])):
        fields["peft"] = adapter
    if model not in ENCODERS and draw(st.booleans()):
        fields.update(data=True, padding=draw(st.sampled_from(["packing", "longest"])), max_length=1024)
    else:
        fields["seq_len"] = draw(st.sampled_from([256, 512] if model in ENCODERS else [512, 2048]))
    return model, gpus * nodes * draw(st.sampled_from([1, 2, 8])), fields


@settings(max_examples=int(os.environ.get("TRAINPLAN_ZOO_EXAMPLES", 16)), deadline=None, derandomize=True,
          phases=[Phase.explicit, Phase.generate],  # a plan takes seconds: report the example as drawn, unshrunk
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(request=requests())
@pytest.mark.long
def test_every_candidate_of_every_plan_obeys_physics(request, dataset):
    model, batch, fields = request
    if fields.pop("data", False):
        fields["dataset"] = dataset
    try:
        candidates = plan(model, batch, detect=False, **fields).candidates
    except NoFitError as err:
        candidates = err.plan.candidates if err.plan is not None else ()
    except InputError:  # a drawn combination the planner refuses (a sequence longer than the model's, ...)
        reject()
    broken = [f"{c.config.label()}: {c.reason}" for c in candidates if c.verdict.kind == "invalid"]
    assert not broken, "\n".join(broken[:5])


@pytest.mark.parametrize("liger", ["on", "off"])
@pytest.mark.long
def test_the_liger_tensor_parallel_plan_that_broke_physics(liger):
    """Qwen2.5-7B LoRA on 8 H100s at 4,096 tokens once planned a peak of -72 GiB at 3.4x the speed with Liger: Liger's
    savings were taken from a selective block's formula that holds none of them, and from whole tensors a
    tensor-parallel rank holds a quarter of."""
    p = plan("Qwen/Qwen2.5-7B", 128, detect=False, peft="lora", seq_len=4096, gpu="H100-80GB", gpus_per_node=8,
             liger=liger)
    assert not [c for c in p.candidates if c.verdict.kind == "invalid"]
    assert 0 < p.choice.memory.activations < p.choice.memory.peak <= p.hardware.budget_bytes
    assert 0 < p.choice.throughput.hfu < 1


@st.composite
def long_requests(draw):
    """fp8 and split sequences: small decoders at long sequences on FP8-capable and older GPUs."""
    model = draw(st.sampled_from(["meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-0.5B"]))
    gpus = draw(st.sampled_from([2, 4, 8]))
    fields = dict(gpu=draw(st.sampled_from(["H100-80GB", "A100-80GB", "L40S-48GB"])), gpus_per_node=gpus,
                  seq_len=draw(st.sampled_from([16384, 32768])), precision=draw(st.sampled_from(["auto", "fp8"])),
                  context_parallel=draw(st.sampled_from(["auto", "2", "off"])), liger="off")
    return model, gpus * draw(st.sampled_from([1, 2])), fields


@settings(max_examples=int(os.environ.get("TRAINPLAN_ZOO_EXAMPLES", 8)), deadline=None, derandomize=True,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(request=long_requests())
@pytest.mark.long
def test_every_fp8_and_split_sequence_candidate_obeys_physics(request, monkeypatch):
    import planner.planning

    monkeypatch.setattr(planner.planning, "torchao_missing", lambda: None)  # auto weighs fp8 too
    model, batch, fields = request
    try:
        candidates = plan(model, batch, detect=False, **fields).candidates
    except NoFitError as err:
        candidates = err.plan.candidates if err.plan is not None else ()
    except InputError:  # fp8 on an A100, a split the sequence or heads do not allow
        reject()
    broken = [f"{c.config.label()}: {c.reason}" for c in candidates if c.verdict.kind == "invalid"]
    assert not broken, "\n".join(broken[:5])
