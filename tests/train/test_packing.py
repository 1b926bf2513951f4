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


def _grouped_batch() -> TrainBatch:
    """Two groups: sequences 0, 2, 3 share the prompt [5, 6, 7], sequence 1 has its own; 4 is masked."""
    return TrainBatch.from_sequences([
        ([5, 6, 7, 20, 21], [0, 0, 0, 1, 1], [0, 0, 0, -1.0, -2.0]),
        ([8, 9, 22], [0, 0, 1], [0, 0, -3.0]),
        ([5, 6, 7, 23], [0, 0, 0, 1], [0, 0, 0, -4.0]),
        ([5, 6, 7, 24, 25, 26], [0, 0, 0, 1, 1, 1], [0, 0, 0, -5.0, -6.0, -7.0]),
        ([5, 6, 7, 27], [0, 0, 0, 0], [0, 0, 0, 0]),
    ], torch.tensor([0.5, -1.0, 1.5, -2.0, 0.0]))


def test_samples_of_one_prompt_run_it_once():
    batch = _grouped_batch()
    assert batch.prompt_lens().tolist() == [3, 2, 3, 3, 4]
    micro = pack(batch, [3, 1, 0, 2], prompts=batch.prompts())
    # the prompt once, then each sample's own tokens at the positions they have in their sequence
    assert micro.input_ids.tolist() == [[5, 6, 7, 24, 25, 26, 20, 21, 23, 8, 9, 22]]
    assert micro.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 3, 4, 3, 0, 1, 2]]
    assert micro.cu_seqlens.tolist() == [0, 3, 6, 8, 9, 12] and micro.prompt_of == [-1, 0, 0, 0, -1]
    # first response tokens are predicted by the shared prompt's last token (row 2)
    assert micro.predict_at.tolist() == [2, 3, 4, 10, 2, 6, 2]
    assert micro.targets.tolist() == [24, 25, 26, 22, 20, 21, 23]
    assert micro.behaviour_logp.tolist() == [-5.0, -6.0, -7.0, -3.0, -1.0, -2.0, -4.0]
    assert micro.seq_ids.tolist() == [0, 0, 0, 1, 2, 2, 3]
    assert micro.advantages.tolist() == [-2.0, -2.0, -2.0, -1.0, 0.5, 0.5, 1.5]
    unshared = pack(batch, [3, 1, 0, 2])
    assert unshared.prompt_of is None and unshared.input_ids.shape[1] == 18
    assert sorted(zip(unshared.targets.tolist(), unshared.seq_ids.tolist())) == sorted(
        zip(micro.targets.tolist(), micro.seq_ids.tolist()))
    alone = pack(batch, [0, 1], prompts=batch.prompts())  # no prompt twice in the row: nothing shared
    assert alone.prompt_of is None and alone.input_ids.tolist() == [[5, 6, 7, 20, 21, 8, 9, 22]]
    untrained = pack(batch, [4, 4], prompts=batch.prompts())  # nothing trained: no sample of its own to share with
    assert untrained.prompt_of is None and untrained.input_ids.shape[1] == 8


def test_shared_prompt_attention_equals_each_sequence_on_its_own():
    """Row: prompt (3) | sample a (2) | sample b (4) | an unshared sequence (5): every position's output is
    what attention over its own whole sequence gives."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 14, 8), torch.randn(1, 2, 14, 8), torch.randn(1, 2, 14, 8)
    out, _ = varlen_sdpa(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=torch.tensor([0, 3, 5, 9, 14]),
                         prompt_of=[-1, 0, 0, -1])
    for rows in ([0, 1, 2, 3, 4], [0, 1, 2, 5, 6, 7, 8], list(range(9, 14))):
        index = torch.tensor(rows)
        alone = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, index], k[:, :, index].repeat_interleave(2, 1), v[:, :, index].repeat_interleave(2, 1), is_causal=True)
        assert torch.allclose(out[:, index], alone.transpose(1, 2), atol=1e-6), rows


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 30)), min_size=1, max_size=30), st.integers(1, 80))
def test_a_plan_with_shared_prompts_keeps_each_micro_batch_within_budget(sequences, budget):
    """(group, response tokens) per sequence, a group's prompt 1 + group tokens long: every sequence once,
    each micro-batch's packed row (its prompts once) within the budget unless it holds one sequence."""
    prompt = {g: (("p", g), 1 + g) for g in range(5)}
    lengths = {i: prompt[g][1] + n for i, (g, n) in enumerate(sequences)}
    prompts = {i: prompt[g] for i, (g, _) in enumerate(sequences)}
    plan = plan_micro_batches(lengths, budget, prompts)
    assert sorted(i for m in plan for i in m) == sorted(lengths)
    for m in plan:
        groups = {prompts[i][0]: prompts[i][1] for i in m}
        row = sum(lengths[i] for i in m) - sum(n * (sum(prompts[i][0] == key for i in m) - 1) for key, n in groups.items())
        assert len(m) == 1 or row <= budget
    if sum(lengths.values()) <= budget:  # everything fits: one micro-batch
        assert len(plan) == 1
