"""Ranks whose `import sglang` / `import vllm` finds a CPU stand-in (tests/engines/sglang_standin.py,
tests/engines/vllm_standin.py), so colorl's adapters run whole runs on CPU; spawned by
tests/engines/test_conformance.py."""
import importlib.util
import sys
from pathlib import Path

import pytest

from colorl.doctor import checked_rank

ENGINES = Path(__file__).parents[1] / "engines"


def load_standin(name: str = "sglang_standin"):
    """The stand-in module, loaded once per process under the name its tests use."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ENGINES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def sglang_standin_rank(rank, world, *args):
    load_standin().install(pytest.MonkeyPatch())  # this process only: undone when it exits
    checked_rank(rank, world, *args)


def vllm_standin_rank(rank, world, *args):
    """Meant to run under the device-placement recorder (device_recorder.on_own_gpu): the stand-in
    plays vLLM's CUDA build, so colorl's adapter takes its CUDA branch."""
    load_standin("vllm_standin").install(pytest.MonkeyPatch())
    checked_rank(rank, world, *args)
