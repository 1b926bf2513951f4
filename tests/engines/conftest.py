"""Fixtures of the native engine's compiled-loop tests."""
from __future__ import annotations

import os
import platform
import shutil
import sys

import pytest

from colorl.engines.native import cpu_decode

# where the loops must build: Linux on x86 with GCC (CI's machines); elsewhere a missing build skips, with its reason
EXPECTS_LOOPS = (sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")
                 and shutil.which(os.environ.get("CC") or "cc") is not None and "COLORL_CPU_DECODE" not in os.environ)


@pytest.fixture(scope="module")
def compiled():
    library = cpu_decode.load()
    if library is None:
        assert not EXPECTS_LOOPS, f"the decode loops did not build here: {cpu_decode.why_not()}"
        pytest.skip(f"the decode loops are not used here: {cpu_decode.why_not()}")
    return library
