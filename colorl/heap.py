"""A CPU rank's freed heap pages, given back to the OS where the trainer has freed what it used.

colorl's CPU ranks keep their heap (`launch.CPU_RANK_ENV`: no mmap, no automatic trim), so a freed
tensor's pages stay resident for the next allocation: no page faults, 1.6-1.8x faster train steps
(issue 11). But a kept heap also keeps every hole, and the train phase's mix of sizes (activations,
[vocab, hidden] head and embedding gradients, AdamW's temporaries) left holes the next micro-batch
did not fit: measured on SmolLM2-135M at an 888-token budget, the heap grew by 0.4-0.9 GB a step,
to 5.7 GB for 3.3 GB in use at step 4. glibc's `malloc_trim(0)` releases the free pages inside the
heap (not only at its top); called where little is in use (before each micro-batch's forward and
after the optimizer step) it bounds the heap to one micro-batch's churn (4.3-4.5 GB, flat from step
2) at no measured cost in step time (bench/README.md, issue 31 item 3).
"""
from __future__ import annotations

import ctypes
import functools
import os


PAGE = os.sysconf("SC_PAGE_SIZE")


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; other C libraries have no such call
    except (OSError, AttributeError):
        return None


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


class HeapKeeper:
    """Keeps up to `slack` bytes of freed heap resident above the lowest resident size seen at the same
    point of the loop (where the trainer holds only its weights, gradients and optimizer state); past
    that, gives the free pages back. The slack is reused without page faults, the rest is what the
    heap's holes would otherwise add step after step."""

    def __init__(self, slack: int) -> None:
        self.slack = slack
        self.floor: int | None = None
        self.trims = 0

    def settle(self) -> bool:
        """Call where the loop has freed what it used. True if it gave pages back."""
        trim = _malloc_trim()
        if trim is None:
            return False
        resident = resident_bytes()
        self.floor = resident if self.floor is None else min(self.floor, resident)
        if resident <= self.floor + self.slack:
            return False
        trim(0)
        self.trims += 1
        self.floor = min(self.floor, resident_bytes())
        return True
