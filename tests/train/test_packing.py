"""Micro-batch planning and the packed row: positions restart, attention stays inside a sequence."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from colorl.train.attention import varlen_sdpa
from colorl.train.packing import TrainBatch, pack, plan_micro_batches, split_to_count


def _batch() -> TrainBatch:
    # sequence 1 is a masked-out group; sequence 2's response is one token
    return TrainBatch.from_sequences([
        ([5, 6, 7, 8], [0, 0, 1, 1], [0, 0, -1.0, -2.0]),
        ([9, 10, 11], [0, 0, 0], [0, 0, 0]),
        ([12, 13], [0, 1], [0, -3.0]),
    ], torch.tensor([0.5, 0.0, -1.0]))


def test_pack_restarts_positions_and_points_at_the_trained_tokens():
    batch = _batch()
    assert batch.trained_tokens().tolist() == [2.0, 0.0, 1.0]
    micro = pack(batch, [2, 0])
    assert micro.input_ids.tolist() == [[12, 13, 5, 6, 7, 8]]
    assert micro.position_ids.tolist() == [[0, 1, 0, 1, 2, 3]]
    assert micro.cu_seqlens.tolist() == [0, 2, 6] and micro.max_seqlen == 4
    assert micro.predict_at.tolist() == [0, 3, 4]  # each trained token is predicted by the one before
    assert micro.targets.tolist() == [13, 7, 8]
    assert micro.behaviour_logp.tolist() == [-3.0, -1.0, -2.0]
    assert micro.advantages.tolist() == [-1.0, 0.5, 0.5] and micro.seq_ids.tolist() == [0, 1, 1]
    assert not micro.dummy and pack(batch, []).dummy


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.integers(1, 80), st.integers(1, 40))
def test_plan_covers_every_sequence_once_within_budget_and_reaches_any_count(lengths, budget, count):
    lengths = dict(enumerate(lengths))
    plan = plan_micro_batches(lengths, budget)
    assert sorted(i for m in plan for i in m) == sorted(lengths)
    assert all(len(m) == 1 or sum(lengths[i] for i in m) <= budget for m in plan)
    order = [i for m in plan for i in m]  # longest first: similar lengths share a micro-batch
    assert [lengths[i] for i in order] == sorted(lengths.values(), reverse=True)
    split = split_to_count(plan, lengths, max(count, len(plan)))
    assert len(split) == max(count, len(plan))
    assert sorted(i for m in split for i in m) == sorted(lengths)


def test_varlen_attention_equals_each_sequence_on_its_own():
    torch.manual_seed(0)
    module = torch.nn.Module()
    q, k, v = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    out, _ = varlen_sdpa(module, q, k, v, None, cu_seq_lens_q=torch.tensor([0, 4, 9]))  # [1, 9, 4, 8]
    for s, e in ((0, 4), (4, 9)):
        alone = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, s:e], k[:, :, s:e].repeat_interleave(2, 1), v[:, :, s:e].repeat_interleave(2, 1), is_causal=True)
        assert torch.allclose(out[:, s:e], alone.transpose(1, 2), atol=1e-6)
