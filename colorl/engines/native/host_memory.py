"""CPU storage the native engine gives back to the OS when it frees it, in mappings of its own.

colorl's CPU ranks keep their heap (colorl/launch.py: `MALLOC_MMAP_MAX_=0`, 1.6-1.8x faster train
steps, issue 11), so whatever is freed stays resident and whatever is allocated next lands where it
fits. The engine frees and refills large blocks once per step: its KV pool (sized for the worst case,
touched a few blocks at a time), and at sleep level 2 its weights and their panel copies (rewritten by
every sync). In the heap, the train phase's tensors landed in and beside their holes and the heap
grew past what training used (bench/README.md, issue 31 item 3). Mapped apart, their pages go back
when they are freed and the heap holds the trainer's memory only.
"""
from __future__ import annotations

import math
import mmap

import torch


def mapped_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in an anonymous mapping, unmapped when the tensor is freed."""
    count = math.prod(shape)
    buffer = mmap.mmap(-1, max(count * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)  # holds the mapping until freed


def engine_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Storage refilled once per step: mapped on the CPU, the device's allocator elsewhere."""
    if torch.device(device).type == "cpu":
        return mapped_empty(tuple(shape), dtype)
    return torch.empty(shape, dtype=dtype, device=device)
