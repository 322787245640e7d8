"""Model sources -> `ModelSpec`.

Resolution order for a string: a local folder (or config.json file); a hub id already in the local
HF cache; a bundled preset; the hub itself, only when online. Library callers may also pass a
`PretrainedConfig` or a transformers `nn.Module`. Remote code runs only with trust_remote_code.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from planner.errors import InputError, ModelNotFoundError
from planner.models.adapters import quantized_linear_numel, with_task
from planner.models.build import build_meta, spec_from_model
from planner.models.presets import close_names, find_preset, find_variant, presets
from planner.models.spec import ModelSpec
from planner.models.validate import check_config
from planner.vocab import AUTO, task_of_class

__all__ = ["ModelSpec", "ResolvedModel", "resolve_model", "trained_as", "presets"]

_HUB_HOST = ("huggingface.co", 443)
_HUB_PROBE_TIMEOUT_S = 1.5


@dataclass(frozen=True)
class ResolvedModel:
    """The config to build from (None for a bare module), the spec, and the module when given one."""

    spec: ModelSpec
    config: Any
    module: Any = None
    trust_remote_code: bool = False
    adapter: Any = None          # planner.models.adapters.Adapter: LoRA / QLoRA trained over the frozen model
    variant_of: str | None = None  # the preset a fine-tuned variant's name was planned as (presets.find_variant)


def resolve_model(source, *, trust_remote_code: bool = False, task: str | None = None, num_labels: int | None = None,
                  adapter=None) -> ResolvedModel:
    """The model to plan for. `task` (`vocab.TASK_CHOICES`) and `num_labels` replace the config's head; `adapter`
    (planner.models.adapters.Adapter) trains LoRA / QLoRA adapters over the frozen model instead of all of it."""
    from transformers import PretrainedConfig

    if isinstance(source, ResolvedModel):
        return source
    changes = (task not in (None, AUTO)) or num_labels is not None or adapter is not None
    if _is_module(source):
        if changes:
            raise InputError("a model passed as a module is planned as it is", flag="--task",
                             hint="Pass its config to plan another head or adapters, or apply them to the module.")
        return _from_module(source)
    if isinstance(source, PretrainedConfig):
        name = getattr(source, "_name_or_path", "") or source.model_type
        resolved = _from_config(source, name=name, origin="config", trust=trust_remote_code)
    elif isinstance(source, (str, os.PathLike)):
        resolved = _from_string(str(source), trust_remote_code)
    else:
        raise InputError(f"cannot read a model from a {type(source).__name__}", flag="--model",
                         hint="Pass a hub id, a folder with config.json, a PretrainedConfig or a transformers model.")
    return trained_as(resolved, task, num_labels, adapter) if changes else resolved


def trained_as(resolved: ResolvedModel, task=None, num_labels=None, adapter=None) -> ResolvedModel:
    """The resolved model with another head and/or adapters, counted on the meta model peft builds."""

    config, trust = with_task(resolved.config, task, num_labels), resolved.trust_remote_code
    quantized = 0
    if adapter is not None:
        base = build_meta(config, trust_remote_code=trust)
        adapter = adapter.for_model(base, task_of_class(type(base).__name__))
        # bitsandbytes converts the base's own linears: counted on the model before peft wraps them
        quantized = quantized_linear_numel(base) if adapter.quantized else 0
    model = build_meta(config, trust_remote_code=trust, adapter=adapter)
    spec = spec_from_model(model, config, name=resolved.spec.name, source=resolved.spec.source, adapter=adapter,
                           quantized=quantized)
    return ResolvedModel(spec=spec, config=config, trust_remote_code=resolved.trust_remote_code, adapter=adapter,
                         variant_of=resolved.variant_of)


def _is_module(obj) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return isinstance(obj, torch.nn.Module)


def _from_module(module) -> ResolvedModel:
    config = getattr(module, "config", None)
    if config is None:
        raise InputError("this nn.Module has no transformers config", flag="--model",
                         hint="Pass a transformers model (it carries .config) or its PretrainedConfig.")
    name = getattr(config, "_name_or_path", "") or type(module).__name__
    spec = spec_from_model(module, config, name=name, source="module")
    return ResolvedModel(spec=spec, config=config, module=module)


def _from_config(config, *, name: str, origin: str, trust: bool) -> ResolvedModel:
    check_config(config, name)
    try:
        model = build_meta(config, trust_remote_code=trust)
    except InputError:
        raise
    except Exception as err:  # noqa: BLE001 - a config transformers cannot build from is bad input
        raise InputError(f"transformers cannot build {name} from its config: {type(err).__name__}: "
                         f"{str(err).splitlines()[0][:200] if str(err) else ''}", flag="--model",
                         hint="Check config.json against the model's documented fields.") from err
    spec = spec_from_model(model, config, name=name, source=origin)
    return ResolvedModel(spec=spec, config=config, trust_remote_code=trust)


def _looks_like_path(text: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else with slashes, or starting ./ / ~, is a path."""
    return text.startswith((".", "/", "~")) or text.count("/") > 1 or "\\" in text


def _from_string(text: str, trust: bool) -> ResolvedModel:
    text = text.strip()
    if not text:
        raise InputError("empty model name", flag="--model", hint=_how_to_pass())
    path = Path(text).expanduser()
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InputError(f"{path} has no config.json", flag="--model",
                             hint="Pass the folder that holds the model's config.json.")
        return _from_config(_load_config(str(path), trust), name=str(path), origin="folder", trust=trust)
    if _looks_like_path(text) and not path.exists():
        raise InputError(f"no such folder: {text}", flag="--model", hint=_how_to_pass())
    cached = _cached_config_dir(text)
    if cached:
        return _from_config(_load_config(cached, trust), name=text, origin="hf-cache", trust=trust)
    preset = find_preset(text)
    if preset:
        return _from_config(_preset_config(preset.config, trust), name=preset.id, origin="preset", trust=trust)
    if _hub_reachable():
        return _from_config(_load_config(text, trust), name=text, origin="hub", trust=trust)
    variant = find_variant(text)
    if variant:  # a fine-tune of a preset: its base's architecture, under the name asked for
        resolved = _from_config(_preset_config(variant.config, trust), name=text, origin="preset", trust=trust)
        return replace(resolved, variant_of=variant.id)
    close = close_names(text)
    raise ModelNotFoundError(f"{text!r} is not a local folder, not in the HF cache and not a bundled preset, "
                             "and the hub is offline", flag="--model",
                             hint=(f"Did you mean {' or '.join(close)}? " if close else "") + _how_to_pass())


def _how_to_pass() -> str:
    return ("Pass a local folder with config.json (e.g. --model ./my-model), "
            "or a bundled preset (plan --list-models shows them).")


def _cached_config_dir(repo_id: str) -> str | None:
    if repo_id.count("/") > 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # invalid repo id syntax and the like: simply not cached
        return None
    return str(Path(found).parent) if isinstance(found, str) else None


def _hub_reachable() -> bool:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False"):
        return False
    try:
        with socket.create_connection(_HUB_HOST, timeout=_HUB_PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def _load_config(where: str, trust: bool):
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    _check_json(where)
    try:
        return AutoConfig.from_pretrained(where, trust_remote_code=trust)
    except ValueError as err:
        if "trust_remote_code" in str(err):
            raise InputError("this model's config needs its own code", flag="--trust-remote-code",
                             hint="Pass --trust-remote-code to run it, if you trust its author.") from err
        raise InputError(f"cannot read the config of {where}: {_one_line(err)}", flag="--model") from err
    except OSError as err:
        raise ModelNotFoundError(f"cannot load {where}: {_one_line(err)}", flag="--model",
                                 hint=_how_to_pass()) from err
    # a field transformers rejects, or that breaks its own checks (0 attention heads: a modulo by zero)
    except (StrictDataclassError, TypeError, KeyError, AttributeError, ArithmeticError) as err:
        raise InputError(f"cannot read the config of {where}: {_one_line(err)}", flag="--model",
                         hint="Fix the value in config.json.") from err


def _one_line(err: BaseException) -> str:
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return text[:300] if text else type(err).__name__


def _check_json(where: str) -> None:
    """A local config.json must hold a JSON object (transformers fails obscurely on null or a list)."""
    path = Path(where) / "config.json"
    if not path.is_file():
        return
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"{path} is not valid JSON: {err}", flag="--model") from err
    if not isinstance(data, dict):
        kind = "null" if data is None else type(data).__name__
        raise InputError(f"{path} holds a JSON {kind}, not an object of config fields",
                         flag="--model", hint="config.json must be a JSON object such as {\"model_type\": ...}.")


def _preset_config(data: dict, trust: bool):
    from transformers import CONFIG_MAPPING

    if data.get("model_type") not in CONFIG_MAPPING:
        raise InputError(f"this transformers has no model type {data.get('model_type')!r}", flag="--model",
                         hint="Upgrade transformers to use this preset.")
    return CONFIG_MAPPING[data["model_type"]].from_dict(data)
