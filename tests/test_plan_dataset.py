"""Planning for the user's own data: memory at the longest batch the data can form (padded) or at --max-length
(packed), the strategy chosen by tokens of data per second, and the length histogram cached."""

from __future__ import annotations

import json

import pytest
import transformers

import planner.planning
from planner import estimate_memory, facts, plan
from planner.errors import InputError
from tests.test_dataset import build_tokenizer, sentence

#: 900 short samples (40 words) and 100 long ones (400 words); the tokenizer adds <s> and </s>
WORDS = [40] * 900 + [400] * 100
LONGEST = 402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=32, max_position_embeddings=4096,
                             architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    build_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps({"text": sentence(n)}) + "\n" for n in WORDS))
    return path


def _plan(model_dir, data, **kw):
    return plan(str(model_dir), 16, gpu="A100-80GB", dataset=str(data), detect=False, **kw)


@pytest.mark.long
def test_padded_memory_is_the_longest_batch_and_packed_memory_is_max_length(model_dir, data):
    for padding, rows in (("longest", LONGEST), ("packing", 1024)):
        p = _plan(model_dir, data, max_length=1024, padding=padding)
        assert (p.dataset.samples, p.dataset.max, p.dataset.truncated) == (1000, LONGEST, 0)
        assert p.dataset.p50 == 42 and p.dataset.tokens == 900 * 42 + 100 * LONGEST
        cfg = p.choice.config
        assert cfg.padding == padding and p.seq_len == p.dataset.row_length == rows
        alone = estimate_memory(str(model_dir), micro_batch=cfg.micro_batch, seq_len=rows, precision=cfg.precision,
                                checkpointing=cfg.checkpointing, zero_stage=cfg.zero_stage, offload=cfg.offload,
                                engine=cfg.engine, gpu="A100-80GB", grad_accum=cfg.grad_accum)
        assert p.choice.memory.peak == alone.peak, padding


@pytest.mark.long
def test_the_choice_follows_tokens_of_data_per_second(model_dir, data):
    p = _plan(model_dir, data)
    best = max(c.throughput.real_tokens_per_s for c in p.candidates if c.fits)
    same = max(c.throughput.real_tokens_per_s for c in p.candidates if c.fits
               and c.config.structure() == p.choice.config.structure())
    # the fastest up to what the speed model can tell apart: within the speed tie of its structure's best
    assert p.choice.throughput.real_tokens_per_s * facts.get("search.speed_tie") >= same
    assert p.choice.throughput.real_tokens_per_s * facts.get("search.structure_tie") >= best
    assert p.choice.throughput.real_tokens_per_s <= p.choice.throughput.tokens_per_s
    waste = p.dataset.padding_waste
    # skewed: a random batch of 16 holds a long sample 5 times in 6, so padding costs; grouping by length recovers most
    assert waste["padding-free"] == 0 and waste["longest"] > 0.5 > waste["grouped"] > 0
    longest = [c for c in p.candidates if c.fits and c.config.padding == "longest" and c.config.micro_batch > 1]
    assert longest and all(c.throughput.real_tokens_per_s < c.throughput.tokens_per_s for c in longest)
    data_json = p.to_json()
    assert data_json["choice"]["padding"] == p.choice.config.padding and data_json["dataset"]["max"] == LONGEST
    assert data_json["throughput"]["real_tokens_per_s"] == p.choice.throughput.real_tokens_per_s


@pytest.mark.long
def test_the_length_histogram_is_cached(model_dir, data, monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINPLAN_CACHE", str(tmp_path / "cache"))
    seen = []
    real = planner.planning.load_lengths
    monkeypatch.setattr(planner.planning, "load_lengths", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    _plan(model_dir, data, micro_batch=1)
    _plan(model_dir, data, micro_batch=1)
    assert [s.cached for s in seen] == [False, True]


def test_dataset_flags_are_checked(model_dir, data):
    with pytest.raises(InputError) as err:
        plan(str(model_dir), 16, gpu="A100-80GB", max_length=512)
    assert err.value.flag == "--max-length"
    with pytest.raises(InputError) as err:
        _plan(model_dir, data, seq_len=512)
    assert err.value.flag == "--seq-len"


def test_packing_trains_about_the_batch_in_samples(model_dir, data):
    """--batch counts samples, packed or not: a packed row of 1,024 tokens holds 1024 x (1 - waste) / 78 of these
    samples (78,000 tokens in 1,000 samples, wrapped into 77 rows), so 64 samples are about 5 rows."""
    p = plan(str(model_dir), 64, gpu="A100-80GB", dataset=str(data), detect=False, max_length=1024, padding="packing",
             lr=1e-4, lr_batch=64, epochs=2)
    tokens = 900 * 42 + 100 * LONGEST
    per_row = 1024 * (tokens / (77 * 1024)) / (tokens / 1000)
    cfg, tp, data_json = p.choice.config, p.choice.throughput, p.to_json()
    assert cfg.micro_batch * cfg.grad_accum * cfg.data_parallel == cfg.global_batch == round(64 / per_row) == 5
    samples = data_json["choice"]["samples_per_step"]
    assert samples == pytest.approx(5 * per_row) and data_json["choice"]["tokens_per_step"] == pytest.approx(5 * 1024)
    assert tp.samples_per_s * tp.step_time_s == pytest.approx(samples)
    assert p.dataset.steps_per_epoch == -(-1000 // samples)
    assert p.lr.factor == pytest.approx((samples / 64) ** 0.5)  # Adam's square root, from the samples of a step
    args = p.to_training_args()  # the emitted Trainer / TRL configuration trains the rows the plan printed
    assert args["per_device_train_batch_size"] * args["gradient_accumulation_steps"] == 5
