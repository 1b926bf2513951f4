"""Accuracy on a task's held-out problems, through any Engine (greedy, or sampled at a temperature)."""
from __future__ import annotations

from dataclasses import dataclass

from colorl.engines.base import Engine, GenerationRequest, SamplingParams
from colorl.rollout.episodes import EpisodeSetup, Rollouts, sample_rewards
from colorl.tasks.base import Problem
from colorl.tasks.chat import problem_ids


@dataclass(frozen=True)
class EvalResult:
    accuracy: float  # mean reward over problems x samples
    problems: int
    samples: int
    tool_use: float | None = None  # episodes: the share that called a tool at least once


def evaluate(engine: Engine, problems: list[Problem], reward_fn, tokenizer, max_new_tokens: int,
             samples: int = 1, temperature: float | None = None, seed: int = 0,
             system_prompt: str | None = None, stop_ids: tuple[int, ...] = (),
             episodes: EpisodeSetup | None = None) -> EvalResult:
    """Greedy when `temperature` is None (top-k 1, which every engine supports), else sampled.
    With `episodes`, each sample is an episode with the environment, scored by it."""
    samples_to_run = []
    for i, problem in enumerate(problems):
        ids = problem_ids(tokenizer, problem, system_prompt)
        for s in range(samples):
            params = SamplingParams(temperature=temperature or 1.0, top_k=1 if temperature is None else 0,
                                    max_new_tokens=max_new_tokens, stop_token_ids=stop_ids,
                                    seed=seed * 7919 + i * samples + s)
            samples_to_run.append((GenerationRequest(f"eval-{i}-{s}", ids, params), problem))
    rollouts = Rollouts(engine, episodes)  # its own: the rollout thread's may hold parked episodes
    try:
        results = rollouts.generate(samples_to_run)
    finally:
        rollouts.close()
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    total = sum(sum(sample_rewards(problem, [result], reward_fn, decode))
                for (_, problem), result in zip(samples_to_run, results))
    records = [r.episode for r in results if r.episode is not None]
    tool_use = sum(1 for e in records if e.tool_calls) / len(records) if records else None
    return EvalResult(accuracy=total / max(len(results), 1), problems=len(problems), samples=samples,
                      tool_use=tool_use)
