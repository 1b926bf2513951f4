"""The buffer as the bounded-lag producer (colorl/rollout/producer.py) drives it, checkpoints and resumes
included, for every buffer, η in 0..3, G/world in 1..3, with and without batch-level redundancy.

The producer admits a group at the engine's version (which trails the trainer's), stamps it at completion
with the oldest version that computed any of its state (its first prefill may run after a weight update,
never before admission), releases it if the zero-variance filter drops it, aborts the surplus groups a full
redundant buffer returns, and a checkpoint between steps keeps the completed groups (with that version) while
the groups in flight are re-issued. Whatever the order: no exception, every batch exactly G/world groups,
and each trained group within η of the oldest version that computed any of its state.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colorl.buffer import BUFFERS, Slot, make_buffer
from colorl.buffer.base import DROPPED, RELEASED, RESERVED, TAKEN

OPS = st.lists(st.tuples(st.sampled_from(["admit", "admit", "admit", "finish", "finish", "finish", "take", "publish",
                                          "apply", "checkpoint"]),
                         st.integers(0, 1000)), min_size=20, max_size=300)


class Producer:
    """The producer's calls, in its order; `oldest[id(slot)]` is the version a group's state starts at."""

    def __init__(self, name: str, groups: int, eta: int, surplus: int, rng: random.Random) -> None:
        self.name, self.groups, self.eta, self.surplus, self.rng = name, groups, eta, surplus, rng
        self.buffer = make_buffer(name, groups, 2.0, eta, surplus)
        self.version = self.engine = 0  # the trainer's published version; the one the engine serves
        self.training = False
        self.flying: list[Slot] = []
        self.oldest: dict[int, int] = {}
        self.trained = 0

    def step(self, op: str, arg: int) -> None:
        if op == "admit":
            slot = Slot(self.engine)
            if self.buffer.admit(slot):
                assert slot.state == RESERVED
                self.flying.append(slot)
        elif op == "finish" and self.flying:
            slot = self.flying.pop(arg % len(self.flying))
            first = self.rng.randint(slot.v_traj, self.engine)  # its first prefill: at admission or later
            self.oldest[id(slot)] = first
            slot.v_traj = max(slot.v_traj, first)
            zero_variance = arg % 5 == 0
            ended = self.buffer.release(slot) if zero_variance else self.buffer.complete(slot)
            for other in ended:  # queue_drop's evictions, or the surplus groups of a full redundant buffer
                assert other.state in (DROPPED, RELEASED)
                if other in self.flying:
                    self.flying.remove(other)
        elif op == "take" and not self.training:
            ready = self.buffer.ready(self.version)
            batch, _ = self.buffer.take(self.version)
            assert ready == (batch is not None)
            if batch is not None:
                assert len(batch) == self.groups, f"a batch of {len(batch)} groups, {self.groups} asked"
                assert all(slot.state == TAKEN for slot in batch)
                if self.buffer.bounded:
                    assert all(self.version - self.oldest[id(slot)] <= self.eta for slot in batch)
                self.trained += len(batch)
                self.training = True
        elif op == "publish" and self.training:
            self.training, self.version = False, self.version + 1
        elif op == "apply":
            self.engine = self.version
        elif op == "checkpoint" and not self.training:  # saved after a step, resumed in a fresh process
            saved = [Slot(slot.v_traj, payload=id(slot)) for slot in self.buffer.completed()]
            for copy, slot in zip(saved, self.buffer.completed()):
                self.oldest[id(copy)] = self.oldest[id(slot)]
            self.buffer = make_buffer(self.name, self.groups, 2.0, self.eta, self.surplus)
            self.buffer.restore(saved, self.version)
            self.flying, self.engine = [], self.version  # re-issued later as new admissions, at the saved weights


CASES = [(name, surplus) for name in BUFFERS for surplus in (0, 1, 2) if surplus == 0 or name == "staleflow"]


@pytest.mark.parametrize("name, surplus", CASES, ids=[f"{n}-surplus{s}" for n, s in CASES])
@settings(max_examples=120, deadline=None)
@given(ops=OPS, eta=st.integers(0, 3), groups=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_the_buffer_driven_like_the_producer_trains_whole_batches_within_eta(name, surplus, ops, eta, groups, seed):
    producer = Producer(name, groups, eta, surplus, random.Random(seed))
    for op, arg in ops:
        producer.step(op, arg)
