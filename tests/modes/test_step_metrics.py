"""The step's staleness figures (colorl/modes/step_metrics.py) measured from each group's oldest state."""
from __future__ import annotations

from types import SimpleNamespace

from colorl.config import load_config
from colorl.engines.base import GenerationResult
from colorl.envs.base import EpisodeRecord
from colorl.modes.step_metrics import StepTimes, step_record
from colorl.rollout.types import Group
from colorl.tasks.base import Problem
from colorl.tasks.rewards import RewardCounters
from colorl.train.policy import TrainStats


def sample(versions: list[int], fault: str | None = None, reward: float = 1.0) -> GenerationResult:
    """An episode's result; no versions: it faulted before the model sampled anything."""
    return GenerationResult("0:0", [1, 2], [5] * len(versions), [-1.0] * len(versions), versions, "stop",
                            loss_mask=[1] * len(versions), episode=EpisodeRecord(reward, 1, 0, 0, 0.0, fault))


def record(groups: list[Group], trained_version: int) -> dict:
    cfg = load_config("configs/tiny.yaml", ["mode=colocated"], check_paths=False)
    ctx = SimpleNamespace(cfg=cfg, reward_counters=RewardCounters(), state=SimpleNamespace(step=1, version=trained_version + 1),
                          trainer=SimpleNamespace(skipped_steps=0), episodes=None,
                          predicted_staleness=lambda rho, m_tail: 0.0)
    train = TrainStats(0.0, 0.0, 1, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    sync = SimpleNamespace(time_sync_s=0.0, bytes_moved=0, gb_per_s=0.0)
    return step_record(ctx, groups, train, sync, StepTimes(), trained_version)


def test_a_sample_without_sampled_tokens_has_no_version_and_does_not_age_its_group():
    """An episode that faults at construction: colocated mode trains its group at once, staleness 0."""
    problem = Problem("p", "1")
    faulted = sample([], fault="raised", reward=0.0)
    assert faulted.first_version is None
    mixed = Group(problem, [sample([2, 2]), faulted], [1.0, 0.0])
    assert mixed.first_version == 2
    empty = Group(problem, [faulted, faulted], [0.0, 0.0])
    assert empty.first_version is None
    line = record([mixed, empty], trained_version=2)
    assert line["staleness_max"] == 0 and line["staleness_mean"] == 0.0 and line["staleness_hist"] == {"0": 1}


def test_prompt_kv_older_than_the_tokens_sets_the_samples_version():
    chunked = GenerationResult("0:0", [1, 2], [5, 6], [-1.0, -1.0], [3, 3], "stop", state_version=2)
    assert chunked.first_version == 2
    line = record([Group(Problem("p", "1"), [chunked], [1.0])], trained_version=3)
    assert line["staleness_max"] == 1 and line["partial_rollout_token_frac"] == 1.0
