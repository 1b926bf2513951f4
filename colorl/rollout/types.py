"""A GRPO group: the S samples of one prompt, with their rewards once all S are done."""
from __future__ import annotations

from dataclasses import dataclass

from colorl.engines.base import GenerationResult
from colorl.tasks.base import Problem


@dataclass
class Group:
    problem: Problem
    results: list[GenerationResult]  # S samples
    rewards: list[float]

    @property
    def first_version(self) -> int:
        """A group's V_traj: the oldest version that produced any of its tokens."""
        return min(r.first_version for r in self.results)

    @property
    def has_signal(self) -> bool:
        """False for zero-variance groups: every advantage would be 0."""
        return max(self.rewards) != min(self.rewards)
