"""A CPU rank's kept heap, bounded: freed pages stay resident up to a slack, past it go back to the OS.

colorl's CPU ranks keep their heap (`launch.CPU_RANK_ENV`: no mmap, no automatic trim), so a freed
tensor's pages stay resident for the next allocation: no page faults, 1.6-1.8x faster train steps
(issue 11). But a kept heap also keeps every hole, and the train phase's mix of sizes (activations,
[vocab, hidden] head and embedding gradients, AdamW's temporaries) left holes the next micro-batch
did not fit. Measured on SmolLM2-135M at an 888-token budget (2 threads, AMD EPYC Zen 3), the heap
grew by 0.4-0.9 GB a step, to 5.7 GB for about 3.3 GB in use at step 5, and kept growing; with the same
shapes in every micro-batch, or with MKL's products instead of oneDNN's (whose primitives follow each new
row count), it held flat (the trainer now races its products apart: `kernels.TRAINING`). glibc's
`malloc_trim(0)` releases the free pages anywhere in the heap, not only at its top. `HeapKeeper`
calls it where a micro-batch's activations are free, once the heap has grown `slack` past its size after
the first micro-batch (what the next one reuses), and always after the optimizer step, where the rollout
(whose engine memory is mapped apart) follows. What it costs is the page faults of the pages given back,
so it trims only on growth (bench/README.md, issue 31 item 3).

A trim gives pages back between micro-batches, not inside one: the train phase's peak is still the heap the
second micro-batch grew because its largest blocks found no hole to fit. Those are few and vocabulary-sized
(on SmolLM2-135M about 23 blocks of 96-108 MiB a step: the LM head's logits chunks and weight gradients, the
embedding's gradient, FSDP's gathered copy; 2-core Zen 5, checkpointing on), and mapped apart
(`map_large_blocks`) they leave no hole and go back when freed. Measured by turns, the train phase's peak
fell from 3995-4115 to 3631-3809 MB, for 5-13 % more train time (their page faults): a trainer with
activation checkpointing on, where the user has put memory first, maps them apart; one without keeps every
block in the heap. Only over the kept heap: glibc's defaults map large blocks already, and allocator settings
of the user's own (or a measurement's) stay untouched.
"""
from __future__ import annotations

import ctypes
import functools
import os

from colorl.launch import CPU_RANK_ENV


PAGE = os.sysconf("SC_PAGE_SIZE")
LARGE_BLOCK = 32 << 20  # glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
M_MMAP_THRESHOLD, M_MMAP_MAX = -3, -4  # glibc's malloc.h
GLIBC_MMAP_MAX = 65536  # glibc's own default count of mappings


@functools.cache
def _glibc(name: str):
    try:
        return getattr(ctypes.CDLL(None), name)  # glibc; other C libraries have no such call
    except (OSError, AttributeError):
        return None


def _malloc_trim():
    return _glibc("malloc_trim")


def heap_kept() -> bool:
    """The environment asks for the kept heap `colorl train` gives its CPU ranks (launch.CPU_RANK_ENV) and names
    no mmap threshold of the user's own: glibc's defaults and a user's (or a measurement's) settings stay."""
    kept = "MALLOC_MMAP_MAX_"
    return os.environ.get(kept) == CPU_RANK_ENV[kept] and "MALLOC_MMAP_THRESHOLD_" not in os.environ


def map_large_blocks(threshold: int = LARGE_BLOCK) -> bool:
    """From now on, blocks of `threshold` bytes and more get mappings of their own: a freed one goes back to
    the OS at once and leaves no hole in the heap (module docstring). The heap keeps every smaller block.
    True if this C library took it; False changes nothing."""
    mallopt = _glibc("mallopt")
    if mallopt is None or not mallopt(M_MMAP_THRESHOLD, threshold):  # a fixed threshold, never raised by glibc
        return False
    return bool(mallopt(M_MMAP_MAX, GLIBC_MMAP_MAX))  # a CPU rank starts with none (launch.CPU_RANK_ENV)


def resident_bytes(pid: int | str = "self") -> int | None:
    """A process's resident memory (VmRSS), None once it has exited."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * PAGE
    except OSError:
        return None


class HeapKeeper:
    """Keeps the heap as the trainer's loop refills it, and gives back only what it grows past that.

    The first `settle()` after a release (after the first micro-batch, whose activations are then free) takes
    the resident size as the reference: the trainer's state plus one micro-batch's freed memory, which the next
    micro-batch reuses without page faults. A later settle that finds the heap more than `slack` above it (the
    next micro-batch did not fit the holes and grew the heap) gives the free pages back. A heap whose holes are
    reused is never trimmed inside the phase: trimming each micro-batch's memory to re-fault it at the next cost
    4-5 s of a 30 s train step (2-core Zen 3, 888-token micro-batches)."""

    def __init__(self, slack: int, large_blocks_apart: bool = False) -> None:
        self.slack = slack
        self.reference: int | None = None
        self.large_blocks_apart = large_blocks_apart and heap_kept() and map_large_blocks()

    def settle(self) -> bool:
        """Call where the loop has freed what one micro-batch used. True if it gave pages back."""
        resident = resident_bytes()
        if _malloc_trim() is None or resident is None:  # no glibc, or no /proc to read
            return False
        if self.reference is None:
            self.reference = resident
            return False
        if resident <= self.reference + self.slack:
            return False
        return self.release()

    def release(self) -> bool:
        """Give every free page back: where a phase ends and the next (the engine's rollout, in mappings
        of its own: engines/native/host_memory.py) would not reuse them. True if it could."""
        trim = _malloc_trim()
        if trim is None:
            return False
        trim(0)
        self.reference = None  # the next settle measures the refilled heap again
        return True
