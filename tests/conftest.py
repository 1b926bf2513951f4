"""Shared fixtures: an isolated model cache and a tiny random Llama built in code."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch


def pytest_configure(config):
    sys.path.insert(0, str(Path(__file__).parent / "helpers"))  # test helper modules, by plain name
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Aliases build into a per-session cache, except the SmolLM2 one which is costly to rebuild."""
    if "COLORL_TEST_CACHE" not in os.environ:
        os.environ["COLORL_TEST_CACHE"] = str(tmp_path_factory.getbasetemp() / "colorl-cache")
    monkeypatch.setenv("COLORL_CACHE", os.environ["COLORL_TEST_CACHE"])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from colorl.models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real model (slow tests only); built once into the user's normal cache."""
    from colorl.models import SMOLLM2_ALIAS, ModelNotFound, resolve_model_path

    try:
        return resolve_model_path(SMOLLM2_ALIAS)
    except ModelNotFound as exc:
        pytest.skip(str(exc))
