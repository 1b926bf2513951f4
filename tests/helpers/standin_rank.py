"""A rank whose `import sglang` finds the CPU stand-in (tests/engines/sglang_standin.py), so colorl's
SGLang adapter runs whole runs on CPU; spawned by tests/engines/test_conformance.py."""
import importlib.util
import sys
from pathlib import Path

import pytest

from colorl.doctor import checked_rank

STANDIN = Path(__file__).parents[1] / "engines" / "sglang_standin.py"


def load_standin():
    """The stand-in module, loaded once per process under the name its tests use."""
    if "sglang_standin" not in sys.modules:
        spec = importlib.util.spec_from_file_location("sglang_standin", STANDIN)
        module = importlib.util.module_from_spec(spec)
        sys.modules["sglang_standin"] = module
        spec.loader.exec_module(module)
    return sys.modules["sglang_standin"]


def sglang_standin_rank(rank, world, *args):
    load_standin().install(pytest.MonkeyPatch())  # this process only: undone when it exits
    checked_rank(rank, world, *args)
