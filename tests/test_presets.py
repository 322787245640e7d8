"""Every bundled preset builds on the meta device and matches its published parameter count."""

from __future__ import annotations

import pytest

from planner.models import resolve_model
from planner.models.presets import find_preset, presets

PRESETS = presets()


def published_tolerance(figure: int) -> int:
    """Half a unit of the last significant digit: 331,000,000 -> 500,000; 7,000,000,000 -> 500,000,000."""
    unit = 1
    while figure and figure % 10 == 0:
        figure //= 10
        unit *= 10
    return unit // 2


def test_tolerance_helper():
    assert published_tolerance(331_000_000) == 500_000
    assert published_tolerance(7_000_000_000) == 500_000_000
    assert published_tolerance(60_500_000) == 50_000
    assert published_tolerance(124_439_808) == 0


@pytest.mark.parametrize("preset", PRESETS, ids=[p.id for p in PRESETS])
def test_preset_parameter_count(preset):
    spec = resolve_model(preset.id).spec
    assert spec.source == "preset"
    assert spec.name == preset.id
    if preset.published_parameters_exact:
        assert spec.parameters == preset.published_parameters
    else:
        tol = published_tolerance(preset.published_parameters)
        assert abs(spec.parameters - preset.published_parameters) <= tol, (
            f"{preset.id}: built {spec.parameters:,}, published {preset.published_parameters:,} (±{tol:,})")


def test_catalog_size():
    assert len(PRESETS) >= 30


@pytest.mark.parametrize("preset", PRESETS, ids=[p.id for p in PRESETS])
def test_preset_has_sources(preset):
    assert preset.source.strip().startswith("http")
    assert preset.parameters_source.strip()
    assert preset.config.get("model_type")


def test_ids_and_aliases_unique():
    names = [p.id.lower() for p in PRESETS] + [a.lower() for p in PRESETS for a in p.aliases]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    assert not duplicates


def test_aliases_resolve_to_their_preset():
    for p in PRESETS:
        assert find_preset(p.id) == p
        assert find_preset(p.id.upper()) == p
        for alias in p.aliases:
            assert find_preset(alias) == p, alias


REQUIRED = [
    "openai-community/gpt2", "openai-community/gpt2-medium", "openai-community/gpt2-large", "openai-community/gpt2-xl",
    "bigscience/bloom-560m", "bigscience/bloom-1b1", "bigscience/bloom-1b7", "bigscience/bloom-3b",
    "bigscience/bloom-7b1",
    "meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-13b-hf", "meta-llama/Llama-2-70b-hf",
    "meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-70B",
    "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-405B",
    "meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-3B",
    "mistralai/Mistral-7B-v0.1", "mistralai/Mixtral-8x7B-v0.1",
    "Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-3B", "Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-14B",
    "Qwen/Qwen2.5-32B", "Qwen/Qwen2.5-72B",
    "microsoft/phi-2",
]
REQUIRED_FAMILIES = {  # prefix of the lower-cased id -> what must be there
    "microsoft/phi-3": "Phi-3", "google/gemma-2-": "gemma-2", "tiiuae/falcon": "falcon",
    "google-bert/bert-base": "bert base", "google-bert/bert-large": "bert large",
    "facebookai/roberta": "roberta", "google-t5/t5-": "t5",
}


@pytest.mark.parametrize("model_id", REQUIRED)
def test_required_preset_present(model_id):
    assert model_id in {p.id for p in PRESETS}


@pytest.mark.parametrize("prefix", sorted(REQUIRED_FAMILIES))
def test_required_family_present(prefix):
    assert any(p.id.lower().startswith(prefix) for p in PRESETS), REQUIRED_FAMILIES[prefix]
