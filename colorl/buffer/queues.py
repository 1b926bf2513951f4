"""The seed's two queues (staleness-formulas appendix): no admission control, a FIFO of
finished groups, the trainer takes the oldest `groups_per_step`.

- `queue_drop`: Q = max(G, round(q·G)) groups; a completion into a full queue evicts the
  oldest group. Unbiased in length: eviction depends on queue position only. No staleness
  bound (η is ignored).
- `queue_max`: unbounded (the seed does not say whether it is capacity-bound; here it is
  not); at consume time groups with version − V_traj > η are discarded. Biased toward short
  answers: long samples accrue more versions while generating.

`in_flight` is a property: groups admitted and not yet completed or released.
"""

from __future__ import annotations

from collections import deque

from colorl.buffer.base import (DROPPED, NEW, OCCUPIED, RELEASED, RESERVED, TAKEN, BufferState,
                                Slot, Taken, check_eta, check_groups, expect)


class _Queue:
    bounded = False

    def __init__(self, groups_per_step: int, queue_factor: float = 1.0,
                 eta: int | None = None) -> None:
        self.groups_per_step = check_groups(groups_per_step)
        self.eta = eta
        self.queue: deque[Slot] = deque()
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def admit(self, slot: Slot) -> bool:
        if slot.state != NEW:  # hot path in the simulator: no call unless it fails
            expect(slot, NEW)
        slot.state = RESERVED
        self._in_flight += 1
        return True

    def complete(self, slot: Slot) -> list[Slot]:
        if slot.state != RESERVED:
            expect(slot, RESERVED)
        self._in_flight -= 1
        slot.state = OCCUPIED
        self.queue.append(slot)
        return self._evict()

    def _evict(self) -> list[Slot]:
        return []

    def release(self, slot: Slot) -> list[Slot]:
        expect(slot, RESERVED, OCCUPIED)
        if slot.state == RESERVED:
            self._in_flight -= 1
        else:
            self.queue.remove(slot)
        slot.state = RELEASED
        return []

    def _batch(self) -> list[Slot]:
        popleft = self.queue.popleft
        batch = [popleft() for _ in range(self.groups_per_step)]
        for slot in batch:
            slot.state = TAKEN
        return batch

    def states(self, version: int) -> list[BufferState]:
        queued, need = len(self.queue), self.groups_per_step
        return [BufferState(version, "ready" if self.ready(version) else "waiting",
                            max(0, need - queued), self._in_flight, queued)]

    def completed(self) -> list[Slot]:
        return list(self.queue)

    def _fits(self, slot: Slot, version: int) -> bool:
        return True

    def restore(self, slots: list[Slot], version: int) -> list[Slot]:
        if self.queue or self._in_flight:
            raise ValueError("restore needs an empty buffer")
        dropped = []
        for slot in slots:
            if self._fits(slot, version):
                slot.state = OCCUPIED
                self.queue.append(slot)
                dropped += self._evict()
            else:
                slot.state = DROPPED
                dropped.append(slot)
        return dropped


class QueueDrop(_Queue):
    """Bounded FIFO of Q groups; the oldest is evicted when a completion overfills it."""

    def __init__(self, groups_per_step: int, queue_factor: float = 1.0,
                 eta: int | None = None) -> None:
        super().__init__(groups_per_step, queue_factor, eta)
        self.capacity = max(self.groups_per_step, round(queue_factor * self.groups_per_step))

    def _evict(self) -> list[Slot]:
        if len(self.queue) > self.capacity:
            oldest = self.queue.popleft()
            oldest.state = DROPPED
            return [oldest]
        return []

    def ready(self, version: int) -> bool:
        return len(self.queue) >= self.groups_per_step

    def take(self, version: int) -> Taken:
        if len(self.queue) < self.groups_per_step:
            return Taken(None, [])
        return Taken(self._batch(), [])


class QueueMax(_Queue):
    """Unbounded FIFO; groups staler than η at the consuming version are discarded."""

    bounded = True

    def __init__(self, groups_per_step: int, queue_factor: float = 1.0,
                 eta: int | None = None) -> None:
        super().__init__(groups_per_step, queue_factor, check_eta("queue_max", eta))

    def _fits(self, slot: Slot, version: int) -> bool:
        return slot.v_traj >= version - self.eta

    def ready(self, version: int) -> bool:
        oldest_ok = version - self.eta
        return sum(slot.v_traj >= oldest_ok for slot in self.queue) >= self.groups_per_step

    def take(self, version: int) -> Taken:
        oldest_ok = version - self.eta
        dropped = [slot for slot in self.queue if slot.v_traj < oldest_ok]
        if dropped:
            self.queue = deque(slot for slot in self.queue if slot.v_traj >= oldest_ok)
            for slot in dropped:
                slot.state = DROPPED
        if len(self.queue) < self.groups_per_step:
            return Taken(None, dropped)
        return Taken(self._batch(), dropped)
