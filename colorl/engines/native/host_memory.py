"""CPU storage the native engine gives back to the OS when it frees it, in mappings of its own.

colorl's CPU ranks keep their heap (colorl/launch.py: `MALLOC_MMAP_MAX_=0`, 1.6-1.8x faster train
steps, issue 11), so whatever is freed stays resident and whatever is allocated next lands where it
fits. The engine frees and refills large blocks once per step: its KV pool (sized for the worst case,
touched a few blocks at a time), and at sleep level 2 its weights and their panel copies (rewritten by
every sync). In the heap, the train phase's tensors landed in and beside their holes and the heap
grew past what training used (bench/README.md, issue 31 item 3). Mapped apart, their pages go back
when they are freed and the heap holds the trainer's memory only.

Weights (and their panel copies) ask the kernel for huge pages (transparent huge pages, `madvise`
mode): a decode step streams every weight once, and with 4 KB pages the hardware prefetchers stop at
every page and the TLB misses on every one. On the project's Zen 3 a decode step ran 1.04-1.13x faster
with its weights on 2 MB pages (bench/decode_step.py; bench/README.md, "Weights on huge pages"). Where THP is off the advice is
ignored and nothing changes; the KV pool stays on small pages (touched a few blocks at a time, huge
pages would make its resident memory grow by 2 MB at a time).
"""
from __future__ import annotations

import math
import mmap
from typing import Mapping

import torch

HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KB granule) transparent huge page
ALIGN = 64  # each tensor of a shared mapping starts on a cache line


def mapped_empty(shape: tuple[int, ...], dtype: torch.dtype, huge: bool = False) -> torch.Tensor:
    """An uninitialised CPU tensor in an anonymous mapping, unmapped when the tensor is freed; `huge`:
    on huge pages where the kernel gives them (module docstring)."""
    if huge:
        return mapped_tensors({"": tuple(shape)}, dtype)[""]
    count = math.prod(shape)
    buffer = mmap.mmap(-1, max(count * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)  # holds the mapping until freed


def mapped_tensors(shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Uninitialised CPU tensors of `dtype`, one per name, in one anonymous mapping advised for huge pages
    from its first 2 MB boundary on (a mapping per tensor would waste a partial huge page at each end).
    The mapping is unmapped once every tensor is freed."""
    sizes = {name: math.prod(shape) * dtype.itemsize for name, shape in shapes.items()}
    total = sum(-(-size // ALIGN) * ALIGN for size in sizes.values())
    buffer = mmap.mmap(-1, max(total + HUGE_PAGE, 1), flags=mmap.MAP_PRIVATE)
    whole = torch.frombuffer(buffer, dtype=torch.uint8)  # holds the mapping until every view is freed
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE, start, max(-(-total // mmap.PAGESIZE), 1) * mmap.PAGESIZE)
    except (AttributeError, OSError, ValueError):  # no THP in this kernel, or not on this platform
        pass
    out, offset = {}, start
    for name, shape in shapes.items():
        out[name] = whole[offset:offset + sizes[name]].view(dtype).view(shape)
        offset += -(-sizes[name] // ALIGN) * ALIGN
    return out
