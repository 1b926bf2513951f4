"""Spawn one worker per device and watch them: any rank failing stops all of them, quickly.
Under torchrun (multi-node), `run_in_place` runs this process's own rank instead.

Failure handling: a rank that raises writes its traceback to a file and exits 1 (a `RunFault` or a
full disk: only its one-line message); a rank that dies (killed, OOM) just exits. The parent notices
within a poll interval, sends SIGTERM to the rest, SIGKILL after a grace period, and prints the
failing rank's error as one block.

Stopping: Ctrl-C or SIGTERM to the launcher asks every rank to save a checkpoint at its next step
boundary and exit. After SIGTERM (sent by schedulers, which follow it with SIGKILL) the ranks get
`STOP_GRACE_S`; a rank still running then is killed, and the newest complete checkpoint stands.
"""
from __future__ import annotations

import errno
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
STOP_GRACE_S = 20.0


class _Terminated(Exception):
    """SIGTERM reached the launcher."""


def _on_sigterm(signum, frame) -> None:
    raise _Terminated


# Read by each rank's libraries when it starts; a user's own setting wins.
# - glibc's malloc hands big blocks (activations, logits) back to the kernel on free and page-faults them
#   in again on the next step: on CPU a third of a SmolLM2 step went to the kernel. Keeping them in the
#   heap made CPU steps 1.6-1.8x faster (bench/README.md, "CPU allocator"); the price is that a rank's
#   memory stays at its peak.
# - MKL (torch's CPU matmuls wherever the race does not pick oneDNN: an Intel Xeon's fp32 race picks MKL)
#   by default takes code paths by the alignment of each buffer, so the same product can round
#   differently in two processes: a resumed run's weights differed from the uninterrupted run's in one
#   run of two on a Xeon. MKL_CBWR=AUTO,STRICT makes its results the same whatever the alignment, at a
#   given thread count (which colorl fixes per loop).
CPU_RANK_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(64 << 30), "MKL_CBWR": "AUTO,STRICT"}


def set_cpu_rank_env() -> None:
    for key, value in CPU_RANK_ENV.items():
        os.environ.setdefault(key, value)


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
    from colorl.distributed import exit_rank, init_process_group

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
        Path(error_dir, f"rank{rank}.txt").write_text(_report(exc), encoding="utf-8")
        os._exit(1)
    exit_rank(0)


def _report(exc: BaseException) -> str:
    """What the user sees: the message alone for faults the run explains, else the traceback too."""
    from colorl.faults import RunFault

    if isinstance(exc, RunFault):
        return str(exc)
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return f"no space left on device while writing {exc.filename or 'a file'}: free some space, then --resume"
    # an error raised for another thread carries that thread's traceback: the one worth showing
    trace = getattr(exc, "thread_traceback", None) or traceback.format_exc()
    return f"{type(exc).__name__}: {exc}\n\n{trace}"


def launch(target, nproc: int, device: str, args: tuple, timeout_s: float = 600) -> RankFailure | None:
    """Run `target(rank, world, *args)` on `nproc` ranks; None on success, else the first failure."""
    from colorl.distributed import free_port

    if device == "cpu":
        set_cpu_rank_env()  # inherited by each spawned rank
    ctx = mp.get_context("spawn")
    error_dir = tempfile.mkdtemp(prefix="colorl-errors-")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, nproc, port, device, timeout_s, error_dir, target, args))
             for r in range(nproc)]
    for proc in procs:
        proc.start()
    interrupted, stop_deadline = False, None
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
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
                if stop_deadline is not None and time.monotonic() > stop_deadline:
                    _stop_all(procs, grace_s=0)
                    return RankFailure(0, None, f"ranks killed {STOP_GRACE_S:.0f} s after SIGTERM, before their step "
                                                "ended; the newest complete checkpoint stands", interrupted=True)
                time.sleep(POLL_S)
            except (KeyboardInterrupt, _Terminated) as exc:
                if interrupted:  # a second Ctrl-C or SIGTERM: stop now
                    _stop_all(procs, grace_s=0)
                    return RankFailure(0, None, "ranks killed on a second stop request, without a final checkpoint",
                                       interrupted=True)
                interrupted = True
                how = "SIGTERM" if isinstance(exc, _Terminated) else "Ctrl-C"
                if isinstance(exc, _Terminated):
                    stop_deadline = time.monotonic() + STOP_GRACE_S
                print(f"colorl: {how}: stopping after the current step (a checkpoint is saved); "
                      f"{how} again to stop now", file=sys.stderr, flush=True)
                for proc in procs:  # ranks save a checkpoint at the next step boundary and exit
                    if proc.is_alive():
                        os.kill(proc.pid, signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc in procs:
            proc.join(timeout=1)


def _first_failure(procs, error_dir: str) -> RankFailure | None:
    failed = [(r, p) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
    if not failed:
        return None
    # A rank killed by a signal is the cause; peers then fail in their collectives with reports of their own,
    # written after the cause's report (its exit is what breaks their connections): the earliest report wins.
    killed = [(r, p) for r, p in failed if p.exitcode < 0]
    reports = {r: Path(error_dir, f"rank{r}.txt") for r, _ in failed}
    reported = sorted(((r, p) for r, p in failed if reports[r].exists()),
                      key=lambda rank_proc: reports[rank_proc[0]].stat().st_mtime_ns)
    rank, proc = (killed or reported or failed)[0]
    path = reports[rank]
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


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TorchrunRank:
    """This process's place in a torchrun job (torchrun's environment variables)."""

    rank: int
    world: int
    local_rank: int
    local_world: int  # ranks on this node
    node: int  # torchrun's GROUP_RANK: the node's index

    @classmethod
    def from_env(cls, env=os.environ) -> "TorchrunRank | None":
        """None when this process was not started by torchrun (then `launch` spawns the ranks)."""
        if not all(key in env for key in TORCHRUN_ENV):
            return None
        return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"]),
                   int(env.get("GROUP_RANK", "0")))


def run_in_place(spot: TorchrunRank, target, device: str, args: tuple, timeout_s: float, prepare=None) -> int:
    """Run this process's rank of `target(rank, world, *args)`; torchrun runs the others.

    `prepare()` runs on rank 0 first (run directory, checks); a message it raises as ValueError
    or OSError stops every rank with exit code 2, printed once. A failing rank prints its error
    and exits 1; torchrun then stops the rest. SIGINT/SIGTERM (torchrun forwards Ctrl-C as
    SIGTERM) stop the run at the next step boundary with a checkpoint, as under `colorl train`.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    if device == "cpu":
        set_cpu_rank_env()  # MKL reads MKL_CBWR at its first product, still to come
    threads = rank_threads(spot.local_world)  # torchrun itself sets OMP_NUM_THREADS=1 unless the user did
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    if device == "cuda":
        from colorl.distributed import use_device

        use_device(f"cuda:{spot.local_rank}")
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    try:
        problem = [None]
        if spot.rank == 0 and prepare is not None:
            try:
                prepare()
            except (ValueError, OSError) as exc:
                problem[0] = str(exc)
        dist.broadcast_object_list(problem, group_src=0)
        if problem[0] is not None:
            if spot.rank == 0:
                print(f"colorl: error: {problem[0]}", file=sys.stderr)
            return 2
        target(spot.rank, spot.world, *args)
        # every rank done before any tears the group down: a rank that destroys it while a peer still
        # talks to it can abort in gloo's teardown ("terminate called without an active exception")
        dist.barrier()
    except BaseException as exc:  # report anything, then let torchrun stop the other ranks
        print(f"colorl: rank {spot.rank} failed: {_report(exc)}", file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
