"""Multi-turn episodes through whole two-rank runs of each mode (gloo, the tiny model, scripted environments).

The scripted environments (tests/helpers/scripted_envs.py) answer two model messages with a tool
result and score the third; the misbehaving ones misbehave on problems with an odd answer, so
faulty and healthy episodes share every step.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from colorl.cli import main

pytestmark = pytest.mark.matrix  # whole multi-turn runs: make test-matrix

HELPERS = str(Path(__file__).resolve().parents[1] / "helpers")
BASE = ["run.steps=3", "rollout.batch_groups=4", "rollout.max_new_tokens=6", "task.max_turns=4",
        "task.episode_tokens=400"]


def _run(tmp_path: Path, sets: list[str]) -> list[dict]:
    run_dir = tmp_path / "run"
    argv = ["train", "configs/tiny.yaml", "--nproc=2", "--run-dir", str(run_dir)]
    assert main(argv + [a for s in BASE + sets for a in ("--set", s)]) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_colocated_episodes_train_and_a_faulty_environment_ends_only_its_episodes(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(HELPERS)
    lines = _run(tmp_path, ["task.env=scripted_envs:RaisingEnv", "run.eval_every=3", "run.eval_prompts=4"])
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert lines[-1]["eval_accuracy"] is not None and lines[-1]["eval_tool_use_frac"] == 0.0  # held-out episodes
    assert "eval_tool_use_frac step=0" in (tmp_path / "run" / "events.log").read_text()
    assert sum(r["env_errors"] for r in lines) > 0  # odd answers: the tool raised, reward 0, counted
    assert min(r["episode_turns_mean"] for r in lines) < 3  # healthy episodes take 3 model messages, faulty ones 1
    for r in lines:
        assert 1 <= r["episode_turns_mean"] <= 3
        assert r["staleness_max"] == 0 and r["env_timeouts"] == 0 and r["episodes_truncated"] == 0
        assert r["episode_len_mean"] > r["response_len_mean"] > 0  # tool results are in the episode, not trained
        assert r["trained_tokens"] > 0
    assert max(r["grad_norm"] for r in lines) > 0  # a step whose groups all faulted has no signal


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_bounded_lag_bounds_the_staleness_of_whole_episodes(tmp_path, monkeypatch, kv):
    monkeypatch.syspath_prepend(HELPERS)
    lines = _run(tmp_path, ["mode=bounded_lag", "staleness.max=1", f"staleness.partial_rollout={kv}",
                            "task.env=scripted_envs:SlowToolEnv", "run.steps=4"])
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    assert max(r["staleness_max"] for r in lines) <= 1
    assert max(r["staleness_max"] for r in lines[1:]) == 1  # the overlap did run episodes across versions
    for r in lines:
        assert r["episode_turns_mean"] == 3 and r["env_errors"] == 0 and r["episodes_truncated"] == 0
        assert 0 <= r["engine_env_wait_frac"] <= 1
    assert max(r["env_s_per_episode"] for r in lines) > 0.1  # odd answers: 0.3 s per tool step
