"""Shared fixtures: an isolated model cache and a tiny random Llama built in code."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch


# The verdicts the suite runs with unless a lane sets others (Makefile: test-avx2, test-torch-kernels): forced,
# not raced, so that what a test sees does not depend on the CPU it runs on or on how busy it is. The races
# themselves are tested directly (tests/test_kernels.py, tests/test_verdicts.py, tests/engines/test_cpu_decode.py).
DEFAULT_VERDICTS = {"COLORL_ONEDNN": "1", "COLORL_CPU_DECODE_ROWS": "all", "COLORL_CPU_DECODE_PANEL_ROWS": "all",
                    "COLORL_CPU_DECODE_ASK": "nta", "COLORL_BF16": "0"}


def pytest_configure(config):
    sys.path.insert(0, str(Path(__file__).parent / "helpers"))  # test helper modules, by plain name
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name, value in DEFAULT_VERDICTS.items():
        os.environ.setdefault(name, value)
    # the session's own colorl cache, set before any fixture (a module fixture builds the compiled loops):
    # a test never reads or writes the user's ~/.cache/colorl
    if "COLORL_TEST_CACHE" not in os.environ:
        os.environ["COLORL_TEST_CACHE"] = tempfile.mkdtemp(prefix="colorl-test-cache-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop("COLORL_TEST_CACHE"), ignore_errors=True))
    os.environ["COLORL_CACHE"] = os.environ["COLORL_TEST_CACHE"]
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_sessionstart(session):
    """The machine and the kernels this session computes with, before any test (with -q too): a failing CI
    names both."""
    from colorl.engines.native.kernel_report import kernel_lines

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for line in kernel_lines():
        (reporter.write_line if reporter else print)(f"colorl kernels: {line}")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_cache(monkeypatch):
    """Each test starts in the session's cache (a test that moved it is undone by its monkeypatch)."""
    monkeypatch.setenv("COLORL_CACHE", os.environ["COLORL_TEST_CACHE"])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from colorl.models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_dir(request):
    """The real model (slow tests only), converted once into pytest's own cache folder of this checkout
    (.pytest_cache), never into the user's ~/.cache/colorl."""
    from colorl.models import SMOLLM2_ALIAS, ModelNotFound, resolve_model_path

    folder = request.config.cache.mkdir("colorl-models") if request.config.cache else None
    previous = os.environ["COLORL_CACHE"]
    os.environ["COLORL_CACHE"] = str(folder or previous)
    try:
        return resolve_model_path(SMOLLM2_ALIAS)
    except ModelNotFound as exc:
        pytest.skip(str(exc))
    finally:
        os.environ["COLORL_CACHE"] = previous
