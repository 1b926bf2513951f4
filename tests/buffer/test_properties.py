"""Property tests: random interleavings of admit / complete / abort / filter / take / publish
over many versions, for every buffer, η in 0..3 and 1..4 entries per step."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colorl.buffer import BUFFERS, Slot, make_buffer
from colorl.buffer.base import DROPPED, OCCUPIED, RELEASED, RESERVED, TAKEN

# (op, argument); repeats weight the draw toward progress (admissions, completions, new versions).
OPS = st.lists(st.tuples(st.sampled_from(["admit", "admit", "admit", "complete", "complete",
                                          "complete", "abort", "filter", "raise", "take",
                                          "take", "publish", "publish"]),
                         st.integers(0, 1000)), min_size=20, max_size=250)


class Driver:
    """Plays the trainer and the rollout side against one buffer and checks it after every
    operation. The trainer takes buffer `version`, then (a separate op) publishes version+1;
    the engine admits at the published version minus a lag of 0..2."""

    def __init__(self, name: str, capacity: int, eta: int, queue_factor: float) -> None:
        self.name, self.eta, self.capacity = name, eta, capacity
        self.buffer = make_buffer(name, capacity, queue_factor, eta)
        self.version = 0
        self.training = False
        self.admitted: list[Slot] = []
        self.ended: Counter[int] = Counter()  # id(slot) -> times seen ending

    def held(self, state: str) -> list[Slot]:
        return [s for s in self.admitted if s.state == state]

    def end(self, slots, state: str) -> None:
        for slot in slots:
            assert slot.state == state
            self.ended[id(slot)] += 1
            assert self.ended[id(slot)] == 1, f"{slot} ended twice"

    def step(self, op: str, arg: int) -> None:
        buf = self.buffer
        if op == "admit":
            slot = Slot(max(0, self.version - arg % 3), payload=len(self.admitted))
            before = buf.states(self.version)
            if buf.admit(slot):
                assert slot.state == RESERVED
                self.admitted.append(slot)
                if self.name == "staleflow":
                    self.check_reserve(slot, before)
            else:
                assert self.name == "staleflow"
                assert slot.state == "new"
                window = range(max(slot.v_traj, buf.next_buf), slot.v_traj + self.eta + 1)
                assert all(s.free == 0 for s in before if s.vbuf in window), "refused with room"
        elif op == "complete" and (reserved := self.held(RESERVED)):
            slot = reserved[arg % len(reserved)]
            evicted = buf.complete(slot)
            self.end(evicted, DROPPED)
            if self.name == "staleflow":  # greedy Occupy: every earlier buffer is full
                assert all(buf.buffers[v].free == 0 for v in range(buf.next_buf, slot.vbuf))
        elif op == "abort" and (reserved := self.held(RESERVED)):
            slot = reserved[arg % len(reserved)]
            buf.release(slot)
            self.end([slot], RELEASED)
        elif op == "filter" and (occupied := buf.completed()):
            slot = occupied[arg % len(occupied)]
            buf.release(slot)
            self.end([slot], RELEASED)
        elif op == "raise" and (reserved := self.held(RESERVED)):
            slot = reserved[arg % len(reserved)]
            slot.v_traj = min(self.version, slot.v_traj + 1)  # never past the published version
        elif op == "take" and not self.training:
            ready = buf.ready(self.version)
            batch, dropped = buf.take(self.version)
            self.end(dropped, DROPPED)
            assert ready == (batch is not None)
            if batch is not None:
                self.end(batch, TAKEN)
                assert len(batch) == self.capacity
                if buf.bounded:
                    assert all(self.version - s.v_traj <= self.eta for s in batch)
                if self.eta == 0 and self.name == "staleflow":
                    assert all(s.v_traj == self.version for s in batch)  # sync training
                self.training = True
        elif op == "publish" and self.training:
            self.training = False
            self.version += 1
        self.check()

    def check_reserve(self, slot: Slot, before) -> None:
        """Backward scan: the latest buffer in the window that had a free entry."""
        free = {s.vbuf: s.free for s in before}
        window = range(max(slot.v_traj, self.buffer.next_buf), slot.v_traj + self.eta + 1)
        assert slot.vbuf == max(v for v in window if free.get(v, self.capacity) > 0)

    def check(self) -> None:
        buf = self.buffer
        # every admitted slot is held exactly once or has ended exactly once
        held = [s for s in self.admitted if s.state in (RESERVED, OCCUPIED)]
        for s in self.admitted:
            assert (s.state in (RESERVED, OCCUPIED)) != (self.ended[id(s)] == 1), s
        assert buf.in_flight == sum(s.state == RESERVED for s in self.admitted)
        completed = buf.completed()
        assert len({id(s) for s in completed}) == len(completed)
        assert {id(s) for s in completed} == {id(s) for s in held if s.state == OCCUPIED}
        states = buf.states(self.version)
        if self.name == "staleflow":
            self.check_staleflow(held, states)
        else:
            (state,) = states
            assert state.occupied == len(completed) and state.reserved == buf.in_flight
            assert (state.state == "ready") == buf.ready(self.version)
            if self.name == "queue_drop":
                assert len(completed) <= buf.capacity

    def check_staleflow(self, held: list[Slot], states) -> None:
        buf = self.buffer
        entries = [s for b in buf.buffers.values() for s in (*b.reserved, *b.occupied)]
        assert sorted(map(id, entries)) == sorted(map(id, held)), "lost or duplicated entry"
        for vbuf, b in buf.buffers.items():
            assert vbuf >= buf.next_buf
            assert b.free >= 0 and b.free + len(b.reserved) + len(b.occupied) == self.capacity
            for s in (*b.reserved, *b.occupied):
                assert s.vbuf == vbuf and s.v_traj + self.eta >= vbuf
                if self.eta == 0:
                    assert s.v_traj == vbuf  # admission at version v only fills buffer v
            assert all(s.state == RESERVED for s in b.reserved)
            assert all(s.state == OCCUPIED for s in b.occupied)
        for st_ in states:
            b = buf.buffers.get(st_.vbuf)
            occupied = len(b.occupied) if b else 0
            assert (st_.state == "ready") == (occupied == self.capacity)
            assert (st_.state == "stuck") == (st_.free == 0 and st_.reserved > 0)
            assert (st_.state == "waiting") == (st_.free > 0)
        assert buf.ready(self.version) == (
            not self.training and self.version in buf.buffers
            and len(buf.buffers[self.version].occupied) == self.capacity)


@pytest.mark.parametrize("name", list(BUFFERS))
@settings(max_examples=150, deadline=None)
@given(ops=OPS, eta=st.integers(0, 3), capacity=st.integers(1, 4),
       queue_factor=st.sampled_from([1.0, 1.5, 2.0, 3.0]))
def test_random_interleavings_keep_the_invariants(name, ops, eta, capacity, queue_factor):
    driver = Driver(name, capacity, eta, queue_factor)
    for op, arg in ops:
        driver.step(op, arg)


@pytest.mark.parametrize("name", list(BUFFERS))
@settings(max_examples=60, deadline=None)
@given(ops=OPS, eta=st.integers(0, 3), capacity=st.integers(1, 4))
def test_restore_of_a_checkpoint_loses_nothing(name, ops, eta, capacity):
    """A checkpoint is taken between steps (trainer idle at `version`): its completed groups,
    restored into a fresh buffer at that version, all fit again, with the same bound (queue_max
    drops at once those it would discard at the next take)."""
    driver = Driver(name, capacity, eta, 2.0)
    for op, arg in ops:
        driver.step(op, arg)
    if driver.training:
        driver.step("publish", 0)
    saved = [Slot(s.v_traj, payload=s.payload) for s in driver.buffer.completed()]
    fresh = make_buffer(name, capacity, 2.0, eta)
    too_stale = [s for s in saved if name == "queue_max" and driver.version - s.v_traj > eta]
    assert fresh.restore(saved, driver.version) == too_stale
    assert sorted(s.payload for s in fresh.completed() + too_stale) == sorted(
        s.payload for s in saved)
    if name == "staleflow":
        assert all(s.v_traj + eta >= s.vbuf >= driver.version for s in fresh.completed())
