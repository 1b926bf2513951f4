"""What a task is: a seeded stream of problems (train / eval split) and a reward function.

A task owns its data, its evaluation and its reward (nanochat's shape). Problems are addressed by
index so that a run's data position is a single integer and `--resume` replays the same order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

RewardFn = Callable[[str, str, str], float]  # (prompt, completion, answer) -> reward


@dataclass(frozen=True)
class ChatTurn:
    """One turn of a conversational dataset row's opening (colorl/tasks/chat.py)."""

    role: str  # system, user or assistant
    content: str


@dataclass(frozen=True)
class Problem:
    prompt: str  # user-turn text (of a conversational row: its last user turn); the rollout applies the chat template
    answer: str
    turns: tuple[ChatTurn, ...] | None = None  # a conversational row's turns, rendered instead of `prompt` alone


class Task(Protocol):
    name: str

    def train_problem(self, index: int) -> Problem:
        """The index-th training problem of the run's shuffled, endless stream."""

    def eval_problems(self, count: int) -> list[Problem]:
        """Held-out problems, never seen in training."""

    def reward(self, prompt: str, completion: str, answer: str) -> float: ...


TASKS: dict[str, Callable[..., Task]] = {}


def register(name: str):
    def wrap(factory):
        TASKS[name] = factory
        return factory

    return wrap


class TaskOptionError(ValueError):
    """Unknown or bad `task.options`; one line for the user."""


def check_options(task: str, options: dict, allowed: dict[str, type]) -> dict:
    for key, value in options.items():
        if key not in allowed:
            raise TaskOptionError(f"task.options.{key}: unknown for task {task!r}; allowed: {sorted(allowed)}")
        kind = allowed[key]
        if kind is float and isinstance(value, int):
            continue
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            raise TaskOptionError(f"task.options.{key}={value!r}: expected {kind.__name__}")
    return options
