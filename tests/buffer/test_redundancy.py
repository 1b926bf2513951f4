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
