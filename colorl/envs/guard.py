"""Environment code runs off the caller's thread, and its failures end only its own episode.

`EnvRunner` runs `reset` and `step` on a shared thread pool, so a slow tool does not hold the
rollout loop: `submit_step` returns at once, `PendingStep.done()` polls, `result()` waits at
most until the step's deadline. An environment that raises, misses the deadline or returns
something that is not a valid answer ends that episode with reward 0 and a fault kind
("raised", "timeout", "invalid") plus a one-line message; nothing reaches the caller as an
exception. Each step's time in the environment's code is recorded for the metrics.

A step past its deadline cannot be stopped (Python cannot kill a thread): it is abandoned, and
the runner moves on to a fresh executor so the hung thread cannot hold a worker that later steps
need (the old executor still finishes the steps already submitted to it, on its other threads).
The hung thread lives until the step returns, and the interpreter waits for it at exit
(concurrent.futures joins its threads): a tool that can block forever must bound itself.
A runner is driven from one thread.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, replace
from typing import Any, Callable

from colorl.envs.base import Environment, EnvStep, InvalidStep, check_env_messages

FAULT_KINDS = ("raised", "timeout", "invalid")
MAX_ERROR_CHARS = 300

Outcome = tuple[Any, BaseException | None, float]  # (returned value, raised exception, seconds in the call)


@dataclass(frozen=True)
class GuardedStep:
    """A step that always makes sense: on a fault, the episode's end with reward 0."""

    step: EnvStep
    seconds: float  # time in the environment's code; the whole timeout when abandoned
    fault: str | None = None  # one of FAULT_KINDS
    error: str = ""  # one line, when fault is set


class PendingStep:
    """A reset or step under way on the runner's pool."""

    def __init__(self, future: Future, timeout_s: float, check: Callable[[Any], EnvStep],
                 on_timeout: Callable[[], None]) -> None:
        self._future, self._timeout_s, self._check, self._on_timeout = future, timeout_s, check, on_timeout
        self._deadline = time.monotonic() + timeout_s
        self._result: GuardedStep | None = None
        self.built: list[Environment] = []  # `EnvRunner.submit_open`: the environment, once built

    def done(self) -> bool:
        """True when `result()` will not wait: the step returned or its deadline passed."""
        return self._future.done() or time.monotonic() >= self._deadline

    def wait(self, timeout_s: float) -> None:
        """Block until `done()`, for at most `timeout_s`."""
        remaining = min(timeout_s, self._deadline - time.monotonic())
        if remaining > 0:
            futures_wait([self._future], timeout=remaining)

    def result(self) -> GuardedStep:
        if self._result is None:
            self._result = self._settle()
        return self._result

    def _settle(self) -> GuardedStep:
        try:
            value, error, seconds = self._future.result(timeout=max(0.0, self._deadline - time.monotonic()))
        except FutureTimeout:
            self._on_timeout()
            return _fault("timeout", f"no answer within {self._timeout_s:g} s", self._timeout_s)
        if error is not None:
            return _fault("invalid" if isinstance(error, InvalidStep) else "raised", _one_line(error), seconds)
        try:
            return GuardedStep(self._check(value), seconds)
        except InvalidStep as exc:
            return _fault("invalid", _one_line(exc), seconds)


class EnvRunner:
    """The pool environment code runs on; `close()` it when the rollout ends."""

    def __init__(self, workers: int = 8, thread_start: Callable[[], None] | None = None) -> None:
        """thread_start: run first in each of the pool's threads (the rank's device, colorl/distributed.py)."""
        self._workers = workers
        self._thread_start = thread_start
        self._pool = self._new_pool()

    def submit_reset(self, env: Environment, timeout_s: float) -> PendingStep:
        return self._submit(env.reset, _checked_reset, timeout_s)

    def submit_open(self, build: Callable[[], Environment], timeout_s: float) -> PendingStep:
        """Build the environment and reset it, both on the pool (a slow constructor holds no loop);
        `PendingStep.built` holds the environment once built."""
        built: list[Environment] = []

        def open_episode() -> Any:
            built.append(build())
            return built[0].reset()

        pending = self._submit(open_episode, _checked_reset, timeout_s)
        pending.built = built
        return pending

    def submit_step(self, env: Environment, text: str, timeout_s: float) -> PendingStep:
        return self._submit(lambda: env.step(text), _checked_step, timeout_s)

    def run_reset(self, env: Environment, timeout_s: float) -> GuardedStep:
        return self.submit_reset(env, timeout_s).result()

    def run_step(self, env: Environment, text: str, timeout_s: float) -> GuardedStep:
        return self.submit_step(env, text, timeout_s).result()

    def close(self) -> None:
        """Queued steps are cancelled; running ones are not waited for (one may be hung)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> EnvRunner:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _submit(self, call: Callable[[], Any], check: Callable[[Any], EnvStep], timeout_s: float) -> PendingStep:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0")
        pool = self._pool
        return PendingStep(pool.submit(_timed, call), timeout_s, check, lambda: self._abandon(pool))

    def _abandon(self, pool: ThreadPoolExecutor) -> None:
        """Later steps go to a fresh pool; the old one keeps its hung thread and finishes its queue."""
        if pool is self._pool:
            pool.shutdown(wait=False)
            self._pool = self._new_pool()

    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(self._workers, thread_name_prefix="colorl-env", initializer=self._thread_start)


def _timed(call: Callable[[], Any]) -> Outcome:
    """Runs on the pool: whatever the environment's code does comes back as a value, never raised."""
    start = time.perf_counter()
    try:
        value, error = call(), None
    except BaseException as exc:  # the environment's code, even sys.exit(): its episode ends, the run goes on
        value, error = None, exc
    return value, error, time.perf_counter() - start


def _checked_reset(value: Any) -> EnvStep:
    return EnvStep(check_env_messages(value, "reset()"), done=False)


def _checked_step(value: Any) -> EnvStep:
    """Validated again: an EnvStep can be mutated after it was built (its message list)."""
    if not isinstance(value, EnvStep):
        raise InvalidStep(f"step() returned {type(value).__name__}, not EnvStep")
    return replace(value)


def _fault(kind: str, error: str, seconds: float) -> GuardedStep:
    return GuardedStep(EnvStep([], done=True, reward=0.0), seconds, kind, error)


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:MAX_ERROR_CHARS]
