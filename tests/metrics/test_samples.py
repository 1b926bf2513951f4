"""The model's own words: samples decoded to RUN_DIR/samples.jsonl and on screen every run.log_samples_every steps."""
from __future__ import annotations

import pytest

import json
from pathlib import Path

from colorl.cli import main

HELPERS = str(Path(__file__).parents[1] / "helpers")
BASE = ["task.reward=reward_fns:digit_fraction", "rollout.batch_groups=4", "rollout.max_new_tokens=8"]


def _train(run_dir: Path, *sets: str) -> int:
    return main(["train", "configs/tiny.yaml", *(a for s in [*BASE, *sets] for a in ("--set", s)),
                 "--run-dir", str(run_dir)])


@pytest.mark.matrix
def test_samples_are_written_and_shown_every_n_steps(tmp_path, monkeypatch, capfd):
    monkeypatch.syspath_prepend(HELPERS)
    assert _train(tmp_path / "run", "run.steps=3", "run.log_samples_every=2") == 0
    out = capfd.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in records}) == [2, 3]  # every 2nd step, and the last
    group_size = 4
    assert len(records) == 2 * 2 * group_size  # two groups of each logged step, every sample
    for record in records:
        assert record["prompt"] and isinstance(record["completion"], str) and record["answer"]
        assert 0 <= record["reward"] <= 1 and record["finish_reason"] in ("stop", "length")
        assert record["tokens"] >= 1 and record["version"] in (1, 2)
    assert out.count("sample at step ") == 2 and ("best reward" in out or "sample reward" in out)


@pytest.mark.matrix
def test_no_samples_with_zero(tmp_path, monkeypatch, capfd):
    monkeypatch.syspath_prepend(HELPERS)
    assert _train(tmp_path / "run", "run.steps=1", "run.log_samples_every=0") == 0
    assert "sample at step" not in capfd.readouterr().out
    assert not (tmp_path / "run" / "samples.jsonl").exists()
