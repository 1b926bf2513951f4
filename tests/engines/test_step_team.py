"""One team of threads for a whole decode step (cpu_decode_team.h): every loop of a burst runs as its threads' shares
on the step's one team, with a barrier after each, and computes what the per-operation path's loops, each on a team
of its own, compute: the same tokens and the same bits at any thread count."""
from __future__ import annotations

import ctypes
import os

import pytest
import torch

from colorl.config import EngineConfig
from colorl.engines.base import GenerationRequest, SamplingParams
from colorl.engines.native import NativeEngine, cpu_decode
from colorl.models import save_tiny_model
from colorl.threads import pinned

pytestmark = pytest.mark.timeout(300, method="thread")  # a barrier met by some threads only hangs: fail instead


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """Wide enough that a step's products split among two threads (a 2080-wide gate/up in 65 pairs of panels, shared
    unevenly; a down product over K = 1040, whose x is laid out in uneven k-blocks and whose last k-pair tile is
    partial) while its head (the tokenizer's few hundred outputs) stays on one thread."""
    return save_tiny_model(tmp_path_factory.mktemp("wide"), hidden_size=256, intermediate_size=1040,
                           num_attention_heads=4, num_key_value_heads=2)


def rollout(folder, dtype, threads: int, per_operation: bool, compiled, one_team: bool = True) -> list:
    """Eleven sequences of different lengths at two temperatures, in bursts: steps of 11 rows down to 1; one_team
    False: the bursts' loops each fork a team of their own (COLORL_CPU_DECODE_TEAM=0)."""
    requests = [GenerationRequest(str(i), list(range(10, 14 + 3 * i)),
                                  SamplingParams(temperature=(1.0, 0.8)[i % 2], max_new_tokens=4 + 2 * i,
                                                 ignore_eos=True, seed=i))
                for i in range(11)]
    with pinned(threads):
        engine = NativeEngine(folder, EngineConfig(num_blocks=128, block_size=4, max_prefill_tokens=512), dtype=dtype)
        compiled.seconds = {} if per_operation else None  # {}: the per-operation path, each loop its own team
        compiled.use_one_team(one_team)
        try:
            return engine.generate(requests)
        finally:
            compiled.seconds = None
            compiled.use_one_team(True)


@pytest.mark.parametrize("few_rows", ["all", "none"])  # up to 8 rows over the panels, or on the rows kernel
@pytest.mark.parametrize("dtype", cpu_decode.DTYPES)
def test_a_steps_team_computes_what_a_team_per_loop_computes_at_any_thread_count(compiled, wide_model, monkeypatch,
                                                                                 dtype, few_rows):
    """Bursts on one team of 1, 2 and 3 threads, bursts whose loops fork a team each at 2, and the per-operation path
    at 2 (a team per loop): the same tokens and bit-identical log-probs. A share left out, or a thread that read x before the others had laid it out
    (a barrier missing), would show in the bits; an error or barrier met by some threads only would hang."""
    # every product on the loops, prefill included: torch's own kernels (MKL, where a machine's race picks them) give
    # other bits at another thread count, which would hide what this test compares
    monkeypatch.setattr(type(compiled), "rows_won", lambda self, dtype: frozenset(
        {*range(1, cpu_decode.MAX_PANEL_ROWS + 1), cpu_decode.PREFILL_ROWS}))
    monkeypatch.setenv("COLORL_CPU_DECODE_PANEL_ROWS", few_rows)
    reference = rollout(wide_model, dtype, 2, True, compiled)
    for threads, one_team in ((1, True), (2, True), (3, True), (2, False)):
        got = rollout(wide_model, dtype, threads, False, compiled, one_team)
        for mine, want in zip(got, reference):
            assert mine.output_ids == want.output_ids, (threads, one_team, mine.request_id)
            assert mine.logprobs == want.logprobs, (threads, one_team, mine.request_id)
    assert [len(r.output_ids) for r in reference] == [4 + 2 * i for i in range(11)]


# the first product (a few rows' norms are no loop of their own), a later one, a later layer's
@pytest.mark.parametrize("loop", [0, 7, 30])
def test_a_loop_that_fails_on_one_thread_stops_the_step_on_every_thread(compiled, wide_model, monkeypatch, loop):
    """The step's last thread alone fails one of its loops (colorl_team_fault, as a share whose memory ran out
    would): every thread of the team stops at that loop's barrier (one that went on alone would wait at the next
    barrier forever: the test would hang), the call raises one MemoryError, and the next burst runs whole again, with
    the tokens of a run that never failed."""
    monkeypatch.setattr(type(compiled), "rows_won", lambda self, dtype: frozenset(range(1, cpu_decode.MAX_ROWS + 1)))
    fault = compiled._lib.colorl_team_fault
    fault.argtypes, fault.restype = [ctypes.c_int64], ctypes.c_int
    requests = [GenerationRequest(str(i), list(range(10, 20 + i)),
                                  SamplingParams(max_new_tokens=6, ignore_eos=True, seed=i)) for i in range(3)]
    with pinned(2):
        clean = NativeEngine(wide_model, EngineConfig(num_blocks=64, block_size=4)).generate(requests)
        engine = NativeEngine(wide_model, EngineConfig(num_blocks=64, block_size=4))
        for request in requests:
            engine.add(request)
        engine.step()  # the prefill: torch's operators
        fault(loop)
        try:
            with pytest.raises(MemoryError, match="out of memory in the decode loops"):
                engine.step()
        finally:
            fault(-1)
    again = rollout_of(wide_model, requests)
    assert [r.output_ids for r in again] == [r.output_ids for r in clean]
    assert [r.logprobs for r in again] == [r.logprobs for r in clean]


def rollout_of(folder, requests) -> list:
    with pinned(2):
        return NativeEngine(folder, EngineConfig(num_blocks=64, block_size=4)).generate(requests)


def test_a_lines_round_trip_between_two_threads_is_measured(compiled):
    """colorl_core_trip (bench/two_ccds.py tags its rounds with it): two threads hand one line back and forth; a
    probe whose threads never met would hang (the timeout), one that skipped its trips would read 0."""
    trip = compiled.core_trip_ns(trips=200, runs=3)
    if len(os.sched_getaffinity(0)) < 2:
        assert trip == 0.0
    else:
        assert 1.0 < trip < 1e7  # ns: a few tens near, a few hundred across two L3s, a time slice at worst
