"""Answer extraction for math-style tasks, and running user reward functions safely.

A user reward runs in a separate worker process with a time limit: an exception or a time-out
gives reward 0 and is counted, and never stops the run.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import re
import signal
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

STARTUP_TIMEOUT_S = 120.0
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def _boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a completion: `\\boxed{...}`, else after `####`, else the last number."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.split("\n", 1)[0].strip() or None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def to_number(text: str | None) -> Fraction | None:
    if text is None:
        return None
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".")
    match = _NUMBER.search(cleaned)
    if not match or match.group(0) != cleaned:
        return None
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def math_equal(completion: str, reference: str) -> bool:
    """Numeric comparison when both sides parse as numbers, else exact string match."""
    got = extract_answer(completion)
    want = extract_answer(reference) if not to_number(reference) else reference
    got_num, want_num = to_number(got), to_number(want)
    if got_num is not None and want_num is not None:
        return got_num == want_num
    return got is not None and want is not None and got.strip() == want.strip()


def math_reward(prompt: str, completion: str, answer: str) -> float:
    return 1.0 if math_equal(completion, answer) else 0.0


# ---------------------------------------------------------------- user rewards


@dataclass
class RewardCounters:
    errors: int = 0
    timeouts: int = 0
    last_error: str = ""

    def take(self) -> tuple[int, int]:
        """Errors and time-outs since the last call (one step's worth), then start counting anew."""
        counts = (self.errors, self.timeouts)
        self.errors = self.timeouts = 0
        return counts


def resolve_reward(spec: str) -> Callable:
    """A user reward `module:function`; UserCodeError (one line, without the config key) if it cannot
    be imported or called. The pre-launch checks (colorl/preflight.py) name the key."""
    from colorl.user_code import UserCodeError, import_named

    func = import_named(spec, "function")
    if not callable(func):
        module_name, _, func_name = spec.partition(":")
        raise UserCodeError(f"{module_name!r} has no callable {func_name!r}")
    return func


def _reward_worker(spec: str, inbox, outbox) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the rank's to handle, between steps
    try:
        func = resolve_reward(spec)
    except Exception as exc:  # reported to the parent, which counts it per call
        outbox.put(("error", f"task.reward={spec!r}: {exc}"))
        return
    outbox.put(("ready", 0.0))
    parent = os.getppid()
    while True:
        try:
            item = inbox.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # the rank died: do not linger holding its stdout
                return
            continue
        if item is None:
            return
        try:
            value = float(func(*item))
            if not math.isfinite(value):
                raise ValueError(f"reward {value} is not finite")
            outbox.put(("ok", value))
        except BaseException as exc:  # user code: anything it raises is a zero reward
            outbox.put(("error", f"{type(exc).__name__}: {exc}"))


@dataclass
class SandboxedReward:
    """A `module:function` reward run in its own process with a per-call time limit."""

    spec: str
    timeout_s: float
    counters: RewardCounters = field(default_factory=RewardCounters)

    def __post_init__(self) -> None:
        self._ctx = mp.get_context("spawn")
        self._proc = None

    def _start(self) -> None:
        """Start the worker and wait until it has imported the user's module (not charged to a call)."""
        self._inbox, self._outbox = self._ctx.Queue(), self._ctx.Queue()
        self._proc = self._ctx.Process(target=_reward_worker, args=(self.spec, self._inbox, self._outbox), daemon=True)
        self._proc.start()
        try:
            status, message = self._outbox.get(timeout=STARTUP_TIMEOUT_S)
        except queue.Empty:
            status, message = "error", f"reward worker did not start within {STARTUP_TIMEOUT_S}s"
        if status != "ready":
            self.close()
            raise RuntimeError(message)

    def __call__(self, prompt: str, completion: str, answer: str) -> float:
        try:
            if self._proc is None or not self._proc.is_alive():
                self._start()
        except RuntimeError as exc:
            self.counters.errors += 1
            self.counters.last_error = str(exc)
            return 0.0
        self._inbox.put((prompt, completion, answer))
        try:
            status, value = self._outbox.get(timeout=self.timeout_s)
        except queue.Empty:
            self.counters.timeouts += 1
            self.counters.last_error = f"timed out after {self.timeout_s}s"
            self.close()
            return 0.0
        if status == "error":
            self.counters.errors += 1
            self.counters.last_error = value
            return 0.0
        return value

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=5)
            self._proc = None
