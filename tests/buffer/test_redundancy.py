"""Batch-level redundant rollout in the StaleFlow buffer: Ready at G/world occupied, the rest aborted."""

from hypothesis import given, settings
from hypothesis import strategies as st

from colorl.buffer import RedundantStaleFlowBuffers, Slot, make_buffer
from colorl.buffer.base import OCCUPIED, RELEASED, RESERVED, TAKEN


def test_a_full_buffer_aborts_its_slowest_reservations_and_is_ready():
    buf = make_buffer("staleflow", 2, eta=0, surplus=1)
    slots = [Slot(0, payload=i) for i in range(4)]
    assert [buf.admit(s) for s in slots] == [True, True, True, False]  # 2 + 1 surplus entries
    assert buf.complete(slots[2]) == []
    assert buf.complete(slots[0]) == [slots[1]]  # the one still generating is aborted
    assert slots[1].state == RELEASED
    assert buf.ready(0) and [s.payload for s in buf.take(0).batch] == [2, 0]
    assert buf.admit(slots[3]) is False  # η = 0: version 0's buffer is gone, version 1 not yet allowed


def test_a_restored_buffer_holds_one_batch_not_its_surplus_too():
    """G/world = 1, one surplus entry, η = 1: groups completed into buffers 5 and 6, checkpointed and
    restored at version 5, train one per step (the surplus entry of a restored buffer is not a batch place)."""
    buf = RedundantStaleFlowBuffers(1, eta=1, surplus=1)
    buf.restore([], 5)
    first, second = Slot(5, payload="a"), Slot(5, payload="b")
    assert buf.admit(first) and buf.admit(second)
    buf.complete(first), buf.complete(second)
    saved = [Slot(s.v_traj, payload=s.payload) for s in buf.completed()]
    assert [s.vbuf for s in buf.completed()] == [5, 6]
    fresh = RedundantStaleFlowBuffers(1, eta=1, surplus=1)
    assert fresh.restore(saved, 5) == []
    assert fresh.ready(5) and [s.payload for s in fresh.take(5).batch] == ["a"]
    assert fresh.ready(6) and [s.payload for s in fresh.take(6).batch] == ["b"]
    half = RedundantStaleFlowBuffers(2, eta=1, surplus=1)
    half.restore([Slot(5)], 5)
    assert half.states(5)[0].free == 2  # a buffer the restore did not fill keeps its surplus entry


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["admit", "complete", "complete", "take"]), st.integers(0, 99)),
                    max_size=200),
       groups=st.integers(1, 3), surplus=st.integers(1, 2), eta=st.integers(0, 2))
def test_redundant_buffers_keep_the_bound_and_end_every_slot_once(ops, groups, surplus, eta):
    buf = RedundantStaleFlowBuffers(groups, eta=eta, surplus=surplus)
    version, admitted, taken, aborted = 0, [], [], []
    for op, arg in ops:
        reserved = [s for s in admitted if s.state == RESERVED]
        if op == "admit":
            slot = Slot(max(0, version - arg % 2))
            if buf.admit(slot):
                admitted.append(slot)
        elif op == "complete" and reserved:
            evicted = buf.complete(reserved[arg % len(reserved)])
            assert all(s.state == RELEASED for s in evicted)
            aborted += evicted
        elif op == "take":
            batch = buf.take(version).batch
            if batch is not None:
                assert len(batch) == groups
                assert all(version - s.v_traj <= eta for s in batch)
                assert all(s.state == TAKEN for s in batch)
                taken += batch
                version += 1
    ids = [id(s) for s in taken + aborted]
    assert len(ids) == len(set(ids))  # nothing ends twice
    held = [s for s in admitted if s.state in (RESERVED, OCCUPIED)]
    assert len(held) + len(taken) + len(aborted) == len(admitted)  # nothing lost


def test_releasing_a_reserved_group_that_fills_a_buffer_closes_it():
    """Issue 19 item 12: G/world = 1, one surplus entry, η = 1. P, Q admitted at v0 (buffer 1), R at v1
    (buffer 2) finishes first; P is released for zero variance while still reserved. Pulling R forward
    fills buffer 1, which must then abort Q and close, as a completion that fills it would: otherwise
    buffer 1 is taken while Q holds a reservation in it (the rollout thread's KeyError)."""
    buf = make_buffer("staleflow", 1, eta=1, surplus=1)
    p, q, f = Slot(0, "P"), Slot(0, "Q"), Slot(0, "F")
    assert buf.admit(p) and buf.admit(q) and p.vbuf == q.vbuf == 1
    assert buf.admit(f) and f.vbuf == 0 and buf.complete(f) == []
    assert [s.payload for s in buf.take(0).batch] == ["F"]  # the trainer is at v1
    r = Slot(1, "R")
    assert buf.admit(r) and r.vbuf == 2
    assert buf.complete(r) == [] and r.vbuf == 2
    aborted = buf.release(p)
    assert aborted == [q] and q.state == RELEASED  # the rest aborted, the buffer closed
    assert buf.ready(1) and [s.payload for s in buf.take(1).batch] == ["R"]
    assert buf.in_flight == 0


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["admit", "complete", "release", "take"]), st.integers(0, 99)),
                    max_size=200),
       groups=st.integers(1, 3), surplus=st.integers(1, 2), eta=st.integers(0, 2))
def test_releases_with_redundancy_never_take_a_held_buffer_or_an_oversized_batch(ops, groups, surplus, eta):
    """Zero-variance releases (of reserved or occupied groups) mixed in: every batch has exactly G/world
    groups within η, no reservation is left in a consumed buffer, and every slot ends once."""
    buf = RedundantStaleFlowBuffers(groups, eta=eta, surplus=surplus)
    version, admitted, ended = 0, [], []
    for op, arg in ops:
        held = [s for s in admitted if s.state in (RESERVED, OCCUPIED)]
        reserved = [s for s in held if s.state == RESERVED]
        if op == "admit":
            slot = Slot(max(0, version - arg % 2))
            if buf.admit(slot):
                admitted.append(slot)
        elif op == "complete" and reserved:
            ended += buf.complete(reserved[arg % len(reserved)])
        elif op == "release" and held:
            slot = held[arg % len(held)]
            aborted = buf.release(slot)
            assert all(s.state == RELEASED for s in aborted)
            ended += [slot] + aborted
        elif op == "take":
            batch = buf.take(version).batch
            if batch is not None:
                assert len(batch) == groups and all(version - s.v_traj <= eta for s in batch)
                assert all(s.vbuf != version for s in admitted if s.state == RESERVED)  # no reservation left in it
                ended += batch
                version += 1
        for vbuf, entry in buf.buffers.items():  # a full buffer is closed
            assert len(entry.occupied) <= groups
            assert not (len(entry.occupied) == groups and entry.reserved)
    ids = [id(s) for s in ended]
    assert len(ids) == len(set(ids))
    assert len([s for s in admitted if s.state in (RESERVED, OCCUPIED)]) + len(ended) == len(admitted)


def test_a_buffer_that_restored_groups_fill_is_closed():
    """After a resume, restored groups can fill a buffer: it must close at once, or a new reservation
    enters a Ready buffer that the trainer then takes with the reservation inside (the rollout
    thread's KeyError when that group finishes)."""
    buf = make_buffer("staleflow", 1, eta=1, surplus=1)
    restored = Slot(0, "A")
    assert buf.restore([restored], version=0) == [] and restored.vbuf == 0
    later = [Slot(0, name) for name in "BCD"]
    assert [buf.admit(s) for s in later] == [True, True, False]  # buffer 1's two entries; buffer 0 is closed
    assert [s.payload for s in buf.take(0).batch] == ["A"]
    assert all(s.vbuf == 1 for s in later[:2])
