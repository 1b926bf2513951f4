"""Rewarded groups -> a padded TrainBatch with group-normalised advantages."""
from __future__ import annotations

import torch

from colorl.rollout.types import Group
from colorl.train.grpo import group_advantages
from colorl.train.policy import TrainBatch


def build_batch(groups: list[Group], std_norm: bool, pad_id: int, drop_zero_variance: bool = False) -> TrainBatch:
    """With `drop_zero_variance`, groups whose rewards are all equal are masked out of the loss.

    They stay in the batch as padding-like rows so every rank still runs the same collectives.
    """
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)  # [G, S]
    advantages = group_advantages(rewards, std_norm).flatten()  # [G*S]
    samples = [r for g in groups for r in g.results]
    width = max(len(r.prompt_ids) + len(r.output_ids) for r in samples)
    n = len(samples)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)  # [B, L]
    attention = torch.zeros((n, width), dtype=torch.long)
    response = torch.zeros((n, width), dtype=torch.float32)
    behaviour = torch.zeros((n, width), dtype=torch.float32)
    keep = [not drop_zero_variance or g.has_signal for g in groups for _ in g.results]
    for i, r in enumerate(samples):
        p, o = len(r.prompt_ids), len(r.output_ids)
        input_ids[i, : p + o] = torch.tensor(r.prompt_ids + r.output_ids)
        attention[i, : p + o] = 1
        response[i, p : p + o] = float(keep[i])
        behaviour[i, p : p + o] = torch.tensor(r.logprobs, dtype=torch.float32)
    return TrainBatch(input_ids, attention, response, behaviour, advantages)
