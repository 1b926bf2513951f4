"""StaleFlow's virtual staleness buffers (staleflow paper §4.2-4.3).

One buffer per policy version V_buf with `groups_per_step` entries; buffer V_buf is trained
from version V_buf, and every group in it satisfies V_traj + η >= V_buf, so no group is ever
trained staler than η. Entries are interchangeable, so a buffer is a free count and two lists.

- Reserve (`admit`): backward scan from V_traj + η down to max(V_traj, oldest unconsumed
  buffer); the latest free entry (worst case: where the group may still train).
- Occupy (`complete`): delete the reservation with the paper's entry movement (the earliest
  reservation that may live in the hole moves into it, cascading toward earlier buffers), then
  take the earliest free entry (greedy: occupied entries gather in early buffers).
- Consume (`take`): buffer v when all its entries are occupied (Ready) and the trainer is at v.
- Release (abort, filter; Fig. 8c): the freed entry is refilled like a deletion, then occupied
  entries of later buffers move forward into where the hole ends, so a buffer that lost a
  group becomes Ready without waiting for a new one.

Deviations from the paper: one rank's buffers hold its own groups (capacity G/world, and the
ranks consume in lock-step), not the global batch; the paper does not say how a released
occupied entry is refilled, so it follows the deletion rule above (reserved entries move back,
occupied ones forward, each cascade run once).
"""

from __future__ import annotations

from colorl.buffer.base import (DROPPED, NEW, OCCUPIED, RELEASED, RESERVED, TAKEN, BufferState,
                                Slot, Taken, check_eta, check_groups, expect)


class _Buffer:
    __slots__ = ("free", "reserved", "occupied")

    def __init__(self, capacity: int) -> None:
        self.free = capacity
        self.reserved: list[Slot] = []
        self.occupied: list[Slot] = []


class StaleFlowBuffers:
    """Buffers `next_buf`, `next_buf + 1`, ... (older ones are consumed). `in_flight` is a
    property: the number of reserved entries."""

    bounded = True

    def __init__(self, groups_per_step: int, queue_factor: float = 1.0,
                 eta: int | None = None) -> None:
        self.groups_per_step = check_groups(groups_per_step)
        self.eta = check_eta("staleflow", eta)
        self.capacity = self.groups_per_step  # entries of a new buffer
        self.buffers: dict[int, _Buffer] = {}
        self.next_buf = 0  # oldest buffer not yet consumed

    @property
    def in_flight(self) -> int:
        return sum(len(buf.reserved) for buf in self.buffers.values())

    def _buffer(self, vbuf: int) -> _Buffer:
        buf = self.buffers.get(vbuf)
        if buf is None:
            buf = self.buffers[vbuf] = _Buffer(self.capacity)
        return buf

    def admit(self, slot: Slot) -> bool:
        if slot.state != NEW:  # hot path in the simulator: no call unless it fails
            expect(slot, NEW)
        v_traj = slot.v_traj
        return self._take_entry(slot, range(v_traj + self.eta, max(v_traj, self.next_buf) - 1, -1), RESERVED)

    def _take_entry(self, slot: Slot, vbufs: range, state: str) -> bool:
        """Put `slot` into the first of `vbufs` with a free entry, as reserved or occupied: Reserve
        scans latest first, Occupy and restore earliest first."""
        for vbuf in vbufs:
            buf = self._buffer(vbuf)
            if buf.free:
                buf.free -= 1
                (buf.reserved if state == RESERVED else buf.occupied).append(slot)
                slot.vbuf = vbuf
                slot.state = state
                return True
        return False

    def _earliest_movable(self, hole: int) -> tuple[_Buffer, Slot] | None:
        """The earliest reservation that may move into buffer `hole` (V_traj + η >= hole)."""
        for vbuf in range(self.next_buf, hole):
            buf = self.buffers.get(vbuf)
            if buf is None:
                continue
            for other in buf.reserved:
                if other.v_traj + self.eta >= hole:
                    return buf, other
        return None

    def _delete(self, slot: Slot, entries: list[Slot]) -> int:
        """Free `slot`'s entry; reservations cascade into the hole (paper Fig. 7 right).
        Returns the buffer where the free entry ends."""
        hole = slot.vbuf
        buf = self.buffers[hole]
        entries.remove(slot)
        buf.free += 1
        slot.vbuf = -1
        while (found := self._earliest_movable(hole)) is not None:
            src, other = found
            src.reserved.remove(other)
            src.free += 1
            dst = self.buffers[hole]
            dst.reserved.append(other)
            dst.free -= 1
            hole, other.vbuf = other.vbuf, hole
        return hole

    def complete(self, slot: Slot) -> list[Slot]:
        if slot.state != RESERVED:
            expect(slot, RESERVED)
        hole = self._delete(slot, self.buffers[slot.vbuf].reserved)
        if not self._take_entry(slot, range(self.next_buf, hole + 1), OCCUPIED):  # a fresh buffer is all free
            raise AssertionError("occupy found no free entry")  # the hole itself is free
        return []

    def release(self, slot: Slot) -> list[Slot]:
        expect(slot, RESERVED, OCCUPIED)
        buf = self.buffers[slot.vbuf]
        hole = self._delete(slot, buf.reserved if slot.state == RESERVED else buf.occupied)
        slot.state = RELEASED
        last = max(self.buffers)
        while True:  # pull the earliest later occupied entry forward into the hole
            src = next((b for v in range(hole + 1, last + 1)
                        if (b := self.buffers.get(v)) is not None and b.occupied), None)
            if src is None:
                return []
            moved = src.occupied.pop(0)
            src.free += 1
            dst = self.buffers[hole]
            dst.occupied.append(moved)
            dst.free -= 1
            hole, moved.vbuf = moved.vbuf, hole

    def ready(self, version: int) -> bool:
        buf = self.buffers.get(version)
        return (version == self.next_buf and buf is not None
                and len(buf.occupied) == self.groups_per_step)

    def take(self, version: int) -> Taken:
        if version != self.next_buf:
            raise ValueError(f"take({version}): the next buffer to consume is {self.next_buf}")
        buf = self.buffers.get(version)
        if buf is None or len(buf.occupied) < self.groups_per_step:
            return Taken(None, [])
        del self.buffers[version]
        self.next_buf = version + 1
        for slot in buf.occupied:
            slot.state = TAKEN
            slot.vbuf = -1
        return Taken(buf.occupied, [])

    def states(self, version: int) -> list[BufferState]:
        """Buffers from the oldest unconsumed one to the latest one a group admitted at
        `version` could reserve (or the latest holding an entry)."""
        last = max([version + self.eta, *self.buffers])
        out = []
        for vbuf in range(self.next_buf, last + 1):
            buf = self.buffers.get(vbuf)
            free, reserved, occupied = ((buf.free, len(buf.reserved), len(buf.occupied))
                                        if buf else (self.groups_per_step, 0, 0))
            state = "waiting" if free else ("stuck" if reserved else "ready")
            out.append(BufferState(vbuf, state, free, reserved, occupied))
        return out

    def completed(self) -> list[Slot]:
        return [slot for vbuf in sorted(self.buffers) for slot in self.buffers[vbuf].occupied]

    def restore(self, slots: list[Slot], version: int) -> list[Slot]:
        """Oldest V_traj first (the tightest deadline), each into the earliest buffer >= version
        it may use; all deadlines start at `version`, so this fits as many as any order can."""
        if any(buf.reserved or buf.occupied for buf in self.buffers.values()):
            raise ValueError("restore needs an empty buffer")
        self.buffers.clear()
        self.next_buf = version
        dropped = []
        for slot in sorted(slots, key=lambda s: s.v_traj):
            if not self._take_entry(slot, range(max(version, slot.v_traj), slot.v_traj + self.eta + 1), OCCUPIED):
                slot.vbuf = -1
                slot.state = DROPPED
                dropped.append(slot)
        return dropped


class RedundantStaleFlowBuffers(StaleFlowBuffers):
    """Batch-level redundant rollout (paper Fig. 8b): every buffer has `surplus` extra entries
    and is Ready as soon as `groups_per_step` of them are occupied; its reservations still in
    flight are then aborted (returned by `complete` or `release`, state "released") and the buffer closes,
    so the slowest groups of a step never hold it up. Shifts lengths short: the aborted groups
    are the long ones."""

    def __init__(self, groups_per_step: int, queue_factor: float = 1.0, eta: int | None = None,
                 surplus: int = 1) -> None:
        super().__init__(groups_per_step, queue_factor, eta)
        if surplus < 1:
            raise ValueError(f"surplus must be >= 1, got {surplus}")
        self.surplus = surplus
        self.capacity = groups_per_step + surplus

    def complete(self, slot: Slot) -> list[Slot]:
        super().complete(slot)
        return self._close_full()

    def release(self, slot: Slot) -> list[Slot]:
        """A release pulls occupied entries forward and may fill a buffer that still has
        reservations: it closes like one that a completion filled."""
        super().release(slot)
        return self._close_full()

    def restore(self, slots: list[Slot], version: int) -> list[Slot]:
        """Restored groups fill at most `groups_per_step` entries of a buffer: a buffer they fill is
        closed at once, as one a completion filled (its surplus entries would otherwise hold groups
        that `take` hands out with the batch); the others get their surplus entries back."""
        self.capacity = self.groups_per_step
        try:
            dropped = super().restore(slots, version)
        finally:
            self.capacity = self.groups_per_step + self.surplus
        for buf in self.buffers.values():
            if len(buf.occupied) < self.groups_per_step:
                buf.free += self.surplus
        return dropped

    def _close_full(self) -> list[Slot]:
        """Every buffer with `groups_per_step` occupied entries: abort its reservations, close it."""
        aborted = []
        for buf in self.buffers.values():
            if len(buf.occupied) >= self.groups_per_step and (buf.reserved or buf.free):
                for other in buf.reserved:
                    other.state, other.vbuf = RELEASED, -1
                aborted += buf.reserved
                buf.reserved, buf.free = [], 0
        return aborted
