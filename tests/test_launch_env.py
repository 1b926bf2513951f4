"""What a CPU rank runs with, whatever the CPU: MKL's results independent of buffer alignment, so a resumed
run computes what the uninterrupted run did (on a Xeon, whose fp32 race picks MKL, one resume in two
differed before)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

HELPERS = str(Path(__file__).parent / "helpers")


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch has no MKL")
def test_cpu_ranks_run_mkl_reproducibly(tmp_path, monkeypatch):
    from colorl.launch import launch

    monkeypatch.syspath_prepend(HELPERS)
    monkeypatch.delenv("MKL_CBWR", raising=False)
    from rank_probe import MKL_CBWR_STRICT, mkl_reproducibility

    assert launch(mkl_reproducibility, 2, "cpu", (str(tmp_path),)) is None
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text())["cbwr"] & MKL_CBWR_STRICT
