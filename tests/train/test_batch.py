"""The trainer's batch (colorl/train/batch.py): which samples set a group's advantages."""
from __future__ import annotations

import pytest
import torch

from colorl.engines.base import GenerationResult
from colorl.envs.base import EpisodeRecord
from colorl.rollout.types import Group
from colorl.tasks.base import Problem
from colorl.train.batch import build_batch


def episode(reward: float, fault: str | None = None) -> GenerationResult:
    return GenerationResult("0:0", [1, 2], [5, 6], [-1.0, -1.0], [0, 0], "stop", loss_mask=[1, 1],
                            episode=EpisodeRecord(reward, 1, 0, 0, 0.0, fault))


def group(env_faults: str) -> Group:
    """Three healthy episodes that all scored 1, one whose environment raised (reward 0)."""
    results = [episode(1.0), episode(1.0), episode(1.0), episode(0.0, fault="raised")]
    return Group(Problem("p", "1"), results, [1.0, 1.0, 1.0, 0.0], env_faults=env_faults)


def test_a_faulted_episode_is_left_out_of_its_groups_statistics_by_default():
    """Its reward 0 would make [1, 1, 1] look better than average (advantages 0.5) because the tool broke."""
    excluded = group("exclude")
    assert excluded.scored == [True, True, True, False] and not excluded.has_signal  # the filter drops it
    batch = build_batch([excluded], std_norm=True, pad_id=0)
    assert torch.equal(batch.advantages, torch.zeros(4))
    assert batch.trained_tokens().tolist() == [2, 2, 2, 0]


def test_reward_0_counts_the_faulted_episode_as_a_sample():
    counted = group("reward_0")
    assert counted.has_signal
    advantages = build_batch([counted], std_norm=False, pad_id=0).advantages
    assert advantages.tolist() == pytest.approx([0.25, 0.25, 0.25, -0.75])
    assert build_batch([counted], std_norm=True, pad_id=0).trained_tokens().tolist() == [2, 2, 2, 0]


def test_healthy_samples_keep_their_signal_without_the_faulted_one():
    results = [episode(1.0), episode(0.0), episode(0.5, fault="timeout"), episode(1.0)]
    advantages = build_batch([Group(Problem("p", "1"), results, [1.0, 0.0, 0.0, 1.0])], std_norm=False,
                             pad_id=0).advantages
    assert advantages.tolist() == pytest.approx([1 / 3, -2 / 3, 0.0, 1 / 3])


def test_a_sample_whose_lengths_differ_is_refused_before_packing():
    short = GenerationResult("3:1", [1, 2], [5, 6, 7], [-1.0, -1.0], [0, 0, 0], "stop", loss_mask=[1, 1, 1])
    with pytest.raises(ValueError, match=r"sample '3:1': lengths differ \(output_ids 3, logprobs 2, versions 3"):
        build_batch([Group(Problem("p", "1"), [short, episode(1.0)], [1.0, 0.0])], std_norm=True, pad_id=0)
