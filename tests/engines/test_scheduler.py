"""Scheduler, driven without a model: continuous batching, chunked prefill, preemption, sharing."""
from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from colorl.engines.native.block_manager import BlockManager
from colorl.engines.native.scheduler import Scheduler, Sequence, Status


def seq(rid: str, prompt: list[int], max_new: int = 4, stop: frozenset[int] = frozenset()) -> Sequence:
    return Sequence(request_id=rid, token_ids=list(prompt), num_prompt_tokens=len(prompt),
                    params=SimpleNamespace(max_new_tokens=max_new), seed=0, stop_ids=stop)


def make(num_blocks=16, block_size=4, max_num_seqs=8, max_prefill_tokens=64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, max_prefill_tokens)


def fake_step(s: Scheduler, token: int = 1):
    """Schedule, pretend the model ran, sample `token` for every sequence that samples."""
    batch = s.schedule()
    sampled = {i: (token, -1.0) for i in range(len(batch)) if batch.sample[i]}
    return batch, s.postprocess(batch, sampled, version=0)


def run_to_end(s: Scheduler, limit: int = 1000) -> list[Sequence]:
    done = []
    for _ in range(limit):
        if not s.has_unfinished():
            return done
        done += fake_step(s)[1]
    raise AssertionError("did not finish")


def test_new_requests_join_while_others_decode():
    s = make()
    s.add(seq("a", [1, 2, 3], max_new=3))
    batch, _ = fake_step(s)
    assert [x.request_id for x in batch.seqs] == ["a"] and batch.num_tokens == [3]
    s.add(seq("b", [4, 5]))
    batch, _ = fake_step(s)
    assert [(x.request_id, n) for x, n in zip(batch.seqs, batch.num_tokens)] == [("a", 1), ("b", 2)]
    batch, done = fake_step(s)
    assert [x.request_id for x in done] == ["a"] and done[0].finish_reason == "length"
    assert s.blocks.num_used_blocks == len(s.running[0].block_table)


def test_max_num_seqs_caps_running():
    s = make(max_num_seqs=2)
    for i in range(5):
        s.add(seq(str(i), [i + 10] * 3))
    batch, _ = fake_step(s)
    assert len(batch) == 2 and len(s.running) == 2 and len(s.waiting) == 3
    assert len(run_to_end(s)) == 5


def test_long_prompt_is_prefilled_in_chunks():
    s = make(num_blocks=32, max_prefill_tokens=16)
    s.add(seq("long", list(range(40)), max_new=2))
    chunks = []
    for _ in range(3):
        batch, _ = fake_step(s)
        chunks.append(batch.num_tokens[0])
        assert batch.sample[0] == (sum(chunks) == 40)
    assert chunks == [16, 16, 8]
    assert s.running[0].num_output_tokens == 1


def test_stop_token_and_length_finish():
    s = make()
    s.add(seq("stop", [1, 2], max_new=10, stop=frozenset({7})))
    s.add(seq("len", [1, 2], max_new=2))
    fake_step(s, token=3)
    _, done = fake_step(s, token=7)
    assert {x.request_id: x.finish_reason for x in done} == {"stop": "stop", "len": "length"}
    assert s.blocks.num_used_blocks == 0


def test_preemption_when_blocks_run_out_then_recompute():
    # 4 blocks of 2 tokens: two sequences of 3 prompt tokens cannot both grow to 8 tokens.
    s = make(num_blocks=4, block_size=2)
    s.add(seq("a", [1, 2, 3], max_new=5))
    s.add(seq("b", [4, 5, 6], max_new=5))
    preempted = []
    done = []
    for _ in range(50):
        if not s.has_unfinished():
            break
        batch, finished = fake_step(s)
        preempted += [x.request_id for x in batch.preempted]
        done += finished
    assert preempted and preempted[0] == "b"  # the newest running sequence gives way
    assert sorted((x.request_id, x.num_output_tokens) for x in done) == [("a", 5), ("b", 5)]
    assert s.blocks.num_used_blocks == 0


def test_sequence_larger_than_pool_is_truncated_not_stuck():
    s = make(num_blocks=2, block_size=2)
    s.add(seq("big", [1, 2, 3], max_new=10))
    done = run_to_end(s)
    assert done[0].finish_reason == "length" and done[0].num_tokens == 2 * 2 + 1  # pool + one sampled


def test_group_shares_prompt_blocks_and_computes_prefix_once():
    s = make(num_blocks=32, block_size=4)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    for i in range(4):
        s.add(seq(f"g{i}", prompt))
    batch, _ = fake_step(s)
    assert batch.num_tokens == [10, 2, 2, 2]  # the prompt once, then only the last partial block
    tables = [x.block_table for x in batch.seqs]
    assert all(t[:2] == tables[0][:2] for t in tables)
    assert len({t[2] for t in tables}) == 4
    assert s.blocks.num_used_blocks == 2 + 4


def test_interrupt_keep_kv_parks_and_resumes():
    s = make()
    s.add(seq("a", [1, 2, 3], max_new=6))
    fake_step(s)
    fake_step(s)
    parked = s.remove("a", keep_kv=True)
    assert parked.status is Status.PARKED and s.blocks.num_used_blocks == len(parked.block_table)
    assert s.resume_parked("a", list(parked.token_ids)) is parked
    batch, _ = fake_step(s)
    assert batch.num_tokens == [1]  # continues on its KV: no re-prefill
    s.remove("a")
    assert s.blocks.num_used_blocks == 0


def test_resume_with_other_tokens_releases_parked_kv():
    s = make()
    s.add(seq("a", [1, 2, 3]))
    fake_step(s)
    s.remove("a", keep_kv=True)
    assert s.resume_parked("a", [9, 9, 9]) is None
    assert s.blocks.num_used_blocks == 0


def test_drop_all_kv_requeues_in_order():
    s = make()
    for rid in "abc":
        s.add(seq(rid, [1, 2, 3]))
    fake_step(s)
    s.drop_all_kv()
    assert [x.request_id for x in s.waiting] == ["a", "b", "c"] and not s.running
    assert s.blocks.num_used_blocks == 0
    assert all(x.num_computed_tokens == 0 for x in s.waiting)


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 12), min_size=1, max_size=8),
    max_new=st.integers(1, 6),
    num_blocks=st.integers(6, 20),
    max_num_seqs=st.integers(1, 4),
    budget=st.integers(2, 12),
)
def test_everything_finishes_with_exact_lengths(prompts, max_new, num_blocks, max_num_seqs, budget):
    s = make(num_blocks=num_blocks, block_size=2, max_num_seqs=max_num_seqs, max_prefill_tokens=budget)
    for i, n in enumerate(prompts):
        s.add(seq(str(i), [i % 3] * n, max_new=max_new))
    done = run_to_end(s, limit=5000)
    assert len(done) == len(prompts)
    for x in done:
        assert x.num_output_tokens == max_new or (x.finish_reason == "length" and x.num_tokens >= num_blocks * 2)
    assert s.blocks.num_used_blocks == 0
