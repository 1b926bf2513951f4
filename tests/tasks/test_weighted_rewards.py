"""Several reward functions with weights (TRL's reward_funcs + reward_weights): the sample scores the
weighted sum, each function's mean is logged on its own, and a bad list is refused in one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from colorl.cli import main
from colorl.config import ConfigError, load_config
from colorl.engines.base import GenerationResult
from colorl.modes.step_metrics import reward_part_means
from colorl.preflight import check_user_code
from colorl.rollout.episodes import score_samples
from colorl.rollout.types import Group
from colorl.tasks.base import Problem
from colorl.tasks.weighted_rewards import RewardTerm, WeightedRewards, reward_terms

HELPERS = str(Path(__file__).resolve().parents[1] / "helpers")
TWO = ["task.reward=[reward_fns:digit_fraction, reward_fns:long_is_right]", "task.reward_weights=[2.0, 0.5]"]


def _config(*sets: str):
    return load_config("configs/tiny.yaml", list(sets), check_paths=False)


def test_the_sample_scores_the_weighted_sum_and_keeps_each_functions_score():
    terms = reward_terms(_config(*TWO).task)
    assert terms == [RewardTerm("digit_fraction", "reward_fns:digit_fraction", 2.0),
                     RewardTerm("long_is_right", "reward_fns:long_is_right", 0.5)]
    rewards = WeightedRewards(terms, [lambda p, c, a: c.count("1") / 4, lambda p, c, a: float(len(c) >= 6)])
    texts = {5: "1111111", 6: "11", 7: "abcdefg"}
    results = [GenerationResult(f"0:{i}", [1], [i], [0.0], [0], "stop") for i in texts]
    totals, parts = score_samples(Problem("p", "1"), results, rewards, lambda ids: texts[ids[0]])
    assert parts == {"digit_fraction": [1.75, 0.5, 0.0], "long_is_right": [1.0, 0.0, 1.0]}
    assert totals == [2 * 1.75 + 0.5, 2 * 0.5, 0.5]
    means = reward_part_means([Group(Problem("p", "1"), results, totals, reward_parts=parts)], samples=3)
    assert means == {"reward/digit_fraction": pytest.approx(2.25 / 3), "reward/long_is_right": pytest.approx(2 / 3)}


def test_the_single_reward_form_is_unchanged():
    assert reward_terms(_config("task.reward=reward_fns:digit_fraction").task) == []
    assert reward_terms(_config().task) == []
    (term,) = reward_terms(_config("task.reward=[task]").task)
    assert term.name == "task" and term.weight == 1.0


@pytest.mark.parametrize("sets, message", [
    (["task.reward=[reward_fns:digit_fraction, reward_fns:long_is_right]", "task.reward_weights=[1.0]"],
     "task.reward_weights: 1 weight for 2 reward functions in task.reward; give one per function"),
    (["task.reward_weights=[1.0]"], "task.reward_weights: set task.reward too"),
    (["task.reward=[]"], "task.reward=[]: give at least one reward function"),
    (["task.reward=[a:f, b:f]"], "task.reward: two reward functions named 'f'"),
])
def test_a_bad_list_is_refused_in_one_line(sets, message):
    with pytest.raises(ConfigError) as error:
        _config(*sets)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_bad_name_in_the_list_is_refused_before_launch(monkeypatch, capsys):
    monkeypatch.syspath_prepend(HELPERS)
    with pytest.raises(ConfigError, match=r"^task\.reward\[1\]='reward_fns:nope': "):
        check_user_code(_config("task.reward=[reward_fns:digit_fraction, reward_fns:nope]"))
    argv = ["train", "configs/tiny.yaml", "--dry-run", "--set", "task.reward=[task, reward_fns]"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == "colorl: error: task.reward[1]='reward_fns': expected 'module:function' or 'task' (the task's own reward)"


@pytest.mark.matrix
@pytest.mark.parametrize("mode", ["colocated", "bounded_lag"])
def test_a_weighted_two_reward_run_logs_each_function_and_their_weighted_sum(tmp_path, monkeypatch, capfd, mode):
    monkeypatch.syspath_prepend(HELPERS)
    run_dir = tmp_path / "run"
    sets = TWO + [f"mode={mode}", "run.steps=2", "rollout.batch_groups=2", "rollout.max_new_tokens=8", "run.log_samples_every=0"]
    assert main(["train", "configs/tiny.yaml", "--run-dir", str(run_dir), *(a for s in sets for a in ("--set", s))]) == 0
    lines = [json.loads(text) for text in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    for line in lines:
        digits, length = line["reward/digit_fraction"], line["reward/long_is_right"]
        assert 0 <= digits <= 1 and 0 <= length <= 1
        assert line["reward_mean"] == pytest.approx(2.0 * digits + 0.5 * length)
    assert any(line["reward/long_is_right"] > 0 for line in lines)
    out = capfd.readouterr().out
    assert f"reward/digit_fraction={lines[0]['reward/digit_fraction']:.3f}" in out
    assert "reward/long_is_right" in out[out.index("colorl · steps"):]  # the end table names them too
