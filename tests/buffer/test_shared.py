"""`SharedBuffer`: a rollout thread fills, the trainer thread waits for Ready and takes."""

import threading
import time

from colorl.buffer import SharedBuffer, Slot, make_buffer


def test_trainer_waits_for_the_rollout_thread():
    shared = SharedBuffer(make_buffer("staleflow", 4, 1.0, 1))
    taken: list[list[Slot]] = []

    def rollout():
        for version in range(3):
            while len(taken) < version:  # the engine sees version v once buffer v-1 is taken
                time.sleep(0.001)
            slots = [Slot(version) for _ in range(4)]
            for slot in slots:
                while not shared.admit(slot):
                    time.sleep(0.001)
            for slot in slots:
                time.sleep(0.002)
                shared.complete(slot)

    thread = threading.Thread(target=rollout)
    thread.start()
    for version in range(3):
        assert shared.wait_ready(version, timeout=10)
        batch, _ = shared.take(version)
        assert len(batch) == 4 and all(version - s.v_traj <= 1 for s in batch)
        taken.append(batch)
    thread.join(timeout=10)
    assert not thread.is_alive() and shared.in_flight == 0


def test_wait_ends_on_timeout_and_on_stop():
    shared = SharedBuffer(make_buffer("queue_drop", 2))
    start = time.monotonic()
    assert not shared.wait_ready(0, timeout=0.05)
    assert time.monotonic() - start >= 0.05
    stopping = threading.Event()
    result = []
    waiter = threading.Thread(target=lambda: result.append(
        shared.wait_ready(0, timeout=10, stop=stopping.is_set)))
    waiter.start()
    stopping.set()
    shared.wake()
    waiter.join(timeout=5)
    assert result == [False]
