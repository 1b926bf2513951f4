"""Several reward functions, one reward: TRL's `reward_funcs` with `reward_weights`.

A sample's reward is Σ w_i · r_i over the functions listed in `task.reward` (weights from
`task.reward_weights`, 1 each when not given, as in TRL). Each function's own score is kept
beside the total, so every step logs each function's mean on its own (`reward/<name>`) and a
run shows which of them moved, not only their sum. Each user function runs in its own
sandboxed worker (colorl/tasks/rewards.py); `task` names the task's own reward, run in the rank.
"""
from __future__ import annotations

from dataclasses import dataclass

from colorl.tasks.base import RewardFn
from colorl.tasks.rewards import RewardCounters, SandboxedReward

TASK_REWARD = "task"  # in the list form: the task's own reward (e.g. the math answer check)


@dataclass(frozen=True)
class RewardTerm:
    """One function of the list form: its metric name, its `module:function` (or `task`) and weight."""

    name: str
    spec: str
    weight: float


def term_name(spec: str) -> str:
    """The name a function's metric carries: `reward/<function>` (`reward/task` for the task's own)."""
    return spec if spec == TASK_REWARD else spec.partition(":")[2]


def reward_terms(task_cfg) -> list[RewardTerm]:
    """The list form's terms; [] for the single-reward form (one `module:function`, no weights, or none),
    which scores as it always did. The config has checked the lengths and names already."""
    reward, weights = task_cfg.reward, task_cfg.reward_weights
    if not isinstance(reward, list) and weights is None:
        return []
    specs = reward if isinstance(reward, list) else [reward]
    weights = weights if weights is not None else [1.0] * len(specs)
    return [RewardTerm(term_name(spec), spec, float(weight)) for spec, weight in zip(specs, weights)]


class WeightedRewards:
    """The list form as one reward function (`__call__` gives the weighted sum), whose `parts` give
    each function's own score for the metrics."""

    def __init__(self, terms: list[RewardTerm], functions: list[RewardFn]) -> None:
        self.terms, self.functions = terms, functions

    @classmethod
    def build(cls, terms: list[RewardTerm], task_reward: RewardFn, timeout_s: float,
              counters: RewardCounters) -> WeightedRewards:
        """User functions sandboxed (one worker each, errors and time-outs in the shared counters)."""
        return cls(terms, [task_reward if t.spec == TASK_REWARD else SandboxedReward(t.spec, timeout_s, counters)
                           for t in terms])

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.terms]

    def parts(self, prompt: str, completion: str, answer: str) -> dict[str, float]:
        return {t.name: float(f(prompt, completion, answer)) for t, f in zip(self.terms, self.functions)}

    def total(self, parts: dict[str, float]) -> float:
        return sum(t.weight * parts[t.name] for t in self.terms)

    def __call__(self, prompt: str, completion: str, answer: str) -> float:
        return self.total(self.parts(prompt, completion, answer))

    def close(self) -> None:
        for function in self.functions:
            if isinstance(function, SandboxedReward):
                function.close()
