"""A model config checked before anything is built from it: the sizes a plan depends on must be positive integers
that fit together. A config is user input, so a bad one is an InputError naming the field, never a crash."""

from __future__ import annotations

import math

from planner.errors import InputError

#: Sizes checked, each as the attribute names configs spell it in, and the largest value taken as sane.
SIZES = {
    "hidden size": (("hidden_size", "d_model", "n_embd"), 2**20),
    "attention heads": (("num_attention_heads", "n_head", "encoder_attention_heads"), 2**14),
    "layers": (("num_hidden_layers", "num_layers", "n_layer", "encoder_layers"), 2**14),
    "vocabulary size": (("vocab_size",), 2**26),
}
OPTIONAL = {"intermediate size": (("intermediate_size", "n_inner", "d_ff", "ffn_dim"), 2**24),
            "key/value heads": (("num_key_value_heads",), 2**14), "head size": (("head_dim",), 2**16),
            "positions": (("max_position_embeddings", "n_positions", "n_ctx"), 2**31)}


def text_config(config):
    """The config of a model's text part (a multimodal config's text model), or the config itself; transformers
    before 4.45 has no `get_text_config` (pyproject.toml allows 4.46, and the published-memory benchmark traces
    older releases)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_config(config, where: str) -> None:
    """Raise InputError (flag --model) for a config whose sizes are missing, not positive integers, or do not fit
    together (a hidden size the heads do not divide, key/value heads that do not divide the heads), or whose
    `architectures` is not a list of class names."""
    architectures = getattr(config, "architectures", None)
    if architectures is not None and not (isinstance(architectures, list)
                                          and all(isinstance(a, str) and a for a in architectures)):
        raise InputError(f"{where}: architectures must be a list of class names, got {architectures!r}",
                         flag="--model", hint='Fix it in config.json, e.g. "architectures": ["LlamaForCausalLM"].')
    _check_sizes(text_config(config), where)


def _check_sizes(text, where: str) -> None:
    """check_config's sizes, read from the text part of the config."""
    values = {}
    for what, (names, limit) in {**SIZES, **OPTIONAL}.items():
        name = next((n for n in names if getattr(text, n, None) is not None), None)
        if name is None:
            if what in SIZES:
                raise InputError(f"{where}: the config has no {what} ({' / '.join(names)})", flag="--model")
            continue
        values[what] = _positive_int(getattr(text, name), name, limit, where)
    heads, kv_heads = values["attention heads"], values.get("key/value heads")
    if "head size" not in values and values["hidden size"] % heads:
        raise InputError(f"{where}: hidden size {values['hidden size']} is not divisible by {heads} attention heads",
                         flag="--model", hint="Fix hidden_size or num_attention_heads in config.json.")
    if kv_heads is not None and heads % kv_heads:  # grouped-query attention: each key/value head serves a whole group
        raise InputError(f"{where}: {heads} attention heads are not divisible by {kv_heads} key/value heads",
                         flag="--model", hint="Fix num_attention_heads or num_key_value_heads in config.json.")


def _positive_int(value, name: str, limit: int, where: str) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        ok, value = True, int(value)
    if not ok or not 1 <= value <= limit:
        raise InputError(f"{where}: {name} must be an integer from 1 to {limit:,}, got {value!r}", flag="--model",
                         hint="Fix the value in config.json.")
    return value
