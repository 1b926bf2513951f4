"""tests/faults shares `drill` (real fault runs) with bench/faults.py; a reference run is built once."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import drill  # noqa: E402


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Path:
    """The uninterrupted run every drill's resume is compared with."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    drill.run_clean(run_dir)
    return run_dir


@pytest.fixture(scope="session")
def reference_bounded_lag(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("reference-bounded-lag") / "run"
    drill.run_clean(run_dir, ["mode=bounded_lag"])
    return run_dir
