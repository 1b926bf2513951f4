"""Rewarded groups -> a packed TrainBatch with group-normalised advantages."""
from __future__ import annotations

import torch

from colorl.rollout.types import Group
from colorl.train.grpo import group_advantages
from colorl.train.packing import TrainBatch


def build_batch(groups: list[Group], std_norm: bool, pad_id: int, drop_zero_variance: bool = False) -> TrainBatch:
    """With `drop_zero_variance`, groups whose rewards are all equal are masked out of the loss.

    Their sequences stay in the batch (so the batch still lists every rollout) but are never run:
    the trainer skips sequences with no trained token. `pad_id` is unused since nothing is padded;
    it stays in the signature the modes call.
    """
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)  # [G, S]
    advantages = group_advantages(rewards, std_norm).flatten()  # [G*S]
    sequences = []
    for g in groups:
        keep = float(not drop_zero_variance or g.has_signal)
        for r in g.results:
            p, o = len(r.prompt_ids), len(r.output_ids)
            sequences.append((r.prompt_ids + r.output_ids, [0.0] * p + [keep] * o, [0.0] * p + list(r.logprobs)))
    return TrainBatch.from_sequences(sequences, advantages)
