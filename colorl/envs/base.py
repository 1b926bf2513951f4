"""What an environment is: an episode of messages, driven by the model's replies, scored at its end.

The shape is the one a TRL user brings: a class built once per episode from a `Problem`, whose
`reset()` gives the opening messages and whose `step(text)` answers each model message with
the next messages (tool results, a user turn) or with the end of the episode and its reward.
Tools are declared once on the class as JSON-schema `ToolSpec`s. Everything crossing this
boundary is a validated dataclass, so a broken environment is caught where it breaks.
"""
from __future__ import annotations

import inspect
import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, TypeVar

from colorl.tasks.base import Problem

ROLES = ("system", "user", "assistant", "tool")


class EnvError(ValueError):
    """An unknown or unusable environment; its message is one line for the user."""


class InvalidStep(EnvError):
    """An environment broke the interface: a bad message, reward or step."""


@dataclass(frozen=True)
class Message:
    """One chat message; `name` and `tool_call_id` only for tool results."""

    role: str
    content: str
    name: str | None = None
    tool_call_id: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidStep(f"message role {self.role!r}: expected one of {ROLES}")
        if not isinstance(self.content, str):
            raise InvalidStep(f"message content: expected str, got {type(self.content).__name__}")
        for key in ("name", "tool_call_id"):
            if not isinstance(getattr(self, key), (str, type(None))):
                raise InvalidStep(f"message {key}: expected str or None")

    def as_dict(self) -> dict[str, str]:
        """The dict a chat template reads (optional keys only when set)."""
        fields = {"role": self.role, "content": self.content, "name": self.name, "tool_call_id": self.tool_call_id}
        return {key: value for key, value in fields.items() if value is not None}


def check_env_messages(messages: Any, where: str) -> list[Message]:
    """Messages an environment may say: Message objects, never the assistant's role (that is the model)."""
    if not isinstance(messages, list) or not all(isinstance(m, Message) for m in messages):
        raise InvalidStep(f"{where}: expected a list of Message")
    if any(m.role == "assistant" for m in messages):
        raise InvalidStep(f"{where}: an environment cannot speak as the assistant")
    return messages


@dataclass(frozen=True)
class EnvStep:
    """The environment's answer to one model message: the next messages, or the end and its reward.

    `tool_errors` counts the tool calls of that message that could not be run (bad JSON, unknown
    tool, bad arguments), for metrics; they were reported to the model as tool messages.
    """

    messages: list[Message]
    done: bool
    reward: float | None = None
    tool_errors: int = 0

    def __post_init__(self) -> None:
        check_env_messages(self.messages, "EnvStep.messages")
        if not isinstance(self.done, bool):
            raise InvalidStep(f"EnvStep.done: expected bool, got {type(self.done).__name__}")
        if not isinstance(self.tool_errors, int) or isinstance(self.tool_errors, bool) or self.tool_errors < 0:
            raise InvalidStep(f"EnvStep.tool_errors={self.tool_errors!r}: expected an int >= 0")
        if not self.done:
            if self.reward is not None:
                raise InvalidStep("EnvStep: a reward is given only when done")
            if not self.messages:
                raise InvalidStep("EnvStep: not done, yet no new messages for the model")
            return
        if not isinstance(self.reward, numbers.Real) or isinstance(self.reward, bool):
            raise InvalidStep(f"EnvStep: done needs a numeric reward, got {self.reward!r}")
        if not math.isfinite(self.reward):
            raise InvalidStep(f"EnvStep: reward {self.reward} is not finite")
        object.__setattr__(self, "reward", float(self.reward))


@dataclass(frozen=True)
class EpisodeRecord:
    """What one episode did, carried on its result for the reward and the step's metrics."""

    reward: float
    turns: int  # model messages
    tool_calls: int  # `<tool_call>` blocks in the model's messages, well-formed or not
    tool_errors: int  # calls the environment could not run (reported to the model)
    env_seconds: float  # time in the environment's code (reset and every step)
    fault: str | None = None  # the environment raised, hung or broke the interface: reward 0
    truncated: str | None = None  # cut before the environment ended it, reward 0: TRUNCATED_BY_TURNS or _BY_TOKENS
    turns_cut: int = 0  # model messages that hit their token cap (task.turn_tokens, or what was left) mid-text


TRUNCATED_BY_TURNS = "max_turns"  # task.max_turns model messages answered without `done`
TRUNCATED_BY_TOKENS = "tokens"  # no room left for a turn: task.episode_tokens, or the model's context


@dataclass(frozen=True)
class ToolSpec:
    """A tool the model may call; `parameters` is the JSON schema of its arguments object."""

    name: str
    description: str
    parameters: dict[str, Any]

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise EnvError(f"tool name {self.name!r}: expected an identifier")
        if not isinstance(self.parameters, dict) or self.parameters.get("type") != "object":
            raise EnvError(f"tool {self.name!r}: parameters must be a JSON schema with type 'object'")

    def as_schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema that chat templates with a tools section read."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


class Environment(ABC):
    """One episode on one problem. Subclasses declare `tools` and implement `reset` and `step`."""

    tools: ClassVar[tuple[ToolSpec, ...]] = ()

    def __init__(self, problem: Problem) -> None:
        self.problem = problem

    @abstractmethod
    def reset(self) -> list[Message]:
        """The opening messages (system and user turns) the model answers first."""

    @abstractmethod
    def step(self, assistant_text: str) -> EnvStep:
        """Answer the model's message: next messages (not done), or done with the reward."""


ENVS: dict[str, type[Environment]] = {}
E = TypeVar("E", bound=type[Environment])


def register(name: str) -> Callable[[E], E]:
    def wrap(cls: E) -> E:
        ENVS[name] = cls
        return cls

    return wrap


def check_env_options(cls: type[Environment], options: dict[str, Any]) -> None:
    """`task.env_options` must be keyword arguments the environment's constructor takes."""
    try:
        inspect.signature(cls).bind(Problem("", ""), **options)
    except TypeError as exc:
        raise EnvError(f"task.env_options {sorted(options)} do not fit {cls.__name__}{inspect.signature(cls)}: "
                       f"{exc}") from None


def resolve_env(spec: str) -> type[Environment]:
    """A registered environment's name, or a user's `module:Class`; EnvError otherwise."""
    if spec in ENVS:
        return ENVS[spec]
    from colorl.user_code import UserCodeError, import_named

    try:
        cls = import_named(spec, "Class")
    except UserCodeError as exc:
        why = f"not one of {sorted(ENVS)} and not 'module:Class'" if str(exc).startswith("expected") else exc
        raise EnvError(f"environment {spec!r}: {why}") from None
    if not (isinstance(cls, type) and issubclass(cls, Environment)) or inspect.isabstract(cls):
        raise EnvError(f"environment {spec!r}: {spec.partition(':')[2]!r} is not a concrete subclass of "
                       "colorl.envs.Environment")
    return cls
