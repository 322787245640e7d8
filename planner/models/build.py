"""Build a transformers model on the meta device from its config and read its exact sizes.

`torch.device("meta")` rather than `accelerate.init_empty_weights()`: the latter breaks weight tying
(bloom-560m counts 816,115,712 instead of 559,214,592).
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json

from planner.errors import InputError
from planner.models.adapters import apply_adapter, nf4_bytes
from planner.models.spec import ModelSpec
from planner.models.validate import text_config
from planner.vocab import CLASS_LABELS, EAGER, FLASH, NO_ADAPTER, SDPA, TASK, TOKEN_LABELS, task_of_class

# Auto classes tried, in order, when a config names no architecture.
_FALLBACK_AUTO = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM", "AutoModel")


def model_class(config, trust_remote_code: bool = False):
    """The head class named by `config.architectures[0]` (or an Auto class for remote code)."""
    import transformers

    arch = (getattr(config, "architectures", None) or [None])[0]
    auto_map = getattr(config, "auto_map", None) or {}
    if arch and hasattr(transformers, arch):
        return getattr(transformers, arch)
    if auto_map:
        if not trust_remote_code:
            raise InputError(
                f"this model's code is not part of transformers (auto_map: {sorted(auto_map)})",
                flag="--trust-remote-code",
                hint="Pass --trust-remote-code to run the model's own code, if you trust its author.",
            )
        for auto_name in _FALLBACK_AUTO:
            if auto_name in auto_map:
                return _AutoFromConfig(getattr(transformers, auto_name))
    for auto_name in _FALLBACK_AUTO:
        auto = getattr(transformers, auto_name)
        if type(config) in auto._model_mapping.keys():
            return _AutoFromConfig(auto)
    raise InputError(f"transformers has no model class for architecture {arch!r}", flag="--model",
                     hint="Upgrade transformers, or pass --trust-remote-code for a model with its own code.")


#: The transformers release whose `_from_config` takes `dtype=`; earlier ones take `torch_dtype=`
#: (transformers/modeling_utils.py `_from_config`: 4.55.4 line 2358 pops "torch_dtype", 4.56.0 line 2408 pops "dtype"
#: and keeps the old name only with a deprecation warning). pyproject.toml allows releases on both sides.
DTYPE_KEYWORD_SINCE = (4, 56)


def dtype_keyword(release: str | None = None) -> str:
    """The keyword `_from_config` takes a dtype by in transformers `release` (default: the installed one)."""
    from packaging.version import Version

    if release is None:
        import transformers

        release = transformers.__version__
    return "dtype" if Version(release).release[:2] >= DTYPE_KEYWORD_SINCE else "torch_dtype"


def _from_config_kwargs(config, dtype) -> dict:
    """`_from_config`'s keywords: the dtype, and the attention implementation the config was given, which
    transformers before 4.46 would otherwise reset to its own default (4.42.4 modeling_utils.py `_from_config`:
    `config._attn_implementation = kwargs.pop("attn_implementation", None)`; later releases keep the config's)."""
    kwargs = {dtype_keyword(): dtype}
    chosen = getattr(config, "_attn_implementation_internal", None)
    if isinstance(chosen, str):
        kwargs["attn_implementation"] = chosen
    return kwargs


class _AutoFromConfig:
    """Adapts an Auto class to the `cls._from_config(config, dtype=...)` call of concrete classes (`torch_dtype=`
    before transformers 4.56: `dtype_keyword`)."""

    def __init__(self, auto):
        self.auto = auto
        self.__name__ = auto.__name__

    def _from_config(self, config, **kwargs):
        return self.auto.from_config(config, trust_remote_code=True, **kwargs)


def build_meta(config, *, layers: int | None = None, trust_remote_code: bool = False, dtype=None, adapter=None,
               mixed_dtype=None):
    """The model on the meta device: no memory, exact shapes. `layers` builds a truncated copy; `adapter`
    (planner.models.adapters.Adapter) injects peft's LoRA, with frozen weights in `mixed_dtype` and trainable ones
    in fp32 when given (mixed precision)."""
    import torch

    cfg = with_layers(config, layers) if layers is not None else copy.deepcopy(config)
    cls = model_class(cfg, trust_remote_code)
    with torch.device("meta"):
        model = cls._from_config(cfg, **_from_config_kwargs(cfg, dtype or torch.float32))
        _untie_t5_v11_head(model, cfg)
        if adapter is not None:
            model = apply_adapter(model, adapter, task_of_class(type(model).__name__), mixed_dtype).get_base_model()
    return model


def _untie_t5_v11_head(model, config) -> None:
    """T5 v1.1 / flan-t5 checkpoints have their own lm_head (tie_word_embeddings: false in config.json).

    transformers 5 forces T5Config.tie_word_embeddings to True, remembers the original flag as
    `scale_decoder_outputs`, and unties only while loading a checkpoint that holds a separate head. A model
    built from the config alone would count flan-t5-base 24,674,304 parameters short; untie it here.
    """
    import torch

    if getattr(config, "scale_decoder_outputs", True) is not False:
        return
    head, embed = getattr(model, "lm_head", None), model.get_input_embeddings()
    if head is not None and embed is not None and head.weight is embed.weight:
        head.weight = torch.nn.Parameter(torch.empty_like(embed.weight))


#: The class attribute transformers sets where a model supports an attention implementation
#: (transformers/modeling_utils.py `PreTrainedModel._supports_sdpa` / `_supports_flash_attn`).
_SUPPORT_FLAG = {SDPA: "_supports_sdpa", FLASH: "_supports_flash_attn"}


def effective_attention(config, requested: str, trust_remote_code: bool = False) -> str:
    """The attention implementation the model will really use: SDPA falls back to eager for models without SDPA
    support (as transformers does); FlashAttention-2 on a model without it is an InputError."""
    flag = _SUPPORT_FLAG.get(requested)
    if flag is None:
        return requested
    cls = model_class(config, trust_remote_code)
    target = getattr(cls, "auto", cls)
    if getattr(target, flag, True):
        return requested
    if requested == FLASH:
        raise InputError(f"{getattr(target, '__name__', 'this model')} has no FlashAttention-2 support in this "
                         "transformers", flag="--attention", hint="Use --attention sdpa (or eager).")
    return EAGER


def _layer_keys(config) -> list[str]:
    if getattr(config, "is_encoder_decoder", False):
        keys = [k for k in ("num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers")
                if isinstance(getattr(config, k, None), int)]
        if keys:
            return keys
    return ["num_hidden_layers"]


def routed_expert_parameters(model) -> int:
    """Parameters of the routed experts: everything under a module named `experts` (transformers' MoE blocks name
    it so, whether it holds one module per expert, as DeepSeek's and Qwen-MoE's do, or fused 3-D tensors, as
    Mixtral's MixtralExperts in transformers 5 does), except shared experts, which every token runs."""
    total = 0
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "experts" and "shared" not in name:
            total += sum(p.numel() for p in module.parameters())
    return total


def moe_block_classes(model) -> list[type]:
    """The classes of the blocks that route tokens to experts (a module holding a child named `experts`)."""
    import torch

    return sorted({type(m) for m in model.modules() if isinstance(getattr(m, "experts", None), torch.nn.Module)},
                  key=lambda c: c.__name__)


def num_layers(config) -> int:
    keys = _layer_keys(config)
    if keys == ["num_hidden_layers"]:
        return int(config.num_hidden_layers)
    return sum(int(getattr(config, k)) for k in keys)


def with_layers(config, layers: int):
    """A copy of `config` with `layers` blocks (per stack for seq2seq); per-layer lists truncated."""
    cfg = copy.deepcopy(config)
    old = {k: int(getattr(cfg, k)) for k in _layer_keys(cfg)}
    for key in old:
        setattr(cfg, key, layers)
    for name, value in list(vars(cfg).items()):
        if isinstance(value, list) and value and len(value) in old.values() and name != "architectures":
            setattr(cfg, name, value[:layers])
    return cfg


def config_hash(config) -> str:
    data = config.to_dict()
    for volatile in ("transformers_version", "_name_or_path", "dtype", "torch_dtype"):
        data.pop(volatile, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _first(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _kv_heads(config, heads: int) -> int:
    if getattr(config, "num_key_value_heads", None):
        return int(config.num_key_value_heads)
    if getattr(config, "model_type", "") == "falcon":
        if getattr(config, "new_decoder_architecture", False):
            return int(config.num_kv_heads)
        return 1 if getattr(config, "multi_query", False) else heads
    return heads


def _position(config) -> str:
    if getattr(config, "alibi", False) or config.model_type in ("bloom", "mpt"):
        return "alibi"
    if config.model_type in ("t5", "mt5", "umt5", "longt5"):
        return "relative"
    if _first(config, "rope_theta", "rotary_dim", "rotary_pct", "rope_parameters", "rope_scaling") is not None:
        return "rope"
    return "learned"


def spec_from_model(model, config, *, name: str, source: str, adapter=None, quantized: int = 0) -> ModelSpec:
    """Counts from the (meta) module, shapes from the config; `adapter` (peft's LoRA in `model`), `quantized`: the
    weights QLoRA stores in 4 bits."""
    import torch

    text = text_config(config)
    params = list(model.parameters())
    total, trainable = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    hidden = int(_first(text, "hidden_size", "d_model", "n_embd"))
    heads = int(_first(text, "num_attention_heads", "n_head", "encoder_attention_heads"))
    max_pos = _first(text, "max_position_embeddings", "n_positions", "n_ctx")
    position = _position(text)
    if position in ("alibi", "relative"):
        max_pos = None
    default_seq = int(_first(text, "seq_length", default=512 if position == "relative" else 2048))
    seq_len = min(int(max_pos), default_seq) if max_pos else default_seq
    embed = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    gated = any(k in n for n in names for k in ("gate_proj", "wi_0", "gate_up_proj", ".w3", "fc1_g"))
    if not gated:
        gated = "glu" in str(_first(text, "feed_forward_proj", "ffn_type", default="")).lower()
    bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    return ModelSpec(
        name=name, source=source,
        architecture=type(model).__name__,
        model_type=str(getattr(config, "model_type", "custom")),
        parameters=total, trainable_parameters=trainable,
        layers=num_layers(text), hidden=hidden, heads=heads, kv_heads=_kv_heads(text, heads),
        ffn=int(_first(text, "intermediate_size", "n_inner", "d_ff", "ffn_dim", "encoder_ffn_dim", "ffn_hidden_size",
                       default=4 * hidden) or 4 * hidden),
        vocab=int(_first(text, "vocab_size", default=0)),
        tied_embeddings=bool(getattr(text, "tie_word_embeddings", True)),
        max_positions=int(max_pos) if max_pos else None, seq_len=seq_len,
        has_batchnorm=bn, is_encoder_decoder=bool(getattr(text, "is_encoder_decoder", False)),
        gated_mlp=gated,
        num_experts=int(_first(text, "num_local_experts", "num_experts", default=1) or 1),
        experts_per_token=int(_first(text, "num_experts_per_tok", "top_k", default=1) or 1),
        expert_parameters=routed_expert_parameters(model),
        largest_layer_parameters=largest, embedding_parameters=embed,
        tensor_sizes=tuple(p.numel() if p.requires_grad else -p.numel() for p in params),
        tensor_ndims=tuple(p.dim() for p in params),
        attention_dropout=float(_first(text, "attention_dropout", "attn_pdrop", "attention_probs_dropout_prob",
                                       "dropout_rate", default=0.0) or 0.0),
        hidden_dropout=float(_first(text, "hidden_dropout", "resid_pdrop", "hidden_dropout_prob", "dropout_rate",
                                    "dropout", default=0.0) or 0.0),
        position=position, config_hash=config_hash(config), causal_attention=causal_share(model),
        layer_class=str(sorted(getattr(model, "_no_split_modules", None) or [""])[0]),
        num_labels=_num_labels(model, config), **_adapter_fields(adapter, quantized), **_buffer_fields(model),
        float8_linears=float8_linears(model))


def float8_linears(model) -> tuple[tuple[int, int, int, int], ...]:
    """(in_features, out_features, converted, total) per nn.Linear shape, by accelerate's own default filter for its
    AO backend: both dimensions divisible by 16, and not the first or last linear (accelerate/utils/ao.py:32-69,
    :140-143)."""
    import torch
    from accelerate.utils.ao import filter_linear_layers, find_first_last_linear_layers

    first, last = find_first_last_linear_layers(model)
    counts: dict[tuple[int, int], tuple[int, int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            shape = (module.in_features, module.out_features)
            converted, total = counts.get(shape, (0, 0))
            counts[shape] = (converted + int(filter_linear_layers(module, name, [first, last])), total + 1)
    return tuple((i, o, c, t) for (i, o), (c, t) in sorted(counts.items()))


def causal_share(model) -> float:
    """The share of attention modules that attend causally, read from the `is_causal` flag transformers' attention
    classes carry (transformers/models/llama/modeling_llama.py `LlamaAttention`, bert/modeling_bert.py); 1.0 where no
    module says (a causal count is the smaller one: the FLOPs checks stay lower bounds)."""
    flags = [m.is_causal for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)]
    return sum(flags) / len(flags) if flags else 1.0


def _buffer_fields(model) -> dict:
    """The module's registered buffers for ModelSpec (a buffer shared by modules counts once)."""
    buffers = list({id(b): b for b in model.buffers()}.values())
    return {"float_buffer_elements": sum(b.numel() for b in buffers if b.is_floating_point()),
            "other_buffer_bytes": sum(b.numel() * b.element_size() for b in buffers if not b.is_floating_point())}


def _num_labels(model, config) -> int:
    """A classifier's labels (every config has `num_labels`, 2 by default, whatever its head)."""
    classifier = TASK[task_of_class(type(model).__name__)].labels in (CLASS_LABELS, TOKEN_LABELS)
    return int(getattr(config, "num_labels", 0) or 0) if classifier else 0


def _adapter_fields(adapter, quantized: int) -> dict:
    return {"adapter": adapter.method if adapter is not None else NO_ADAPTER, "quantized_parameters": quantized,
            "quantized_bytes": nf4_bytes(quantized, adapter.double_quant) if quantized else 0}


def samples_kept_apart(config, attention: str, trust_remote_code: bool = False) -> bool:
    """Whether the model keeps the samples of a packed or flattened row apart (position_ids restarting at each
    sample): FlashAttention-2 does by its varlen path (transformers/modeling_flash_attention_utils.py
    `_is_packed_sequence`); SDPA and eager do where the model builds its mask with transformers' masking utilities,
    which find packed sequences in the position_ids (transformers/masking_utils.py `find_packed_sequence_indices`)."""
    if attention == FLASH:
        return True
    if config is None:
        return False
    cls = model_class(config, trust_remote_code)
    module = inspect.getmodule(getattr(cls, "auto", cls))
    try:
        return module is not None and "create_causal_mask(" in inspect.getsource(module)
    except (OSError, TypeError):
        return False
