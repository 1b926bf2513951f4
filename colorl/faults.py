"""Faults: injected at named points of a run (for the fault tests and `bench/faults.py`), and
detected by the run itself (`RunFault`, `NonFiniteGuard`).

A mode calls `point(name, step)` where a phase starts; the call does nothing (one comparison)
unless the environment variable `COLORL_FAULT` is set, e.g.

    COLORL_FAULT=kill@train:3:1           # rank 1 kills itself (SIGKILL) when step 3 starts training
    COLORL_FAULT=term-launcher@sync:2:0   # rank 0 sends SIGTERM to the launcher when step 2 syncs

Format: `ACTION@POINT:STEP:RANK`; STEP is the step in progress (1-based), RANK the rank that acts.
Points the run passes: `rollout`, `train`, `sync`, `eval` (after the step's training),
`checkpoint` (between the model and optimizer writes of a save), and, in bounded-lag mode,
`apply_weights` (the rollout thread loading a new version). Before acting the rank prints one
`colorl-fault:` line with the wall-clock time to stderr, so a test can time the stop.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import dataclass, replace

ENV = "COLORL_FAULT"
POINTS = ("rollout", "train", "sync", "eval", "checkpoint", "apply_weights")


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # like `kill -9`: no handler, no cleanup, no flush


def _term_launcher() -> None:
    os.kill(os.getppid(), signal.SIGTERM)  # ranks are children of the launcher (spawn)


ACTIONS = {"kill": _kill_self, "term-launcher": _term_launcher}


@dataclass(frozen=True)
class Fault:
    action: str
    point: str
    step: int
    rank: int

    @classmethod
    def parse(cls, text: str) -> "Fault":
        try:
            action, rest = text.split("@", 1)
            point, step, rank = rest.split(":")
            fault = cls(action, point, int(step), int(rank))
        except ValueError:
            raise ValueError(f"{ENV}={text!r}: expected ACTION@POINT:STEP:RANK") from None
        if action not in ACTIONS or point not in POINTS:
            raise ValueError(f"{ENV}={text!r}: actions {sorted(ACTIONS)}, points {list(POINTS)}")
        return fault

    def __str__(self) -> str:
        return f"{self.action}@{self.point}:{self.step}:{self.rank}"


_ARMED = Fault.parse(os.environ[ENV]) if os.environ.get(ENV) else None


def point(name: str, step: int) -> None:
    """Mark that this rank is at `name` of step `step`; acts only when `COLORL_FAULT` names it."""
    if _ARMED is None or (_ARMED.point, _ARMED.step) != (name, step) or _ARMED.rank != _rank():
        return
    print(f"colorl-fault: {_ARMED} pid {os.getpid()} at {time.time():.3f}", file=sys.stderr, flush=True)
    ACTIONS[_ARMED.action]()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


class RunFault(RuntimeError):
    """A fault the run detected and explains in one line (disk full, non-finite losses): the launcher
    reports the message without a traceback, because there is no bug to debug."""


@dataclass
class NonFiniteGuard:
    """Counts training steps in a row whose loss or gradient norm is not finite.

    The trainer takes no optimizer step on a non-finite gradient (the step is skipped and counted
    in `optimizer_steps_skipped`), so after a streak the weights are still those of the last good
    step. `limit` steps in a row mean the run will not recover by itself: `observe` then returns
    the state of that last good step, for the caller to save and stop.
    """

    limit: int
    last_good: object  # the TrainerState after the newest finite step (or at start)
    streak: int = 0

    def __post_init__(self) -> None:
        self.last_good = replace(self.last_good)  # the caller's state keeps advancing in place

    def observe(self, loss: float, grad_norm: float, state) -> object | None:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.streak, self.last_good = 0, replace(state)
            return None
        self.streak += 1
        return self.last_good if self.streak >= self.limit else None
