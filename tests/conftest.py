"""Shared test setup: offline hub, a throwaway trainplan cache, GPU tests skipped without CUDA."""

import os
import tempfile

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRAINPLAN_CACHE"] = tempfile.mkdtemp(prefix="trainplan-test-cache-")


def pytest_collection_modifyitems(config, items):
    """Without -m, the checks marked `long` are left out (.ci/run runs them with `pytest -m long`); without CUDA the
    `gpu` tests skip."""
    import torch

    if not config.option.markexpr:
        kept = [item for item in items if "long" not in item.keywords]
        config.hook.pytest_deselected(items=[item for item in items if "long" in item.keywords])
        items[:] = kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def liger_treated_as_absent(monkeypatch):
    """`--liger auto` weighs Liger-Kernel only where liger-kernel is installed; the suite treats it as absent so that
    it gives the same answers with and without the extra. Tests of the installed case patch it back
    (tests/test_liger.py); `--liger on` plans it either way."""
    monkeypatch.setattr("planner.program.liger._not_installed",
                        lambda: "liger-kernel is treated as absent by the tests (tests/conftest.py)")


@pytest.fixture(autouse=True)
def torchao_treated_as_absent(monkeypatch):
    """`--precision auto` weighs fp8 only where torchao is installed; as for Liger, the suite treats it as absent
    (tests of the installed case patch it back); `--precision fp8` plans it either way."""
    monkeypatch.setattr("planner.planning.torchao_missing",
                        lambda: "torchao is treated as absent by the tests (tests/conftest.py)")
