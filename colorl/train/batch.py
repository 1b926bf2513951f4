"""Rewarded groups -> a packed TrainBatch with group-normalised advantages."""
from __future__ import annotations

import torch

from colorl.engines.base import GenerationResult
from colorl.rollout.types import Group
from colorl.train.grpo import group_advantages
from colorl.train.packing import TrainBatch


def build_batch(groups: list[Group], std_norm: bool, pad_id: int, drop_zero_variance: bool = False) -> TrainBatch:
    """With `drop_zero_variance`, groups whose rewards are all equal are masked out of the loss.

    Their sequences stay in the batch (so the batch still lists every rollout) but are never run:
    the trainer skips sequences with no trained token. `pad_id` is unused since nothing is padded;
    it stays in the signature the modes call.

    Only the model's own tokens train (an episode's `loss_mask`), and none of an episode whose
    environment faulted; its reward 0 counts in its group's mean and spread only with
    `filter.env_faults=reward_0` (`Group.scored`).
    """
    for g in groups:
        for r in g.results:
            check_lengths(r)
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)  # [G, S]
    scored = torch.tensor([g.scored for g in groups], dtype=torch.bool)  # [G, S]
    advantages = group_advantages(rewards, std_norm, scored=scored).flatten()  # [G*S]
    sequences = []
    for g in groups:
        keep = float(not drop_zero_variance or g.has_signal)
        for r in g.results:
            sampled = r.loss_mask if r.loss_mask is not None else [1] * len(r.output_ids)  # episodes: not the env's tokens
            trained = keep * (r.episode is None or r.episode.fault is None)  # an environment fault is not the model's
            sequences.append((r.prompt_ids + r.output_ids, [0.0] * len(r.prompt_ids) + [trained * m for m in sampled],
                              [0.0] * len(r.prompt_ids) + list(r.logprobs)))
    return TrainBatch.from_sequences(sequences, advantages)


def check_lengths(result: GenerationResult) -> None:
    """A sample's tokens, loss mask, behaviour log-probs and versions must line up one per output token:
    packed, a shorter list would pair each token with another token's log-prob (ValueError, one line)."""
    lengths = {"output_ids": len(result.output_ids), "logprobs": len(result.logprobs), "versions": len(result.versions)}
    if result.loss_mask is not None:
        lengths["loss_mask"] = len(result.loss_mask)
    if len(set(lengths.values())) > 1:
        raise ValueError(f"sample {result.request_id!r}: lengths differ ({', '.join(f'{k} {n}' for k, n in lengths.items())})")
