"""Shared test setup: offline hub, a throwaway trainplan cache, GPU tests skipped without CUDA."""

import os
import tempfile

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRAINPLAN_CACHE"] = tempfile.mkdtemp(prefix="trainplan-test-cache-")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
