"""Process-group helpers shared by the launcher, the workers and the tests."""
from __future__ import annotations

import atexit
import os
import socket
import sys
from contextlib import closing
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_process_group(rank: int, world_size: int, port: int, device: str = "cpu", timeout_s: float = 120) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    # metrics and stop flags are small CPU tensors: gloo carries those, nccl the model's
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        use_device(f"cuda:{rank % torch.cuda.device_count()}")
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))


def rank_device(device: str) -> str:
    """The rank's device by name: "cuda" becomes "cuda:N", N the device the launcher selected for
    this rank on its main thread. A bare "cuda" means device 0 in any other thread (the current
    device is per thread), so nothing past the launcher names one."""
    if device == "cuda":
        return f"cuda:{torch.cuda.current_device()}"
    return device


def use_device(device: str) -> None:
    """Make the rank's device current in the calling thread: the first thing every thread a rank
    starts does (a new thread's current device is 0, so its streams, events, memory queries and
    "cuda" tensors would land on GPU 0, and it would open a CUDA context there)."""
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def exit_rank(code: int) -> NoReturn:
    """End a rank's process: its process group torn down if it still has one, then as Python would (atexit
    handlers run, output flushed) but without the interpreter's finalization, where a rank that has done all
    its work can still abort.

    Gloo's worker threads outlive `destroy_process_group` (torch keeps the group alive from C++). One that
    drops the last reference to a finished collective's tensor takes the GIL to free it; from a finalizing
    interpreter that ends the thread inside a noexcept frame, and the process dies with SIGABRT ("terminate
    called without an active exception", `ProcessGroupGloo::runLoop` → `TensorImpl::decref_pyobject` →
    `PyEval_AcquireThread` → `pthread_exit`). A world-two test ended so in 2 of 13 runs on a Zen 4.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to keep
            pass
    os._exit(code)


def _worker(local_rank: int, world: int, port: int, fn, args) -> None:
    init_process_group(local_rank, world, port)
    try:
        fn(local_rank, world, *args)
        dist.barrier()  # leave together: a rank tearing gloo down while its peer still talks can abort it
    finally:
        dist.destroy_process_group()
    exit_rank(0)


def run_world(fn, world: int, *args) -> None:
    """Run `fn(rank, world, *args)` in `world` fresh processes joined by a gloo group (tests, benches).

    `fn` must be importable (module level); an exception in any rank is re-raised here.
    """
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, free_port(), fn, args), nprocs=world, join=True)


def release_cached_device_memory(device: str | torch.device) -> None:
    """Give the device memory this process's caching allocator holds back to the driver.

    An engine in another process (SGLang's scheduler) can only map memory that this process has
    returned: without this, its `resume_memory_occupation` at wake meets the trainer's cached
    blocks (gradients, optimizer temporaries, the checkpoint engine's buckets) and runs out of
    memory. Waits for the queued work that still uses those blocks first. Nothing to do on CPU.
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
