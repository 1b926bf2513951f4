"""Hand-worked cases from the StaleFlow paper's Figures 7 and 8, and the queues' rules."""

import subprocess
import sys

import pytest

from colorl.buffer import BOUNDED, BUFFERS, BufferState, Slot, make_buffer
from colorl.buffer.base import DROPPED, OCCUPIED, RELEASED, RESERVED, TAKEN
from colorl.buffer.queues import QueueDrop
from colorl.buffer.staleflow import StaleFlowBuffers


def layout(buf: StaleFlowBuffers) -> dict[int, tuple[list[str], list[str]]]:
    """vbuf -> (reserved names, occupied names); slots carry their name as payload."""
    return {v: ([s.payload for s in b.reserved], [s.payload for s in b.occupied])
            for v, b in sorted(buf.buffers.items()) if b.reserved or b.occupied}


def slots(names: str, v_traj: int) -> list[Slot]:
    return [Slot(v_traj, payload=name) for name in names]


def test_reserve_scans_backward_and_occupy_forward():
    buf = StaleFlowBuffers(2, eta=1)
    a, b, c, d = slots("abcd", 0)
    assert all(buf.admit(s) for s in (a, b, c, d))
    assert [s.vbuf for s in (a, b, c, d)] == [1, 1, 0, 0]  # latest free entry first
    assert not buf.admit(Slot(0))  # buffers 0 and 1 are full
    buf.complete(a)  # a's hole in buffer 1 takes c's reservation; a occupies buffer 0
    assert layout(buf) == {0: (["d"], ["a"]), 1: (["b", "c"], [])}
    assert buf.take(0) == (None, [])  # d still in flight
    buf.complete(b)
    batch, dropped = buf.take(0)
    assert [s.payload for s in batch] == ["a", "b"] and dropped == []
    assert all(s.state == TAKEN for s in batch)
    assert buf.next_buf == 1 and layout(buf) == {1: (["c", "d"], [])}


def test_occupy_takes_the_earliest_free_entry_even_in_an_untouched_buffer():
    buf = StaleFlowBuffers(1, eta=1)
    a = Slot(0, payload="a")
    assert buf.admit(a) and a.vbuf == 1  # worst case: the latest buffer
    buf.complete(a)
    assert a.vbuf == 0 and buf.ready(0)  # greedy: trained at once, staleness 0


def test_entry_movement_cascades():
    """Fig. 7 right, η = 2, one entry per buffer: A is deleted from buffer 3; the earliest
    reservation that may live there (B, V_B + η >= 3) moves in, then C (V_C = 0, allowed in
    buffer 2 but not 3) moves into B's former place, and A occupies the hole left in buffer 1."""
    buf = StaleFlowBuffers(1, eta=2)
    buf.restore([], version=1)  # trainer at version 1; a lagging engine still admits V_traj 0
    (a,), (b,), (c,) = slots("A", 1), slots("B", 1), slots("C", 0)
    assert buf.admit(a) and buf.admit(b) and buf.admit(c)
    assert layout(buf) == {1: (["C"], []), 2: (["B"], []), 3: (["A"], [])}
    buf.complete(a)
    assert layout(buf) == {1: ([], ["A"]), 2: (["C"], []), 3: (["B"], [])}
    assert buf.ready(1) and not buf.ready(2)


def test_stuck_buffers_block_old_versions_only():
    """Fig. 7 left at T2': a full buffer with an entry in flight is Stuck; it blocks further
    V_traj = 1 admissions while V_traj = 2 may still reserve the next buffer."""
    buf = StaleFlowBuffers(2, eta=1)
    buf.restore([], version=1)
    a, b, c, d = slots("abcd", 1)
    assert all(buf.admit(s) for s in (a, b, c, d))  # buffers 2, 2, 1, 1
    buf.complete(a)  # occupies buffer 1 (c's reservation moved to buffer 2)
    assert [(s.vbuf, s.state, s.free, s.reserved, s.occupied) for s in buf.states(1)] == [
        (1, "stuck", 0, 1, 1), (2, "stuck", 0, 2, 0)]
    assert not buf.admit(Slot(1)) and not buf.ready(1)
    buf.complete(d)
    assert buf.states(1)[0] == BufferState(1, "ready", 0, 0, 2)
    assert buf.take(1).batch is not None
    assert not buf.admit(Slot(1))  # buffer 2 is still Stuck (b, c in flight)
    late = Slot(2)
    assert buf.admit(late) and late.vbuf == 3
    assert [s.state for s in buf.states(2)] == ["stuck", "waiting"]


def test_group_entry_uses_the_oldest_member_version():
    """Fig. 8a: one entry per group, reserved until every sample is done; with partial rollout
    a group whose first sample started at version 0 counts as V_traj = 0 even if the others
    started at 1, so it may not land in a buffer later than 0 + η."""
    buf = StaleFlowBuffers(1, eta=1)
    buf.restore([], version=1)
    member_versions = [1, 0, 1]
    group = Slot(min(member_versions), payload="G")
    assert buf.admit(group) and group.vbuf == 1  # not buffer 2: 0 + η = 1
    fresh = Slot(1, payload="F")
    assert buf.admit(fresh) and fresh.vbuf == 2
    assert not buf.admit(Slot(0))
    buf.complete(fresh)  # buffer 1 is taken by G: F occupies buffer 2
    assert layout(buf) == {1: (["G"], []), 2: ([], ["F"])}


def test_filtering_moves_later_occupied_entries_forward():
    """Fig. 8c: releasing an entry (abort of a reserved one, or a filtered occupied one) lets
    occupied entries of later buffers move forward, so the early buffer fills up sooner."""
    buf = StaleFlowBuffers(2, eta=1)
    buf.restore([], version=1)
    x, y = slots("XY", 0)  # a lagging engine: may train only from buffer 1
    z, w = slots("ZW", 1)
    assert all(buf.admit(s) for s in (x, y, z, w))
    buf.complete(z)
    buf.complete(w)  # buffer 1 is full of X, Y reservations: Z, W wait in buffer 2
    assert layout(buf) == {1: (["X", "Y"], []), 2: ([], ["Z", "W"])}
    assert [s.state for s in buf.states(1)] == ["stuck", "ready"]
    buf.release(x)  # aborted: Z moves forward into its entry
    assert x.state == RELEASED and x.vbuf == -1
    assert layout(buf) == {1: (["Y"], ["Z"]), 2: ([], ["W"])}
    buf.release(z)  # filtered after it was occupied: W moves forward
    assert layout(buf) == {1: (["Y"], ["W"])}
    buf.complete(y)
    batch, _ = buf.take(1)
    assert [s.payload for s in batch] == ["W", "Y"]
    assert max(1 - s.v_traj for s in batch) == 1  # within η


def test_release_refills_like_a_deletion():
    """A freed entry is refilled like a deletion (the earliest reservation that may live there
    moves in), then occupied entries move forward into where the hole ends."""
    buf = StaleFlowBuffers(1, eta=1)
    a, b = slots("ab", 0)
    assert buf.admit(a) and buf.admit(b)  # a -> 1, b -> 0
    c = Slot(0, payload="c")
    buf.release(a)  # b moves back to buffer 1, buffer 0 is free again
    assert layout(buf) == {1: (["b"], [])}
    assert buf.admit(c) and c.vbuf == 0


def test_eta_zero_is_sync():
    buf = StaleFlowBuffers(2, eta=0)
    group = slots("abc", 0)
    assert buf.admit(group[0]) and buf.admit(group[1])
    assert not buf.admit(group[2])  # only buffer 0 exists for version 0
    for s in group[:2]:
        buf.complete(s)
    assert buf.take(0).batch == group[:2]
    assert not buf.admit(Slot(0))  # version 0 data can no longer be trained
    assert buf.admit(Slot(1)) and buf.states(1)[0].vbuf == 1


def test_queue_drop_evicts_the_oldest():
    buf = make_buffer("queue_drop", 2, 1.5, None)  # Q = max(2, round(3.0)) = 3
    assert isinstance(buf, QueueDrop) and buf.capacity == 3
    group = slots("abcde", 0)
    assert all(buf.admit(s) for s in group) and buf.in_flight == 5
    evicted = [buf.complete(s) for s in group]
    assert [[s.payload for s in e] for e in evicted] == [[], [], [], ["a"], ["b"]]
    assert group[0].state == DROPPED and buf.in_flight == 0
    batch, dropped = buf.take(7)  # no bound: any version
    assert [s.payload for s in batch] == ["c", "d"] and dropped == []
    assert [s.payload for s in buf.completed()] == ["e"]
    assert make_buffer("queue_drop", 4, 1.0).capacity == 4


def test_queue_max_discards_at_consume():
    buf = make_buffer("queue_max", 2, 1.0, 1)
    group = [Slot(v, payload=n) for n, v in zip("abcd", (0, 1, 0, 2))]
    for s in group:
        buf.admit(s)
        assert buf.complete(s) == []  # unbounded: never evicts
    assert buf.ready(1) and buf.ready(2)
    batch, dropped = buf.take(2)  # staleness of a and c would be 2 > η
    assert [s.payload for s in dropped] == ["a", "c"] and all(s.state == DROPPED for s in dropped)
    assert [s.payload for s in batch] == ["b", "d"]
    assert buf.take(2) == (None, [])


def test_queue_release_and_states():
    buf = make_buffer("queue_drop", 2, 2.0)
    a, b, c = slots("abc", 0)
    for s in (a, b, c):
        buf.admit(s)
    buf.complete(a)
    buf.release(b)  # aborted while in flight
    assert buf.states(3) == [BufferState(3, "waiting", 1, 1, 1)]
    buf.release(a)  # filtered after completion
    assert buf.completed() == [] and buf.in_flight == 1
    with pytest.raises(ValueError):
        buf.release(a)


def test_restore_oldest_first_and_drops_what_no_longer_fits():
    buf = StaleFlowBuffers(1, eta=1)
    fresh, old, too_old = Slot(3, "fresh"), Slot(2, "old"), Slot(1, "too old")
    dropped = buf.restore([fresh, too_old, old], version=3)
    assert dropped == [too_old] and too_old.state == DROPPED
    assert layout(buf) == {3: ([], ["old"]), 4: ([], ["fresh"])}  # in given order, old would drop
    assert buf.take(3).batch == [old]
    qmax = make_buffer("queue_max", 1, 1.0, 1)
    assert qmax.restore([Slot(1), Slot(3)], version=3)[0].v_traj == 1
    qdrop = make_buffer("queue_drop", 1, 2.0)
    assert [s.payload for s in qdrop.restore(slots("abc", 0), version=5)] == ["a"]
    with pytest.raises(ValueError):
        qdrop.restore([], version=5)  # not a fresh buffer


def test_misuse_fails_loudly():
    buf = StaleFlowBuffers(1, eta=1)
    slot = Slot(0)
    with pytest.raises(ValueError):
        buf.complete(slot)  # never admitted
    buf.admit(slot)
    with pytest.raises(ValueError):
        buf.admit(slot)
    with pytest.raises(ValueError):
        buf.take(1)  # buffer 0 comes first
    with pytest.raises(ValueError, match="unknown buffer"):
        make_buffer("fifo", 1)
    for name in BOUNDED:
        with pytest.raises(ValueError, match="eta"):
            make_buffer(name, 1, 1.0, None)
    with pytest.raises(ValueError):
        make_buffer("queue_drop", 0)
    assert set(BOUNDED) == {"staleflow", "queue_max"} and set(BUFFERS) == {
        "staleflow", "queue_drop", "queue_max"}


def test_importing_the_buffer_does_not_import_torch():
    code = ("import sys, colorl.buffer, colorl.staleness.simulator; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
