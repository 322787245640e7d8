"""Task heads, LoRA and QLoRA: counted as peft counts them, traced as peft runs them, stored as the QLoRA paper and
bitsandbytes store them, planned, emitted, applied."""

from __future__ import annotations

import json

import peft
import pytest
import torch
import transformers

from emit import emit
from planner import Adapter, estimate_memory, load_plan, plan
from planner.errors import InputError
from planner.models.adapters import nf4_bytes
from planner.program.step import cpu_step_peak, enable_checkpointing, make_batch, make_optimizer
from planner.models import resolve_model
from planner.models.build import build_meta
from planner.vocab import PRECISION

QV = {"meta-llama/Llama-3.1-8B": "q_proj,v_proj", "mistralai/Mistral-7B-v0.1": "q_proj,v_proj",
      "Qwen/Qwen2.5-7B": "q_proj,v_proj", "gpt2": "c_attn", "google-bert/bert-base-uncased": "query,value"}


def _peft_counts(name: str, targets: str, task: str | None, num_labels: int | None):
    """peft's own count, on a model built independently of the planner's adapter code."""
    config = resolve_model(name, task=task, num_labels=num_labels).config
    target = "all-linear" if targets == "all-linear" else targets.split(",")
    task_type = {"seq-cls": "SEQ_CLS", None: "CAUSAL_LM"}[task]
    model = build_meta(config)
    with torch.device("meta"):
        wrapped = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=target,
                                                             task_type=task_type))
    return wrapped.get_nb_trainable_parameters()


@pytest.mark.parametrize("name", list(QV))
@pytest.mark.parametrize("which", ["all-linear", "qv"])
def test_trainable_and_total_parameters_equal_peft_counts(name, which):
    task, labels = ("seq-cls", 2) if "bert" in name else (None, None)
    targets = "all-linear" if which == "all-linear" else QV[name]
    adapter = Adapter("lora", rank=16, targets=Adapter.parse_targets(targets))
    spec = resolve_model(name, task=task, num_labels=labels, adapter=adapter).spec
    assert (spec.trainable_parameters, spec.parameters) == _peft_counts(name, targets, task, labels)
    assert 0 < spec.trainable_parameters < spec.parameters / 20


def test_task_head_replaces_the_config_head_with_exact_parameters():
    lm = resolve_model("bigscience/bloom-560m").spec
    cls = resolve_model("bigscience/bloom-560m", task="seq-cls", num_labels=2).spec
    assert cls.architecture == "BloomForSequenceClassification" and cls.task == "seq-cls"
    assert cls.parameters == lm.parameters + 2 * 1024  # the score layer (no bias); the tied LM head is gone
    assert cls.logit_width == 0 and cls.num_labels == 2  # no vocabulary-wide logits for a classifier
    tok = resolve_model("google-bert/bert-base-uncased", task="token-cls", num_labels=9).spec
    assert tok.architecture == "BertForTokenClassification" and tok.logit_width == 9


def test_a_classifier_without_a_pad_token_gets_the_eos_id():
    config = resolve_model("meta-llama/Llama-3.1-8B", task="seq-cls", num_labels=3).config
    assert config.pad_token_id == 128001 and config.num_labels == 3


@pytest.mark.parametrize("kwargs, flag", [
    (dict(task="seq2seq"), "--task"),                            # GPT-2 has no encoder-decoder head
    (dict(num_labels=3), "--num-labels"),                        # a causal LM has no labels
    (dict(adapter=Adapter("lora", targets=("no_such_module",))), "--lora-targets"),
])
def test_impossible_heads_and_targets_are_input_errors(kwargs, flag):
    with pytest.raises(InputError) as err:
        resolve_model("gpt2", **kwargs)
    assert err.value.flag == flag


#: NF4 with double quantisation, bits per parameter: 4-bit codes, a uint8 absmax per 64 weights and an fp32 absmax per
#: 256 of those: "32/64 = 0.5 bits per parameter" without, "8/64 + 32/(64 * 256) = 0.127 bits per parameter" with
#: (Dettmers et al. 2023, QLoRA, arXiv 2305.14314, section 3 'Double Quantization'). The paper rounds to 3 decimals.
NF4_BITS, NF4_DQ_BITS, PAPER_ROUNDING = 4 + 0.5, 4 + 0.127, 0.0005


def _linear_weights_bitsandbytes_converts(name: str) -> tuple[int, int]:
    """(elements of the nn.Linear weights transformers' bitsandbytes integration quantises, all parameters) of the
    model built on the meta device with transformers alone: every nn.Linear but the output head, which
    `get_keys_to_not_convert` keeps in 16 bits (integrations/bitsandbytes.py)."""
    config = resolve_model(name).config
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    return linear, sum(p.numel() for p in model.parameters())


def test_qlora_base_is_counted_as_bitsandbytes_stores_it():
    spec = resolve_model("meta-llama/Llama-3.1-8B", adapter=Adapter("qlora")).spec
    quantized, _ = _linear_weights_bitsandbytes_converts("meta-llama/Llama-3.1-8B")
    assert spec.quantized_parameters == quantized
    assert 8 * spec.quantized_bytes / quantized == pytest.approx(NF4_DQ_BITS, abs=PAPER_ROUNDING)
    n = 2**24
    assert 8 * nf4_bytes(n, False) / n == pytest.approx(NF4_BITS, abs=PAPER_ROUNDING)
    assert 8 * nf4_bytes(n, True) / n == pytest.approx(NF4_DQ_BITS, abs=PAPER_ROUNDING)


@pytest.mark.gpu
def test_nf4_bytes_are_what_bitsandbytes_keeps():
    """bitsandbytes' own 4-bit quantisation of a CUDA tensor: its packed codes plus its QuantState's absmax constants
    (uint8 with double quantisation, their fp32 second-level absmax and offset)."""
    bnb = pytest.importorskip("bitsandbytes")
    weight = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    for double in (False, True):
        packed, state = bnb.functional.quantize_4bit(weight, quant_type="nf4", compress_statistics=double)
        kept = packed.nbytes + state.absmax.nbytes
        if double:
            kept += state.state2.absmax.nbytes + state.offset.nbytes
        assert nf4_bytes(weight.numel(), double) == kept


def _tiny(kind: str):
    if kind == "llama":
        return transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=160,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                        architectures=["LlamaForCausalLM"])
    return transformers.BertConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   vocab_size=500, num_labels=2, architectures=["BertForSequenceClassification"])


def _real_lora_peak(config, adapter: Adapter, micro_batch, seq, precision, checkpointing, grad_accum) -> int:
    """A real CPU step of the model with peft's LoRA (built with peft directly), as benchmarks/cpu_memory_accuracy.py
    measures a full model's."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if PRECISION[precision].weight_bytes == 2 else torch.float32
    model = getattr(transformers, config.architectures[0])._from_config(config, dtype=dtype)
    task = "SEQ_CLS" if "Classification" in config.architectures[0] else "CAUSAL_LM"
    model = peft.get_peft_model(model, peft.LoraConfig(**{**adapter.lora_kwargs("causal-lm"), "task_type": task}))
    autocast = PRECISION[precision].autocast  # a bf16 model: peft's autocast_adapter_dtype keeps the adapters fp32
    if autocast:
        from peft.utils import cast_mixed_precision_params

        cast_mixed_precision_params(model, getattr(torch, autocast))
    model.train()
    enable_checkpointing(model, checkpointing)
    batch = make_batch(model.get_base_model(), micro_batch, seq)
    return cpu_step_peak(model, make_optimizer(model, "adamw"), batch, autocast, grad_accum)


@pytest.mark.parametrize("kind, targets, precision, checkpointing, grad_accum", [
    ("llama", "all-linear", "fp32", "none", 1),
    ("llama", "q_proj,v_proj", "bf16-mixed", "none", 2),
    ("llama", "all-linear", "bf16-mixed", "full", 2),
    ("llama", "all-linear", "bf16-true", "selective", 1),
    ("bert", "all-linear", "fp32", "selective", 1),
    ("bert", "query,value", "bf16-mixed", "none", 1),
])
def test_real_lora_steps_on_the_cpu_match_the_estimate(kind, targets, precision, checkpointing, grad_accum):
    config = _tiny(kind)
    adapter = Adapter("lora", rank=8, targets=Adapter.parse_targets(targets))
    est = estimate_memory(config, micro_batch=4, seq_len=128, precision=precision, checkpointing=checkpointing,
                          grad_accum=grad_accum, device="cpu", attention="sdpa", adapter=adapter)
    real = _real_lora_peak(config, adapter, 4, 128, precision, checkpointing, grad_accum)
    assert est.peak == pytest.approx(real, rel=0.02)


def test_qlora_plan_fits_a_24gb_card_that_full_fine_tuning_does_not():
    p = plan("meta-llama/Llama-3.1-8B", 16, seq_len=2048, gpu="RTX4090-24GB", adapter=Adapter("qlora"))
    cfg = p.choice.config
    assert cfg.zero_stage == 0 and cfg.precision == "bf16-mixed"  # 4090: bf16; QLoRA is planned unsharded
    # NF4's published bits per quantised weight, 2 B for every other frozen weight (embeddings, head, norms), the
    # fp32 adapters (peft's autocast_adapter_dtype); the paper's rounding of 0.127 bits as the tolerance
    quantized, total = _linear_weights_bitsandbytes_converts("meta-llama/Llama-3.1-8B")
    trainable = p.model.trainable_parameters
    expected = NF4_DQ_BITS / 8 * quantized + 2 * (total - quantized) + 4 * trainable
    assert p.choice.memory.parameters == pytest.approx(expected, abs=PAPER_ROUNDING / 8 * quantized)
    reasons = " ".join(c.reason for c in p.candidates)
    assert "QLoRA" not in reasons or "16 bits" in reasons


def test_adapters_reject_what_they_cannot_run():
    with pytest.raises(InputError, match="QLoRA computes in 16 bits"):
        plan("gpt2", 8, gpu="A100-80GB", precision="fp32", adapter=Adapter("qlora"))
    with pytest.raises(InputError, match="QLoRA is planned on one GPU or DDP"):
        plan("gpt2", 8, gpu="A100-80GB", gpus_per_node=2, zero_stage=3, precision="bf16-mixed",
             adapter=Adapter("qlora"))



def test_a_bf16_model_trains_fp32_adapters():
    """PEFT's own harness loads the model in bf16 and trains without autocast: peft keeps the adapters fp32. The truth:
    peft's model built on the meta device in bf16 (its parameter and trainable-gradient bytes as stored) and the
    states of a real AdamW step on the CPU over its trainable tensors' shapes."""
    adapter = Adapter("lora", rank=16, targets=("q_proj", "v_proj"))
    est = estimate_memory("meta-llama/Llama-3.2-1B", micro_batch=1, seq_len=512, precision="bf16-true",
                          method="analytic", adapter=adapter)
    config = resolve_model("meta-llama/Llama-3.2-1B").config
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))
    trained = [p for p in model.parameters() if p.requires_grad]
    assert {p.dtype for p in trained} == {torch.float32}
    assert est.parameters == sum(p.numel() * p.element_size() for p in model.parameters())
    assert est.gradients == sum(p.numel() * p.element_size() for p in trained)
    real = [torch.nn.Parameter(torch.zeros(p.shape, dtype=p.dtype)) for p in trained]
    for p in real:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(real, lr=1e-4)
    opt.step()
    states = sum(v.nbytes for p in real for v in opt.state[p].values() if v.dim())  # not the per-tensor step counters
    assert est.optimizer_states == states


def test_lora_speed_skips_the_frozen_weight_gradients():
    full = plan("meta-llama/Llama-3.2-1B", 64, seq_len=1024, gpu="H100-80GB", precision="bf16-mixed",
                checkpointing="none", micro_batch=8)
    lora = plan("meta-llama/Llama-3.2-1B", 64, seq_len=1024, gpu="H100-80GB", precision="bf16-mixed",
                checkpointing="none", micro_batch=8, adapter=Adapter("lora", targets=("q_proj", "v_proj")))
    assert lora.choice.throughput.step_time_s < 0.9 * full.choice.throughput.step_time_s
    qlora = plan("meta-llama/Llama-3.2-1B", 64, seq_len=1024, gpu="H100-80GB", precision="bf16-mixed",
                 checkpointing="none", micro_batch=8, adapter=Adapter("qlora", targets=("q_proj", "v_proj")))
    assert qlora.choice.throughput.step_time_s > lora.choice.throughput.step_time_s  # dequantisation


def test_emitted_adapter_files_load_in_peft_and_transformers_and_prepare_applies_them(tmp_path):
    config = _tiny("bert")
    config.save_pretrained(tmp_path / "tiny")
    p = plan(str(tmp_path / "tiny"), 8, gpu="A100-80GB", seq_len=64, task="seq-cls", num_labels=2,
             adapter=Adapter("lora", rank=4, targets=("query", "value")))
    emit(p, tmp_path / "run")
    data = json.loads((tmp_path / "run" / "peft_config.json").read_text())
    lora = peft.LoraConfig(**data["lora_config"])
    assert lora.r == 4 and lora.task_type == "SEQ_CLS" and set(lora.target_modules) == {"query", "value"}
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["model"]["trainable_parameters"] == \
        p.model.trainable_parameters
    loaded = load_plan(tmp_path / "run")
    model = loaded.prepare(transformers.BertForSequenceClassification(config))
    assert isinstance(model, peft.PeftModel)
    assert model.get_nb_trainable_parameters() == (p.model.trainable_parameters, p.model.parameters)
    with pytest.raises(InputError, match="made for BertForSequenceClassification"):
        loaded.prepare(transformers.BertForMaskedLM(config))


def test_qlora_emits_bitsandbytes_arguments(tmp_path):
    p = plan("gpt2", 8, gpu="A100-80GB", seq_len=128, adapter=Adapter("qlora", rank=8))
    data = p.to_peft()
    assert data["bnb_config"] == {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                  "bnb_4bit_use_double_quant": True,
                                  "bnb_4bit_compute_dtype": PRECISION[p.choice.config.precision].autocast}
    assert transformers.BitsAndBytesConfig(**data["bnb_config"]).load_in_4bit


BAD_ADAPTER_FLAGS = [
    (["--lora-rank", "8"], "--lora-rank"),
    (["--peft", "lora", "--no-double-quant"], "--no-double-quant"),
    (["--peft", "lora", "--lora-rank", "0"], "--lora-rank"),
    (["--peft", "lora", "--lora-dropout", "1.5"], "--lora-dropout"),
    (["--peft", "dora"], "--peft"),
    (["--task", "image-cls"], "--task"),
    (["--num-labels", "3"], "--num-labels"),
    (["--task", "seq-cls", "--num-labels", "0"], "--num-labels"),
    (["--peft", "lora", "--lora-targets", "nope_proj"], "--lora-targets"),
]


@pytest.mark.parametrize(("args", "flag"), BAD_ADAPTER_FLAGS, ids=[" ".join(a) for a, _ in BAD_ADAPTER_FLAGS])
def test_bad_adapter_flags_exit_2_naming_the_flag(args, flag):
    from typer.testing import CliRunner

    from planner.cli import app

    result = CliRunner().invoke(app, ["--model", "gpt2", "--batch", "8", "--gpu", "A100-80GB", *args])
    assert result.exit_code == 2, result.output
    assert flag in result.output and "Traceback" not in result.output


def test_missing_peft_is_an_input_error_naming_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` now raises ImportError
    with pytest.raises(InputError, match="peft") as err:
        resolve_model("gpt2", adapter=Adapter("lora"))
    assert err.value.flag == "--peft" and ".[peft]" in err.value.hint


def test_cli_seed_case_json_reports_trainable_and_total(tmp_path):
    from typer.testing import CliRunner

    from planner.cli import app

    result = CliRunner().invoke(app, ["--model", "bigscience/bloom-560m", "--task", "seq-cls", "--num-labels", "2",
                                      "--seq-len", "1024", "--batch", "16", "--gpu", "T4-16GB", "--peft", "lora",
                                      "--lora-targets", "query_key_value", "--json"])
    assert result.exit_code == 0, result.output
    model = json.loads(result.stdout)["model"]
    assert model["architecture"] == "BloomForSequenceClassification" and model["num_labels"] == 2
    assert model["adapter"]["targets"] == ["query_key_value"] and model["adapter"]["method"] == "lora"
    assert 0 < model["trainable_parameters"] < model["parameters"] / 50


def test_no_fit_names_the_adapters_that_would_fit():
    from planner.errors import NoFitError

    with pytest.raises(NoFitError) as err:
        plan("meta-llama/Llama-3.1-8B", 16, seq_len=1024, gpu="T4-16GB", offload=False)
    lever = next(lv for lv in err.value.levers if lv.kind == "adapters")
    text = next(s for s in err.value.suggestions if "Adapters" in s)
    # both sizes are said; only the one that fits is offered as flags
    assert "LoRA r=16" in text and "QLoRA r=16" in text and "which fits" in text
    assert lever.changes == {"peft": "qlora"} and text.endswith("(--peft qlora).")


def _tiny_mixtral():
    return transformers.MixtralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, num_local_experts=4, vocab_size=128)


def test_lora_over_fused_experts_defaults_to_no_dropout_and_keeps_a_given_one_elsewhere():
    """transformers 5 stores Mixtral's experts as 3D parameters; peft adapts them with a wrapper that refuses
    dropout, so the default all-linear targets get dropout 0, module targets keep 0.05, and a given dropout over
    fused parameters is an input error naming the flag."""
    from planner.models.adapters import DEFAULT_DROPOUT

    fused = resolve_model(_tiny_mixtral(), adapter=Adapter("lora")).adapter
    assert fused.dropout == 0 and {"gate_up_proj", "down_proj"} <= set(fused.fused_parameters)
    modules = resolve_model(_tiny_mixtral(), adapter=Adapter("lora", targets=("q_proj", "v_proj"))).adapter
    assert modules.dropout == DEFAULT_DROPOUT and modules.fused_parameters == ()
    dense = resolve_model("gpt2", adapter=Adapter("lora")).adapter
    assert dense.dropout == DEFAULT_DROPOUT and dense.fused_parameters == ()
    with pytest.raises(InputError) as err:
        resolve_model(_tiny_mixtral(), adapter=Adapter("lora", dropout=0.1))
    assert err.value.flag == "--lora-dropout"
    assert resolve_model(_tiny_mixtral(), adapter=Adapter("lora", dropout=0.0)).adapter.dropout == 0


def test_qlora_on_mixtral_plans_by_default_and_says_why_its_experts_stay_16_bit(tmp_path):
    p = plan(_tiny_mixtral(), 8, seq_len=128, gpu="A100-80GB", peft="qlora")
    kinds = {n.kind: n for n in p.notes}
    assert kinds["lora-fused-parameters"]["dropout"] == 0
    experts = kinds["qlora-16bit-experts"]
    spec = resolve_model(_tiny_mixtral()).spec
    assert experts["experts"] == spec.expert_parameters  # the fused experts, none of them in 4 bits
    emit(p, tmp_path)
    assert json.loads((tmp_path / "peft_config.json").read_text())["lora_config"]["lora_dropout"] == 0


def test_no_fit_advice_for_qlora_names_only_plans_trainplan_makes():
    """QLoRA is planned on one GPU or DDP: more GPUs with ZeRO-3 and offload are not advice for it; the reason
    its base is large (16-bit experts) is with the advice."""
    from planner.errors import NoFitError

    with pytest.raises(NoFitError) as err:
        plan("mixtral-8x7b", 16, seq_len=2048, gpu="H100-80GB", gpus_per_node=2, peft="qlora",
             lora_targets="q_proj,v_proj")
    kinds = [lever.kind for lever in err.value.levers]
    assert kinds[0] == "smallest" and not err.value.levers[0]["zero3"]
    assert not {"more-gpus", "offload", "offload-short", "offload-host", "offload-shorter-sequence"} & set(kinds)
    assert "qlora-16bit-experts" in {n.kind for n in err.value.plan.notes}
    with pytest.raises(NoFitError) as full:  # full fine-tuning on one card: grow the node to its usual 8 GPUs
        plan("meta-llama/Llama-3.1-8B", 16, seq_len=4096, gpu="A100-40GB", offload=False)
    more = next(lever for lever in full.value.levers if lever.kind == "more-gpus")
    assert (more["gpus"], more["per_node"], more["nodes"]) == (8, 8, 1)
    assert more.changes == {"gpus_per_node": 8}  # --nodes is already 1
    assert "(--gpus-per-node 8)." in next(s for s in full.value.suggestions if s.startswith("More GPUs"))
