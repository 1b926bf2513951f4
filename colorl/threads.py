"""The calling thread's torch intra-op team size (its OpenMP `nthreads` setting: one per thread).

Set through `torch._C.set_num_threads`, the function `torch.set_num_threads` names until vLLM's CPU
worker starts: it then replaces the `torch` attribute with a no-op that logs a warning on every
call (vllm/v1/worker/cpu_worker.py, `skip_set_num_threads`), which would leave bounded-lag's loops
with whatever team size each thread happened to have.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def set_threads(count: int) -> None:
    """This thread's team size from now on."""
    torch._C.set_num_threads(count)


@contextlib.contextmanager
def pinned(count: int) -> Iterator[None]:
    """This thread runs with `count` threads inside the block, and with its own count again after it."""
    before = torch.get_num_threads()
    set_threads(count)
    try:
        yield
    finally:
        set_threads(before)
