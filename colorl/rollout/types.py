"""A GRPO group (the S samples of one prompt, rewarded), and what the rollout thread did per step."""
from __future__ import annotations

from dataclasses import dataclass, field

from colorl.engines.base import GenerationResult
from colorl.tasks.base import Problem


@dataclass
class Group:
    problem: Problem
    results: list[GenerationResult]  # S samples
    rewards: list[float]
    problem_index: int = -1  # position in the task's problem stream
    ticket: int = -1  # bounded-lag: this rank's admission number (its position in the rank's data stream)
    done_version: int | None = None  # engine version when the group was complete (None: trained at once)
    env_faults: str = "exclude"  # filter.env_faults: are faulted episodes left out of the statistics?
    reward_parts: dict[str, list[float]] = field(default_factory=dict)  # several reward functions: each one's S scores

    @property
    def first_version(self) -> int | None:
        """A group's V_traj: the oldest version that computed any state of its samples; None when no
        sample has any (every episode ended before the model's first token)."""
        return min((v for r in self.results if (v := r.first_version) is not None), default=None)

    @property
    def scored(self) -> list[bool]:
        """The samples in the group's reward statistics (mean, spread, has_signal): with
        `filter.env_faults=exclude` not an episode whose environment faulted (its reward 0 says
        nothing of the model's answer); with `reward_0` every sample."""
        return [self.env_faults == "reward_0" or r.episode is None or r.episode.fault is None for r in self.results]

    @property
    def has_signal(self) -> bool:
        """False for zero-variance groups: every advantage would be 0."""
        rewards = [x for x, scored in zip(self.rewards, self.scored) if scored]
        return len(set(rewards)) > 1

    @property
    def lengths(self) -> list[int]:
        """Tokens each sample's model generated (an episode's environment tokens are context, not counted)."""
        return [r.sampled_tokens for r in self.results]

    @property
    def mixed_version_tokens(self) -> int:
        """Tokens sampled by a newer version than the oldest that computed any state of their sample
        (partial rollout: earlier tokens, or prompt KV prefilled before a weight update)."""
        return sum(sum(1 for v in r.sampled_versions if v != r.first_version) for r in self.results)


@dataclass
class RolloutWindow:
    """What the rollout thread did between two trainer takes (bounded-lag mode)."""

    wall_s: float = 0.0
    busy_s: float = 0.0  # inside engine.step()
    idle_s: float = 0.0  # nothing admitted: admission blocked or no work
    env_wait_s: float = 0.0  # sequences admitted, but every one waiting on its environment (episodes)
    apply_s: float = 0.0  # writing published weights into the engine
    generated_tokens: int = 0  # tokens of samples that finished generating
    finished_samples: int = 0
    groups_aborted: int = 0  # batch-level redundancy: surplus groups aborted once a buffer is full
    samples_aborted: int = 0  # group-level redundancy: surplus samples aborted once a group is full
    groups_filtered: int = 0  # zero-variance groups released at Occupy
    groups_dropped: int = 0  # evicted by queue_drop or discarded as too stale by queue_max
