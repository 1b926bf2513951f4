"""Environments for tests, imported by `module:Class` in spawned workers.

A random tiny model writes noise, so these environments script the episode: they answer a fixed
number of model messages with a tool result and then end it, with a reward the model's text
decides (so groups have reward variance). Others misbehave on purpose, only on problems whose
answer is odd (`misbehaves`), so faulty and healthy episodes run side by side in one rollout.
"""
from __future__ import annotations

import time

import torch

from colorl.envs import Environment, EnvStep, Message, ToolSpec

TOOL_TEXT = "TOOL-RESULT-7391"  # what the scripted tool answers: easy to find in the episode's tokens


def misbehaves(problem) -> bool:
    return int(problem.answer) % 2 == 1


class ScriptedToolEnv(Environment):
    """Two tool results, then the end: three model messages, reward = the last one's digit fraction."""

    tools = (ToolSpec("lookup", "Look something up.", {"type": "object", "properties": {}}),)
    tool_turns = 2
    step_sleep_s = 0.0

    def __init__(self, problem) -> None:
        super().__init__(problem)
        self.turns = 0

    def reset(self) -> list[Message]:
        return [Message("system", "Use the tool."), Message("user", self.problem.prompt)]

    def step(self, assistant_text: str) -> EnvStep:
        time.sleep(self.step_sleep_s)
        self.turns += 1
        if self.turns > self.tool_turns:
            reward = sum(ch.isdigit() for ch in assistant_text) / max(len(assistant_text), 1)
            return EnvStep([], done=True, reward=reward)
        return EnvStep([Message("tool", TOOL_TEXT, name="lookup")], done=False)


class ShortScriptedEnv(ScriptedToolEnv):
    """The same script with no tools declared: a short opening prompt, which the tiny model's 512-token
    context holds for all three turns (the declaration alone nearly fills it). The ones below are short too."""

    tools = ()


class DeviceToolEnv(ShortScriptedEnv):
    """Its tool works on the current CUDA device when there is one, as an environment running a model of
    its own would: on a GPU box that must be its rank's device, in whichever pool thread it runs."""

    def step(self, assistant_text: str) -> EnvStep:
        if torch.cuda.is_available():
            torch.zeros(1, device=torch.cuda.current_device())
        return super().step(assistant_text)


class SlowToolEnv(ShortScriptedEnv):
    """Each step takes 0.3 s on a misbehaving problem: the tool latency the bounded-lag mode overlaps."""

    def step(self, assistant_text: str) -> EnvStep:
        if misbehaves(self.problem):
            time.sleep(0.3)
        return super().step(assistant_text)


class NeverDoneEnv(ShortScriptedEnv):
    """Answers every message: the episode ends at task.max_turns or its token cap."""

    tool_turns = 10**9


class ToolErrorEnv(ShortScriptedEnv):
    """Every answer reports one tool call that could not run; on a misbehaving problem the episode never
    ends (task.max_turns cuts it), on the others it ends after the script's three model messages."""

    def step(self, assistant_text: str) -> EnvStep:
        if misbehaves(self.problem):
            return EnvStep([Message("tool", "error: no such tool", name="lookup")], done=False, tool_errors=1)
        answer = super().step(assistant_text)
        return answer if answer.done else EnvStep(answer.messages, done=False, tool_errors=1)


class RaisingEnv(ShortScriptedEnv):
    def step(self, assistant_text: str) -> EnvStep:
        if misbehaves(self.problem):
            raise RuntimeError("the tool crashed")
        return super().step(assistant_text)


class HangingEnv(ShortScriptedEnv):
    def step(self, assistant_text: str) -> EnvStep:
        if misbehaves(self.problem):
            time.sleep(1.5)
            return EnvStep([], done=True, reward=1.0)
        return super().step(assistant_text)


class GarbageEnv(ShortScriptedEnv):
    def step(self, assistant_text: str):
        if misbehaves(self.problem):
            return {"reward": 1.0}
        return super().step(assistant_text)


class BrokenConstructorEnv(ShortScriptedEnv):
    def __init__(self, problem) -> None:
        if misbehaves(problem):
            raise ValueError("cannot build")
        super().__init__(problem)
