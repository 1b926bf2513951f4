"""The episodes' panel tells what happened: how many were truncated and by what (max turns or the token
caps), the tool errors and the environment's faults, next to tool use (colorl/modes/step_metrics.py,
colorl/metrics/display.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from colorl.cli import main
from colorl.config import EngineConfig
from colorl.engines.base import GenerationRequest, SamplingParams
from colorl.engines.native.engine import NativeEngine
from colorl.metrics.display import Display
from colorl.modes.step_metrics import episode_metrics
from colorl.rollout.episodes import EpisodeSetup, Rollouts
from colorl.rollout.types import Group
from colorl.tasks.base import Problem

HELPERS = str(Path(__file__).resolve().parents[1] / "helpers")
sys.path.insert(0, HELPERS)
import scripted_envs  # noqa: E402

EVEN, ODD = Problem("What is 2 + 2?", "4"), Problem("What is 2 + 3?", "5")  # ToolErrorEnv never ends on odd answers


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return NativeEngine(tiny_model_dir, EngineConfig(num_blocks=256, block_size=4, max_num_seqs=8))


def _episodes(engine, env, problems: list[Problem], **limits) -> list:
    from colorl.models import build_tokenizer

    setup = EpisodeSetup(env, build_tokenizer(), **{"max_turns": 4, "turn_tokens": 6, "episode_tokens": 400,
                                                    "timeout_s": 5.0, **limits})
    rollouts = Rollouts(engine, setup)
    try:
        return rollouts.generate([(GenerationRequest(f"{i}:0", [1], SamplingParams(max_new_tokens=6, seed=i)), p)
                                  for i, p in enumerate(problems)])
    finally:
        rollouts.close()


def test_truncations_by_cause_and_tool_errors_are_measured_and_shown(engine, capsys):
    ended, by_turns = _episodes(engine, scripted_envs.ToolErrorEnv, [EVEN, ODD])
    (by_tokens,) = _episodes(engine, scripted_envs.NeverDoneEnv, [EVEN], max_turns=50, episode_tokens=60)
    assert ended.episode.truncated is None and ended.episode.tool_errors == 2  # two tool turns, then the end
    assert by_turns.episode.truncated == "max_turns" and by_turns.episode.tool_errors == 4
    assert by_tokens.episode.truncated == "tokens"

    groups = [Group(EVEN, [ended, by_turns], [1.0, 0.0]), Group(EVEN, [by_tokens], [0.0])]
    metrics = episode_metrics(groups, env_wait_s=0.0, rollout_wall_s=1.0)
    assert metrics["episodes"] == 3 and metrics["episodes_truncated"] == 2
    assert metrics["episodes_truncated_frac"] == pytest.approx(2 / 3)
    assert metrics["truncated_max_turns_frac"] == metrics["truncated_tokens_frac"] == pytest.approx(1 / 3)
    assert metrics["tool_errors"] == 6 and metrics["tool_errors_per_episode"] == 2.0
    assert metrics["env_faults"] == 0 and 0 <= metrics["turns_cut_frac"] <= 1

    display = Display(5, 0, "t", enabled=True, episodes=True)
    display.step_done({"step": 1, **metrics})
    line = capsys.readouterr().out
    assert "truncated=67% (max turns 33%, tokens 33%)" in line
    assert "tool_errors=6 (2.0/episode)" in line and "env_faults=0 (errors 0, timeouts 0)" in line


@pytest.mark.matrix
def test_a_run_whose_episodes_are_cut_off_and_whose_tools_fail_says_so(tmp_path, monkeypatch, capfd):
    monkeypatch.syspath_prepend(HELPERS)
    run_dir = tmp_path / "run"
    sets = ["run.steps=1", "rollout.batch_groups=2", "rollout.max_new_tokens=6", "task.max_turns=4",
            "task.episode_tokens=400", "task.env=scripted_envs:ToolErrorEnv", "run.log_samples_every=0"]
    assert main(["train", "configs/tiny.yaml", "--run-dir", str(run_dir), *(a for s in sets for a in ("--set", s))]) == 0
    (line,) = [json.loads(text) for text in (run_dir / "metrics.jsonl").read_text().splitlines()]
    truncated = line["episodes_truncated"]
    # every answer but the last of a finished episode failed a call: 2 per finished episode, 4 per truncated one
    assert truncated > 0 and line["tool_errors"] == 2 * (line["episodes"] - truncated) + 4 * truncated
    assert line["episodes_truncated_frac"] == line["truncated_max_turns_frac"] == truncated / line["episodes"]
    assert line["truncated_tokens_frac"] == 0 and line["env_faults"] == 0
    out = capfd.readouterr().out
    frac = f"{line['episodes_truncated_frac']:.0%}"
    assert f"truncated={frac} (max turns {frac}, tokens 0%)" in out
    assert f"tool_errors={line['tool_errors']} (" in out
