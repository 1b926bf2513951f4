"""Bursts of decode steps in one compiled call (engine.decode_burst): the tokens, log-probs, stops, versions and
prefix cache of one step per call, with the Python between steps run once per burst."""
from __future__ import annotations

import pytest
import torch

from colorl.config import EngineConfig
from colorl.engines.base import GenerationRequest, SamplingParams
from colorl.engines.native import NativeEngine, cpu_decode
from colorl.engines.native.block_manager import BlockManager
from colorl.engines.native.scheduler import ScheduledBatch, Scheduler, Sequence, Status
from colorl.models import save_tiny_model


@pytest.fixture
def every_row_count(compiled, monkeypatch):
    """The loops take every row count, whatever this machine's race said (a burst runs only where they do)."""
    monkeypatch.setattr(type(compiled), "rows_won", lambda self, dtype: frozenset(range(1, cpu_decode.MAX_ROWS + 1)))


@pytest.fixture
def bursts(monkeypatch):
    """(steps asked for, rows, steps run) of every burst the compiled loops run."""
    seen = []
    original = cpu_decode.CpuDecode.decode_burst

    def spied(self, x, layers, step, scratch, head, embed, temperatures, slots, u, stops):
        tokens, logps = original(self, x, layers, step, scratch, head, embed, temperatures, slots, u, stops)
        seen.append((*slots.shape, len(tokens) // slots.shape[1]))
        return tokens, logps

    monkeypatch.setattr(cpu_decode.CpuDecode, "decode_burst", spied)
    return seen


def run(folder, dtype, burst: int, requests: list[GenerationRequest], **cfg):
    cfg = {"num_blocks": 64, "block_size": 4, "max_prefill_tokens": 64, **cfg}
    engine = NativeEngine(folder, EngineConfig(decode_burst=burst, **cfg), dtype=dtype)
    return engine, {r.request_id: r for r in engine.generate(requests)}


def same_results(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid].output_ids == b[rid].output_ids, rid
        assert a[rid].logprobs == b[rid].logprobs, rid  # bit for bit
        assert (a[rid].finish_reason, a[rid].versions) == (b[rid].finish_reason, b[rid].versions), rid


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", cpu_decode.DTYPES)
def test_a_burst_samples_what_one_step_per_call_samples(compiled, bursts, tmp_path, monkeypatch, dtype, tied):
    """Five sequences at several temperatures, over blocks of 4 tokens that bursts of 8 cross; the loops take 5
    rows and more, and a step of 4 runs on torch's operators (other bits). One sequence draws its stop token in
    the middle of the first burst: the burst ends there, so the other four go on at 4 rows as with one step per
    call (a burst that ran on over the stopped row would compute them among 5 on the loops). The same tokens,
    bit-identical log-probs, stops and versions as one step per call; the blocks all come back, and the prefix
    cache holds the same blocks after."""
    monkeypatch.setattr(type(compiled), "rows_won", lambda self, dtype: frozenset({5, 6, 7, 8}))
    folder = save_tiny_model(tmp_path / "m", tie_word_embeddings=tied)

    def requests(seed, stop_ids=()):
        return [GenerationRequest(str(i), list(range(10, 13 + 2 * i)),
                                  SamplingParams(temperature=(1.0, 0.7, 1.3)[i % 3], max_new_tokens=20 + i,
                                                 stop_token_ids=stop_ids, seed=seed + i))
                for i in range(5)]

    def stop_in_the_first_burst(seed):  # a token the last sequence draws 3rd and no sequence draws before
        _, free = run(folder, dtype, 1, requests(seed))
        token = free["4"].output_ids[3]
        if all(token not in r.output_ids[:4 if rid != "4" else 3] for rid, r in free.items()):
            return token
        return None

    seed, stop = next((seed, stop) for seed in range(0, 1000, 10) if (stop := stop_in_the_first_burst(seed)))
    engines, results = {}, {}
    for burst in (1, 8):
        bursts.clear()
        engines[burst], results[burst] = run(folder, dtype, burst, requests(seed, (stop,)))
        assert bool(bursts) == (burst > 1)
    same_results(results[8], results[1])
    assert results[8]["4"].finish_reason == "stop" and len(results[8]["4"].output_ids) == 4
    assert bursts[0] == (8, 5, 3)  # ended by the stop, after its third step
    for engine in engines.values():
        assert engine.blocks.num_used_blocks == 0
    again = [GenerationRequest(f"again-{rid}", r.prompt_ids + r.output_ids, SamplingParams(max_new_tokens=1))
             for rid, r in results[1].items()]
    for engine in engines.values():
        engine.generate(again)
    assert engines[8].scheduler.num_prefix_hit_tokens == engines[1].scheduler.num_prefix_hit_tokens > 0


def test_steps_that_a_burst_cannot_run_run_one_per_call(every_row_count, bursts, tiny_model_dir, monkeypatch):
    """Rows drawn by torch's sampler (top-p, greedy), a request waiting for blocks with room among max_num_seqs,
    and a pool without blocks for every step of a burst: one step per call, the same results as with bursts off.
    A request waiting only for room among max_num_seqs does not stop bursts (a finish ends them)."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    nucleus = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, ignore_eos=True, seed=1)
    for params in (greedy, nucleus):
        bursts.clear()
        _, on = run(tiny_model_dir, torch.float32, 8, [GenerationRequest("a", [10, 11, 12], params)])
        _, off = run(tiny_model_dir, torch.float32, 1, [GenerationRequest("a", [10, 11, 12], params)])
        same_results(on, off)
        assert bursts == []
    plain = [GenerationRequest(str(i), [10 + i, 11, 12], SamplingParams(max_new_tokens=10 + 3 * i, seed=i,
                                                                         ignore_eos=True)) for i in range(3)]
    waiting = []
    burst_steps = NativeEngine._burst_steps

    def watched(self, batch):
        steps = burst_steps(self, batch)
        waiting.append((len(self.scheduler.waiting), len(self.scheduler.running), steps))
        return steps

    monkeypatch.setattr(NativeEngine, "_burst_steps", watched)
    bursts.clear()
    _, on = run(tiny_model_dir, torch.float32, 8, plain, max_num_seqs=2)  # the third waits for room
    _, two_places = run(tiny_model_dir, torch.float32, 1, plain, max_num_seqs=2)
    same_results(on, two_places)
    assert (1, 2, 8) in waiting  # a burst while the third waited for one of the two places
    for blocks in (6, 7):  # 4 tokens a block: the third waits for blocks, with a place free among 3
        waiting.clear()
        _, on = run(tiny_model_dir, torch.float32, 8, plain, max_num_seqs=3, num_blocks=blocks)
        _, off = run(tiny_model_dir, torch.float32, 1, plain, max_num_seqs=3, num_blocks=blocks)
        same_results(on, off)
        assert any(w == 1 for w, _, _ in waiting) and all(steps == 1 for w, _, steps in waiting if w)
    monkeypatch.setattr(Scheduler, "reserve_ahead", lambda self, batch, steps: False)  # no blocks to spare
    bursts.clear()
    _, tight = run(tiny_model_dir, torch.float32, 8, plain, max_num_seqs=2)
    same_results(tight, two_places)
    assert bursts == []


def test_reserving_a_burst_takes_every_block_or_none():
    blocks = BlockManager(num_blocks=6, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=4, max_prefill_tokens=64)
    batch = ScheduledBatch()
    for i in range(2):
        seq = Sequence(str(i), list(range(7)), 6, SamplingParams(), seed=i)
        seq.block_table, seq.num_computed_tokens = blocks.allocate(2), 6  # position 6 is the next to compute
        batch.add(seq, 1)
    assert not scheduler.reserve_ahead(batch, 8)  # 3 more blocks each: 6 > the 2 free
    assert blocks.num_free_blocks == 2 and [len(s.block_table) for s in batch.seqs] == [2, 2]
    assert scheduler.reserve_ahead(batch, 6)  # 1 more each
    assert blocks.num_free_blocks == 0 and [len(s.block_table) for s in batch.seqs] == [3, 3]
    for seq in batch.seqs:
        seq.status = Status.RUNNING
        scheduler.running.append(seq)
    batch.seqs[0].stop_ids = frozenset({99})
    finished = scheduler.postprocess_burst(batch, [{0: (5, -1.0), 1: (5, -1.0)}, {0: (99, -1.0), 1: (6, -1.0)}],
                                           version=0)  # a stop at the second of six steps
    assert finished == [batch.seqs[0]] and batch.seqs[1].num_computed_tokens == 8
    assert len(batch.seqs[1].block_table) == 2 and blocks.num_free_blocks == 4  # as after two single steps


def test_a_bad_slot_later_in_a_burst_raises(every_row_count, compiled, tiny_model_dir, monkeypatch):
    """The burst's call checks each step's slots in C, and returns the first error of its loops."""
    original = cpu_decode.CpuDecode.decode_burst

    def corrupt(self, x, layers, step, scratch, head, embed, temperatures, slots, u, stops):
        slots[-1] = 10**9  # the last step's K/V past the cache
        return original(self, x, layers, step, scratch, head, embed, temperatures, slots, u, stops)

    monkeypatch.setattr(cpu_decode.CpuDecode, "decode_burst", corrupt)
    engine = NativeEngine(tiny_model_dir, EngineConfig(num_blocks=16, block_size=4, decode_burst=4))
    with pytest.raises(IndexError, match="outside the cache"):
        engine.generate([GenerationRequest("a", [10, 11, 12], SamplingParams(max_new_tokens=6, ignore_eos=True))])
    slots = torch.zeros(2, 1, dtype=torch.int64)
    step, head = cpu_decode.DecodeStep(tokens=1, hidden=4, slots=slots.data_ptr()), cpu_decode.DecodeHead(vocab=3)
    with pytest.raises(ValueError, match="temperature above 0"):
        compiled.decode_burst(torch.zeros(1, 4), None, step, torch.zeros(64), head, torch.zeros(3, 4), [0.0], slots,
                              [0.5, 0.5], [()])
    with pytest.raises(ValueError, match="do not agree"):  # a draw short
        compiled.decode_burst(torch.zeros(1, 4), None, step, torch.zeros(64), head, torch.zeros(3, 4), [1.0], slots,
                              [0.5], [()])
