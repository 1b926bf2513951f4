"""Spawn one worker per device and watch them: any rank failing stops all of them, quickly.

Failure handling: a rank that raises writes its traceback to a file and exits 1; a rank that dies
(killed, OOM) just exits. The parent notices within a poll interval, sends SIGTERM to the rest,
SIGKILL after a grace period, and prints the failing rank's error as one block.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch.multiprocessing as mp

POLL_S = 0.2
GRACE_S = 10.0
# glibc's malloc hands big blocks (activations, logits) back to the kernel on free and
# page-faults them in again on the next step: on CPU a third of a SmolLM2 step went to the
# kernel. Keeping them in the heap made CPU steps 1.6-1.8x faster (bench/README.md, "CPU
# allocator"); the price is that a rank's memory stays at its peak. A user's MALLOC_* wins.
CPU_MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}


@dataclass
class RankFailure:
    rank: int
    exitcode: int | None
    error: str  # traceback text, or a description of how the process died
    interrupted: bool = False  # the user pressed Ctrl-C before this happened


def _exit_with_parent() -> None:
    """A rank whose launcher died (e.g. SIGKILL) exits instead of running on unattended."""
    parent = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def available_cores() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota (containers)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


def rank_threads(world: int) -> int:
    """Intra-op threads of one rank on CPU: its share of the cores, at least 1 (OMP_NUM_THREADS wins).

    The bounded-lag mode splits this budget between its rollout and train loops.
    """
    configured = os.environ.get("OMP_NUM_THREADS", "")
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    return max(1, available_cores() // world)


def _entry(rank: int, world: int, port: int, device: str, timeout_s: float, error_dir: str, target, args) -> None:
    from colorl.distributed import init_process_group

    threading.Thread(target=_exit_with_parent, daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # until the run installs its stop-at-step-boundary handler

    threads = rank_threads(world)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    warnings.filterwarnings("ignore", category=FutureWarning)  # library deprecation notes, not for users
    import torch

    torch.set_num_threads(threads)
    try:
        init_process_group(rank, world, port, device, timeout_s)
        target(rank, world, *args)
    except BaseException as exc:  # report anything, including KeyboardInterrupt, then exit non-zero
        Path(error_dir, f"rank{rank}.txt").write_text(
            f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}", encoding="utf-8")
        os._exit(1)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def launch(target, nproc: int, device: str, args: tuple, timeout_s: float = 600) -> RankFailure | None:
    """Run `target(rank, world, *args)` on `nproc` ranks; None on success, else the first failure."""
    from colorl.distributed import free_port

    if device == "cpu":
        for key, value in CPU_MALLOC_ENV.items():  # read by glibc when each spawned rank starts
            os.environ.setdefault(key, value)
    ctx = mp.get_context("spawn")
    error_dir = tempfile.mkdtemp(prefix="colorl-errors-")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, nproc, port, device, timeout_s, error_dir, target, args))
             for r in range(nproc)]
    for proc in procs:
        proc.start()
    interrupted = False
    try:
        while True:
            try:
                failure = _first_failure(procs, error_dir)
                if failure is not None:
                    _stop_all(procs)
                    failure.interrupted = interrupted
                    return failure
                if all(p.exitcode == 0 for p in procs):
                    return None
                time.sleep(POLL_S)
            except KeyboardInterrupt:
                if interrupted:  # second Ctrl-C: stop now
                    _stop_all(procs, grace_s=0)
                    return RankFailure(0, None, "ranks killed on a second Ctrl-C, without a final checkpoint",
                                       interrupted=True)
                interrupted = True
                print("colorl: stopping after the current step (a checkpoint is saved); Ctrl-C again to stop now",
                      file=sys.stderr, flush=True)
                for proc in procs:  # ranks save a checkpoint at the next step boundary and exit
                    if proc.is_alive():
                        os.kill(proc.pid, signal.SIGINT)
    finally:
        for proc in procs:
            proc.join(timeout=1)


def _first_failure(procs, error_dir: str) -> RankFailure | None:
    failed = [(r, p) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
    if not failed:
        return None
    # A rank killed by a signal is the cause; peers then fail in their collectives with reports of their own.
    killed = [(r, p) for r, p in failed if p.exitcode < 0]
    reported = [(r, p) for r, p in failed if Path(error_dir, f"rank{r}.txt").exists()]
    rank, proc = (killed or reported or failed)[0]
    path = Path(error_dir, f"rank{rank}.txt")
    if path.exists():
        return RankFailure(rank, proc.exitcode, path.read_text(encoding="utf-8"))
    how = f"killed by {signal.Signals(-proc.exitcode).name}" if proc.exitcode < 0 else f"exit code {proc.exitcode}"
    return RankFailure(rank, proc.exitcode, f"rank {rank} died ({how}) without reporting an error")


def _stop_all(procs, grace_s: float = GRACE_S) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
