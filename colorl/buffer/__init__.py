"""Staleness buffers: which groups may start, where finished groups wait, what the trainer
takes. One implementation for the bounded-lag mode and the simulator (pure Python, no torch).

- `base`: `Slot` (one group's place), the `StalenessBuffer` protocol, `Taken`, `BufferState`.
- `staleflow`: StaleFlow's virtual buffers per version (Reserve / Occupy / Consume), η-bounded.
- `queues`: `queue_drop` (bounded, evicts the oldest) and `queue_max` (discards staler than η).
"""

from __future__ import annotations

from colorl.buffer.base import BufferState, Slot, StalenessBuffer, Taken
from colorl.buffer.queues import QueueDrop, QueueMax
from colorl.buffer.staleflow import RedundantStaleFlowBuffers, StaleFlowBuffers

BUFFERS: dict[str, type] = {"staleflow": StaleFlowBuffers, "queue_drop": QueueDrop,
                            "queue_max": QueueMax}

# Buffers that never hand out a group with version - V_traj > η.
BOUNDED = tuple(name for name, cls in BUFFERS.items() if cls.bounded)


def make_buffer(name: str, groups_per_step: int, queue_factor: float = 1.0,
                eta: int | None = None, surplus: int = 0) -> StalenessBuffer:
    """`groups_per_step`: groups one rank trains per step (G / world in the real mode);
    `surplus` > 0: batch-level redundant rollout, extra entries per StaleFlow buffer."""
    cls = BUFFERS.get(name)
    if cls is None:
        raise ValueError(f"unknown buffer {name!r}; one of {', '.join(BUFFERS)}")
    if surplus:
        if cls is not StaleFlowBuffers:
            raise ValueError(f"batch-level redundancy needs the staleflow buffer, not {name!r}")
        return RedundantStaleFlowBuffers(groups_per_step, queue_factor, eta, surplus)
    return cls(groups_per_step, queue_factor, eta)


__all__ = ["BOUNDED", "BUFFERS", "BufferState", "QueueDrop", "QueueMax", "RedundantStaleFlowBuffers", "Slot",
           "StaleFlowBuffers", "StalenessBuffer", "Taken", "make_buffer"]
