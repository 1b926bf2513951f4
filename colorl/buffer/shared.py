"""A staleness buffer shared by the rollout thread and the trainer thread.

The buffers themselves are single-threaded (the simulator's hot path takes no lock). In the
bounded-lag mode the rollout thread admits, completes and releases while the trainer thread
waits for and takes its batch: every call goes through one `threading.Condition`, and the
calls that can make a buffer Ready wake the waiting trainer.
"""

from __future__ import annotations

import threading
from typing import Callable

from colorl.buffer.base import BufferState, Slot, StalenessBuffer, Taken


class SharedBuffer:
    """Same methods as the wrapped buffer, each under the lock, plus `wait_ready` / `wake`."""

    def __init__(self, buffer: StalenessBuffer) -> None:
        self.buffer = buffer
        self._cond = threading.Condition()

    @property
    def in_flight(self) -> int:
        with self._cond:
            return self.buffer.in_flight

    def admit(self, slot: Slot) -> bool:
        with self._cond:
            return self.buffer.admit(slot)

    def complete(self, slot: Slot) -> list[Slot]:
        with self._cond:
            evicted = self.buffer.complete(slot)
            self._cond.notify_all()
            return evicted

    def release(self, slot: Slot) -> None:
        with self._cond:
            self.buffer.release(slot)
            self._cond.notify_all()  # entries of later buffers may have moved forward

    def take(self, version: int) -> Taken:
        with self._cond:
            return self.buffer.take(version)

    def ready(self, version: int) -> bool:
        with self._cond:
            return self.buffer.ready(version)

    def states(self, version: int) -> list[BufferState]:
        with self._cond:
            return self.buffer.states(version)

    def completed(self) -> list[Slot]:
        with self._cond:
            return self.buffer.completed()

    def restore(self, slots: list[Slot], version: int) -> list[Slot]:
        with self._cond:
            dropped = self.buffer.restore(slots, version)
            self._cond.notify_all()
            return dropped

    def wait_ready(self, version: int, timeout: float | None = None,
                   stop: Callable[[], bool] | None = None) -> bool:
        """Block until `take(version)` would return a batch (True), or until `timeout`
        seconds pass or `stop()` turns true after a `wake()` (False)."""
        with self._cond:
            done = self._cond.wait_for(
                lambda: self.buffer.ready(version) or (stop is not None and stop()), timeout)
            return bool(done) and self.buffer.ready(version)

    def wake(self) -> None:
        """Wake waiters so they re-check `stop` (the other thread failed, or a signal)."""
        with self._cond:
            self._cond.notify_all()
