"""A CPU rank's kept heap, bounded: freed pages stay resident up to a slack, past it go back to the OS.

colorl's CPU ranks keep their heap (`launch.CPU_RANK_ENV`: no mmap, no automatic trim), so a freed
tensor's pages stay resident for the next allocation: no page faults, 1.6-1.8x faster train steps
(issue 11). But a kept heap also keeps every hole, and the train phase's mix of sizes (activations,
[vocab, hidden] head and embedding gradients, AdamW's temporaries) left holes the next micro-batch
did not fit. Measured on SmolLM2-135M at an 888-token budget (2 threads, AMD EPYC Zen 3), the heap
grew by 0.4-0.9 GB a step, to 5.7 GB for about 3.3 GB in use at step 5, and kept growing. glibc's
`malloc_trim(0)` releases the free pages anywhere in the heap, not only at its top. `HeapKeeper`
calls it where the trainer holds only its weights, gradients and optimizer state: before each
micro-batch once more than `slack` bytes sit resident above the size after its last trim, and
always after the optimizer step, where the rollout (whose engine memory is mapped apart) follows.
The train phase then peaked at 4.2-4.5 GB, flat from step 2; what it costs is the page faults of
the pages given back (bench/README.md, issue 31 item 3).
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


def resident_bytes(pid: int | str = "self") -> int | None:
    """A process's resident memory (VmRSS), None once it has exited."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * PAGE
    except OSError:
        return None


class HeapKeeper:
    """Keeps up to `slack` bytes of freed heap resident above the resident size right after its last
    trim (at the same point of the loop, where the trainer holds only its weights, gradients and
    optimizer state), and past that gives the free pages back. The slack is reused without page
    faults; the rest is what the heap's holes would otherwise add step after step. What the trainer
    keeps (AdamW's state, created at the first step) moves the base up at the next trim."""

    def __init__(self, slack: int) -> None:
        self.slack = slack
        self.base: int | None = None

    def settle(self) -> bool:
        """Call where the loop has freed what it used. True if it gave pages back."""
        resident = resident_bytes()
        if _malloc_trim() is None or resident is None:  # no glibc, or no /proc to read
            return False
        if self.base is None or resident <= self.base + self.slack:
            self.base = resident if self.base is None else min(self.base, resident)
            return False
        return self.release()

    def release(self) -> bool:
        """Give every free page back: where a phase ends and the next (the engine's rollout, in mappings
        of its own: engines/native/host_memory.py) would not reuse them. True if it could."""
        trim = _malloc_trim()
        if trim is None:
            return False
        trim(0)
        self.base = resident_bytes()
        return True
