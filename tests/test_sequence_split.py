"""Long sequences split across GPUs (planner/program/sequence.py): ring attention under FSDP2 (accelerate's cp_size)
and DeepSpeed's Ulysses (sp_size), planned, refused where the libraries refuse them, and emitted as files accelerate's
launcher turns into the ParallelismConfig it trains with."""

from __future__ import annotations

import json
import os

import pytest

from planner import plan
from planner.errors import InputError
from planner.hardware import lookup_gpu
from planner.hardware.efficiency_data import efficiency_of
from planner.memory.estimate import Evaluation
from planner.models import resolve_model
from planner.speed.communication import sequence_split_seconds

SMALL = dict(gpu="A100-80GB", gpus_per_node=4, detect=False)


def _parallelism(folder, monkeypatch):
    """What `accelerate launch --config_file folder/accelerate_config.yaml` exports, and the ParallelismConfig the
    Accelerator then builds from it (accelerate/accelerator.py:455-460)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(
        ["--config_file", str(folder / "accelerate_config.yaml"), "train.py"]))
    if args.use_deepspeed:  # as accelerate's launch_command sets it before its DeepSpeed launcher
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        env = prepare_deepspeed_cmd_env(args)[1]
    else:
        env = prepare_multi_gpu_env(args)
    for key, value in env.items():
        if key.startswith("PARALLELISM_CONFIG_") or key == "ACCELERATE_USE_PARALLELISM_CONFIG":
            monkeypatch.setenv(key, value)
    return args, ParallelismConfig()


def test_a_pinned_ring_is_planned_and_read_by_accelerate(tmp_path, monkeypatch):
    p = plan("meta-llama/Llama-3.2-1B", 4, seq_len=32768, context_parallel=2, **SMALL)
    cfg = p.choice.config
    assert (cfg.context_parallel, cfg.engine, cfg.data_parallel) == (2, "fsdp", 2)
    assert all(c.config.context_parallel == 2 for c in p.candidates if c.verdict.kind != "hardware")
    assert not [c for c in p.candidates if c.verdict.kind == "invalid"]
    p.emit(tmp_path)
    args, pc = _parallelism(tmp_path, monkeypatch)
    assert args.use_fsdp and os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    assert (pc.cp_size, pc.dp_shard_size, pc.total_size) == (2, 2, cfg.world_size)
    assert pc.cp_handler.cp_comm_strategy == "allgather"
    assert p.to_json()["choice"]["context_parallel"] == 2


def test_a_split_rank_keeps_the_activations_of_its_share_of_the_sequence():
    """Traced at the whole sequence and split 4 ways, a rank's activations are those of a quarter of the sequence
    traced whole (SDPA keeps no sequence x sequence matrix: every saved tensor is per token)."""
    resolved = resolve_model("meta-llama/Llama-3.2-1B")
    gpu = lookup_gpu("A100-80GB")
    from planner.config import Config

    cfg = Config(micro_batch=1, grad_accum=1, world_size=4, precision="bf16-mixed", checkpointing="full", zero_stage=3,
                 offload="none", engine="fsdp", context_parallel=4)
    split = Evaluation(resolved, seq_len=16384, optimizer="adamw", gpus_per_node=4, gpu=gpu).activations(cfg, "trace")[0]
    quarter = Evaluation(resolved, seq_len=4096, optimizer="adamw", gpus_per_node=4, gpu=gpu).activations(cfg.unsplit(), "trace")[0]
    assert split == pytest.approx(quarter, rel=0.03)


def test_ulysses_traffic_stays_constant_as_sequence_and_gpus_grow_together():
    """DeepSpeed-Ulysses' per-link volume is 4Nh/P per layer, constant when N and P grow together
    (microsoft/DeepSpeed blogs/deepspeed-ulysses/README.md); ring attention's grows with the sequence (each rank
    gathers all keys and values)."""
    from planner.config import Config

    spec, gpu = resolve_model("meta-llama/Llama-3.1-8B").spec, lookup_gpu("H100-80GB")
    eff = efficiency_of(gpu)

    def seconds(seq, n, field, engine):
        cfg = Config(micro_batch=1, grad_accum=1, world_size=8, precision="bf16-mixed", checkpointing="none",
                     zero_stage=3, offload="none", engine=engine, **{field: n})
        return sequence_split_seconds(spec, cfg, seq, 8, gpu, eff)

    four, eight = seconds(65536, 4, "sequence_parallel", "deepspeed"), seconds(131072, 8, "sequence_parallel",
                                                                              "deepspeed")
    assert eight / four == pytest.approx((7 / 8) / (3 / 4), rel=0.02)  # an all-to-all moves (P-1)/P of it
    ring4, ring8 = seconds(65536, 4, "context_parallel", "fsdp"), seconds(131072, 8, "context_parallel", "fsdp")
    assert ring8 > 1.8 * ring4


@pytest.mark.parametrize("model, fields, flag, words", [
    ("meta-llama/Llama-3.2-1B", dict(context_parallel=3), "--context-parallel", "does not divide"),
    ("meta-llama/Llama-3.2-1B", dict(context_parallel=2, attention="eager"), "--context-parallel", "SDPA"),
    ("meta-llama/Llama-3.2-1B", dict(context_parallel=2, sequence_parallel=2), "--sequence-parallel", "exclusive"),
    ("meta-llama/Llama-3.2-1B", dict(sequence_parallel="x"), "--sequence-parallel", "not auto, off"),
    ("mistralai/Mistral-7B-v0.1", dict(context_parallel=4), "--context-parallel", "sliding_attention"),
    ("google-t5/t5-small", dict(context_parallel=2, seq_len=512), "--context-parallel", "causal"),
])
def test_splits_are_refused_where_the_libraries_refuse_them(model, fields, flag, words):
    request = {**SMALL, "seq_len": 32768, **fields}
    with pytest.raises(InputError) as err:
        plan(model, 4, **request)
    assert err.value.flag == flag and words in str(err.value)


def test_a_batch_smaller_than_the_gpus_trains_with_split_sequences():
    """One 131,072-token sequence per step on 8 GPUs: only a split of 8 leaves a data-parallel rank for it."""
    p = plan("meta-llama/Llama-3.2-1B", 1, seq_len=131072, gpu="H100-80GB", gpus_per_node=8, detect=False)
    assert p.choice.config.sequence_split == 8 and p.choice.config.global_batch == 1


def test_auto_weighs_no_split_for_short_sequences():
    p = plan("meta-llama/Llama-3.2-1B", 8, seq_len=4096, **SMALL)
    assert all(c.config.sequence_split == 1 for c in p.candidates)


@pytest.mark.long
def test_llama_8b_at_128k_tokens_on_8_h100s_splits_its_sequences(tmp_path, monkeypatch):
    """The issue's own request: a split configuration that fits, within physics, emitted as files accelerate reads."""
    p = plan("meta-llama/Llama-3.1-8B", 8, seq_len=131072, gpu="H100-80GB", gpus_per_node=8, detect=False)
    cfg = p.choice.config
    assert p.choice.fits and cfg.sequence_split > 1 and p.choice.memory.peak <= p.hardware.budget_bytes
    assert not [c for c in p.candidates if c.verdict.kind == "invalid"]
    assert "sequence-split" in [n.kind for n in p.notes]
    p.emit(tmp_path)
    _, pc = _parallelism(tmp_path, monkeypatch)
    assert (pc.cp_size, pc.sp_size) == (cfg.context_parallel, cfg.sequence_parallel)
    assert pc.dp_replicate_size * pc.dp_shard_size == cfg.data_parallel
    if cfg.engine == "deepspeed":  # accelerate sizes DeepSpeed's batch by the data-parallel ranks (accelerator.py:2358)
        ds = json.loads((tmp_path / "ds_config.json").read_text())
        assert ds["train_batch_size"] == cfg.micro_batch * cfg.grad_accum * pc.dp_shard_size * pc.dp_replicate_size
