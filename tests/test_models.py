"""Model sources -> ModelSpec: local folders, config.json paths, config objects, modules, offline errors."""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch
import transformers
from transformers import BertConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2MoeConfig

from planner.errors import InputError, ModelNotFoundError
from planner.models import resolve_model


def llama3_8b_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
    )


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       architectures=["LlamaForCausalLM"])


def test_llama3_8b_folder(tmp_path):
    llama3_8b_config().save_pretrained(tmp_path)
    spec = resolve_model(str(tmp_path)).spec
    assert spec.source == "folder"
    assert spec.parameters == 8_030_261_248
    assert spec.trainable_parameters == spec.parameters
    assert spec.architecture == "LlamaForCausalLM"
    assert spec.model_type == "llama"
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads) == (32, 4096, 32, 8)
    assert (spec.ffn, spec.vocab, spec.max_positions) == (14336, 128256, 8192)
    assert spec.head_dim == 128
    assert spec.tied_embeddings is False
    assert spec.gated_mlp is True
    assert spec.has_batchnorm is False
    assert spec.is_encoder_decoder is False
    assert spec.position == "rope"
    assert spec.embedding_parameters == 128256 * 4096  # input embedding only; lm_head is a Linear


def test_config_json_file_path(tmp_path):
    llama3_8b_config().save_pretrained(tmp_path)
    spec = resolve_model(str(tmp_path / "config.json")).spec
    assert spec.parameters == 8_030_261_248
    assert spec.source == "folder"


def test_pathlike_accepted(tmp_path):
    tiny_llama_config().save_pretrained(tmp_path)
    assert resolve_model(tmp_path).spec.source == "folder"


def test_mistral_default(tmp_path):
    MistralConfig().save_pretrained(tmp_path)
    spec = resolve_model(str(tmp_path)).spec
    assert spec.parameters == 7_241_732_096
    assert spec.kv_heads == 8
    assert spec.gated_mlp is True


def test_bert_large_sequence_classification(tmp_path):
    BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
               architectures=["BertForSequenceClassification"]).save_pretrained(tmp_path)
    spec = resolve_model(str(tmp_path)).spec
    assert spec.parameters == 335_143_938
    assert spec.architecture == "BertForSequenceClassification"
    assert spec.gated_mlp is False
    assert spec.has_batchnorm is False
    assert (spec.layers, spec.hidden, spec.heads, spec.ffn) == (24, 1024, 16, 4096)


def test_pretrained_config_object():
    spec = resolve_model(llama3_8b_config()).spec
    assert spec.source == "config"
    assert spec.parameters == 8_030_261_248


def test_meta_module():
    config = tiny_llama_config()
    with torch.device("meta"):
        module = LlamaForCausalLM(config)
    resolved = resolve_model(module)
    assert resolved.module is module
    assert resolved.spec.source == "module"
    assert resolved.spec.parameters == sum(p.numel() for p in module.parameters())
    assert resolved.spec.kv_heads == 2
    # the same count as building from the config
    assert resolve_model(config).spec.parameters == resolved.spec.parameters


def test_flan_t5_base_untied_head_vs_t5_small():
    flan = resolve_model("google/flan-t5-base").spec
    assert flan.parameters == 247_577_856
    assert flan.is_encoder_decoder is True
    assert flan.gated_mlp is True
    assert flan.layers == 24
    small = resolve_model("t5-small").spec
    assert small.parameters == 60_506_624
    assert small.gated_mlp is False
    assert small.position == "relative"
    assert small.max_positions is None


def test_folder_without_config(tmp_path):
    with pytest.raises(InputError) as info:
        resolve_model(str(tmp_path))
    assert info.value.flag == "--model"
    assert "config.json" in str(info.value)


@pytest.mark.parametrize("path", ["./no/such/model-folder", "/definitely/not/here", "~/no-such-trainplan-model/x"])
def test_nonexistent_path(path):
    with pytest.raises(InputError) as info:
        resolve_model(path)
    assert info.value.flag == "--model"


def test_empty_name():
    with pytest.raises(InputError) as info:
        resolve_model("  ")
    assert info.value.flag == "--model"


def test_wrong_type():
    with pytest.raises(InputError) as info:
        resolve_model(12345)
    assert info.value.flag == "--model"


def test_unknown_hub_id_offline_fails_fast():
    start = time.perf_counter()
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("nobody-trainplan/no-such-model-xyz")
    assert time.perf_counter() - start < 2.0
    assert isinstance(info.value, InputError)
    assert info.value.flag == "--model"
    assert "local folder" in str(info.value)


def test_auto_map_requires_trust_remote_code(tmp_path):
    config = tiny_llama_config().to_dict()
    config.update(model_type="llama", architectures=["MyCustomForCausalLM"],
                  auto_map={"AutoModelForCausalLM": "modeling_custom.MyCustomForCausalLM"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    sentinel = tmp_path / "remote-code-ran"
    (tmp_path / "modeling_custom.py").write_text(
        f"open({str(sentinel)!r}, 'w').write('ran')\nraise RuntimeError('remote code must not run')\n")
    with pytest.raises(InputError) as info:
        resolve_model(str(tmp_path))
    assert info.value.flag == "--trust-remote-code"
    assert not sentinel.exists()
    assert not any("modeling_custom" in name for name in sys.modules)


def test_mixtral_active_parameters_count_the_two_routed_experts():
    """transformers 5 fuses Mixtral's experts into 3-D tensors (MixtralExperts.gate_up_proj): found by the module's
    name, the active count is Mistral's published 12.9B of 46.7B."""
    spec = resolve_model("mistralai/Mixtral-8x7B-v0.1").spec
    assert spec.gated_mlp and spec.num_experts == 8 and spec.experts_per_token == 2
    assert spec.active_parameters == pytest.approx(12.9e9, rel=0.01)
    assert spec.parameters == pytest.approx(46.7e9, rel=0.01)


def test_shared_experts_stay_active(tmp_path):
    config = Qwen2MoeConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            shared_expert_intermediate_size=96, num_experts=8, num_experts_per_tok=2,
                            num_attention_heads=4, num_key_value_heads=4, vocab_size=100,
                            architectures=["Qwen2MoeForCausalLM"])
    config.save_pretrained(tmp_path)
    spec = resolve_model(str(tmp_path)).spec
    routed = 2 * 8 * 3 * 64 * 32  # layers x experts x (gate, up, down) x hidden x expert width
    assert spec.expert_parameters == routed
    assert spec.parameters - spec.active_parameters == routed * 6 // 8  # the shared expert is not among them


def test_moe_blocks_become_zero3_leaves(tmp_path):
    """ZeRO-3 cannot prefetch experts that run in a data-dependent order: prepare() marks each MoE block a leaf."""
    from deepspeed.utils.z3_leaf_module import z3_leaf_module

    from planner.models.build import moe_block_classes
    from planner.prepare import _moe_leaves

    config = Qwen2MoeConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            shared_expert_intermediate_size=96, num_experts=8, num_experts_per_tok=2,
                            num_attention_heads=4, num_key_value_heads=4, vocab_size=100)
    model = transformers.Qwen2MoeForCausalLM(config)
    assert [c.__name__ for c in moe_block_classes(model)] == ["Qwen2MoeSparseMoeBlock"]
    _moe_leaves(model)
    assert all(z3_leaf_module(layer.mlp) for layer in model.model.layers)


@pytest.mark.parametrize("release, keyword", [("4.46.3", "torch_dtype"), ("4.55.4", "torch_dtype"),
                                              ("4.56.0.dev0", "dtype"), ("4.56.0", "dtype"), ("5.24.0", "dtype")])
def test_dtype_keyword_follows_the_release(release, keyword):
    """transformers before 4.56 takes `_from_config(config, torch_dtype=...)`; pyproject.toml allows them."""
    from planner.models.build import dtype_keyword

    assert dtype_keyword(release) == keyword
    assert dtype_keyword() == dtype_keyword(transformers.__version__)


def test_meta_build_passes_the_dtype_by_the_installed_keyword(monkeypatch):
    """The meta build hands the dtype by the keyword `dtype_keyword` names, and the model comes out in it."""
    from planner.models import build

    seen = []
    real = LlamaForCausalLM._from_config.__func__

    def spy(cls, config, **kwargs):
        seen.append(sorted(kwargs))
        return real(cls, config, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "_from_config", classmethod(spy))
    monkeypatch.setattr(build, "dtype_keyword", lambda: "torch_dtype")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=256, architectures=["LlamaForCausalLM"])
    model = build.build_meta(config, dtype=torch.bfloat16)
    assert seen == [["torch_dtype"]]
    assert next(model.parameters()).dtype == torch.bfloat16


def test_from_config_keeps_the_attention_the_config_was_given():
    """transformers before 4.46 resets `_attn_implementation` unless `_from_config` is handed it."""
    from planner.models.build import _from_config_kwargs, dtype_keyword

    config = tiny_llama_config()
    assert _from_config_kwargs(config, torch.float32) == {dtype_keyword(): torch.float32}
    config._attn_implementation = "eager"
    assert _from_config_kwargs(config, torch.bfloat16) == {dtype_keyword(): torch.bfloat16,
                                                           "attn_implementation": "eager"}
