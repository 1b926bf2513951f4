"""Sequences without padding: a step's batch, its micro-batches and the packed row each one runs as.

A micro-batch is one row of tokens, its sequences back to back, position ids restarting at every
sequence start and attention confined to each sequence (`cu_seqlens`), so no FLOP goes to padding.
Micro-batches are cut by a token budget from the sequences sorted by length (similar lengths run
together) and every rank runs the same number of them, because FSDP's collectives are per forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TrainBatch:
    """One rank's share of a step's rollouts: N sequences concatenated, T tokens in all."""

    input_ids: torch.Tensor  # [T] prompt + response of every sequence, back to back
    seq_lens: torch.Tensor  # [N] tokens of each sequence
    response_mask: torch.Tensor  # [T] 1 where the token is generated and trained
    behaviour_logp: torch.Tensor  # [T] engine log-prob of each generated token (0 elsewhere)
    advantages: torch.Tensor  # [N]

    def __len__(self) -> int:
        return self.seq_lens.shape[0]

    @classmethod
    def from_sequences(cls, sequences: list[tuple[list[int], list[float], list[float]]],
                       advantages: torch.Tensor) -> "TrainBatch":
        """sequences: (token ids, response mask, behaviour log-prob) per sequence, each per token."""
        if not sequences:
            empty = torch.zeros(0)
            return cls(empty.long(), empty.long(), empty, empty, advantages)
        return cls(
            input_ids=torch.tensor([t for ids, _, _ in sequences for t in ids], dtype=torch.long),
            seq_lens=torch.tensor([len(ids) for ids, _, _ in sequences], dtype=torch.long),
            response_mask=torch.tensor([m for _, mask, _ in sequences for m in mask], dtype=torch.float32),
            behaviour_logp=torch.tensor([b for _, _, logp in sequences for b in logp], dtype=torch.float32),
            advantages=advantages,
        )

    def offsets(self) -> list[int]:
        """Start of every sequence in the token axis, and the end: [N + 1]."""
        return [0, *torch.cumsum(self.seq_lens, 0).tolist()]

    def trained_tokens(self) -> torch.Tensor:
        """[N] response tokens in the loss per sequence (0: a masked-out sequence, never run).

        A sequence's first token has no prefix to predict it from, so it is never trained.
        """
        mask = self.response_mask.float().clone()
        mask[self.offsets()[:-1]] = 0.0
        seq_of_token = torch.repeat_interleave(torch.arange(len(self)), self.seq_lens)
        return torch.zeros(len(self)).index_add_(0, seq_of_token, mask)


@dataclass
class MicroBatch:
    """The packed row one forward runs on; K = trained tokens in it."""

    input_ids: torch.Tensor  # [1, T'] its sequences back to back
    position_ids: torch.Tensor  # [1, T'] restarting at 0 at every sequence start
    cu_seqlens: torch.Tensor  # [n + 1] int32 sequence boundaries (the varlen attention convention)
    max_seqlen: int
    predict_at: torch.Tensor  # [K] positions whose next-token distribution the loss reads
    targets: torch.Tensor  # [K] the trained (sampled) tokens, input_ids[0, predict_at + 1]
    behaviour_logp: torch.Tensor  # [K]
    advantages: torch.Tensor  # [K] the advantage of each token's sequence
    seq_ids: torch.Tensor  # [K] which of this micro-batch's n sequences each token belongs to
    dummy: bool = False  # a placeholder so every rank runs the same collectives; contributes nothing


def plan_micro_batches(lengths: dict[int, int], budget: int) -> list[list[int]]:
    """Sequence indices per micro-batch from {index: tokens}: longest first, at most `budget` tokens each.

    A sequence longer than the budget runs alone.
    """
    plan: list[list[int]] = []
    used = budget
    for i in sorted(lengths, key=lambda i: (-lengths[i], i)):
        if used + lengths[i] > budget:
            plan.append([])
            used = 0
        plan[-1].append(i)
        used += lengths[i]
    return plan


def split_to_count(plan: list[list[int]], lengths: dict[int, int], count: int) -> list[list[int]]:
    """Split the largest micro-batches in two until there are `count`; add empty ones if none splits."""
    plan = [list(m) for m in plan]
    while len(plan) < count:
        splittable = [m for m in plan if len(m) > 1]
        if not splittable:
            plan.extend([] for _ in range(count - len(plan)))
            break
        largest = max(splittable, key=lambda m: sum(lengths[i] for i in m))
        half, acc, cut = sum(lengths[i] for i in largest) / 2, 0, 1
        while cut < len(largest) - 1 and acc + lengths[largest[cut - 1]] < half:
            acc += lengths[largest[cut - 1]]
            cut += 1
        plan.remove(largest)
        plan.extend([largest[:cut], largest[cut:]])
    return plan


def pack(batch: TrainBatch, indices: list[int], pad_id: int = 0) -> MicroBatch:
    """The packed row of sequences `indices` of `batch`; no indices: a 2-token placeholder."""
    if not indices:
        return _placeholder(pad_id)
    offsets = batch.offsets()
    spans = [(offsets[i], offsets[i + 1]) for i in indices]
    token_index = torch.cat([torch.arange(s, e) for s, e in spans])  # [T'] into the batch's token axis
    lens = torch.tensor([e - s for s, e in spans])
    cu = torch.zeros(len(spans) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    position_ids = torch.cat([torch.arange(int(n)) for n in lens])
    local_seq = torch.repeat_interleave(torch.arange(len(spans)), lens)  # [T']
    trained = batch.response_mask[token_index].bool() & (position_ids > 0)  # position 0 predicts nothing
    at = trained.nonzero().squeeze(1)  # positions of trained tokens in the row
    return MicroBatch(
        input_ids=batch.input_ids[token_index].unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        cu_seqlens=cu,
        max_seqlen=int(lens.max()),
        predict_at=at - 1,
        targets=batch.input_ids[token_index[at]],
        behaviour_logp=batch.behaviour_logp[token_index[at]],
        advantages=batch.advantages[torch.tensor(indices)][local_seq[at]],
        seq_ids=local_seq[at],
    )


def _placeholder(pad_id: int) -> MicroBatch:
    one = torch.zeros(1)
    return MicroBatch(
        input_ids=torch.full((1, 2), pad_id, dtype=torch.long), position_ids=torch.arange(2).unsqueeze(0),
        cu_seqlens=torch.tensor([0, 2], dtype=torch.int32), max_seqlen=2, predict_at=torch.zeros(1, dtype=torch.long),
        targets=torch.full((1,), pad_id, dtype=torch.long), behaviour_logp=one, advantages=one,
        seq_ids=torch.zeros(1, dtype=torch.long), dummy=True,
    )
