"""Phase 2 of a colocated step: turn problems into finished, rewarded groups through `Rollouts`.

Rewards are computed as soon as all S samples of a group are done, while the engine keeps
decoding the others. `step_requests` is shared with the bounded-lag mode, so both modes draw
the very same samples (seeds, lengths) for the same step and rank.
"""
from __future__ import annotations

import random
from typing import Callable

from colorl.engines.base import GenerationRequest, SamplingParams
from colorl.rollout.episodes import Rollouts, score_samples
from colorl.rollout.types import Group
from colorl.staleness.formula import LengthModel
from colorl.tasks.base import Problem


def sampling_params(rollout_cfg, seed: int, length: LengthModel | None, rng: random.Random,
                    stop_ids: tuple[int, ...]) -> SamplingParams:
    max_new = rollout_cfg.max_new_tokens
    if length is not None:
        max_new = length.draw(rng)
    return SamplingParams(
        temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p, top_k=rollout_cfg.top_k,
        max_new_tokens=max_new, stop_token_ids=() if length is not None else stop_ids,
        ignore_eos=length is not None, seed=seed,
    )


def step_requests(rollout_cfg, prompt_ids: list[list[int]], group_ids: list[str], base_seed: int,
                  stop_ids: tuple[int, ...] = (), samples_per_group: int | None = None) -> list[list[GenerationRequest]]:
    """The requests of one step's groups on one rank: request id `"{group_id}:{s}"`.

    Seeds depend on (base_seed, position in the step, sample index) only; with
    `rollout.length_override` the lengths come from the simulator's length model, EOS ignored,
    so real runs match it. `samples_per_group` > S over-samples a group (redundant rollout): the
    first S samples are exactly the ones a plain run draws.
    """
    size = rollout_cfg.group_size
    extra = (samples_per_group or size) - size
    length = LengthModel(**rollout_cfg.length_override.model_dump()) if rollout_cfg.length_override else None
    rng = random.Random(base_seed)
    requests = []
    for g, (ids, group_id) in enumerate(zip(prompt_ids, group_ids)):
        seeds = [base_seed * 100_003 + g * size + s for s in range(size)]
        params = [sampling_params(rollout_cfg, seed, length, rng, stop_ids) for seed in seeds]
        requests.append([GenerationRequest(f"{group_id}:{s}", list(ids), p) for s, p in enumerate(params)])
    surplus_rng = random.Random(base_seed + 1)  # surplus samples never shift the plain run's draws
    for g, group in enumerate(requests):
        for s in range(size, size + extra):
            seed = (base_seed * 100_003 + g * size + s) * 31 + 7
            group.append(GenerationRequest(f"{group_ids[g]}:{s}", list(prompt_ids[g]),
                                           sampling_params(rollout_cfg, seed, length, surplus_rng, stop_ids)))
    return requests


def collect_groups(rollouts: Rollouts, problems: list[Problem], prompt_ids: list[list[int]], rollout_cfg,
                   reward_fn, decode: Callable[[list[int]], str], base_seed: int,
                   stop_ids: tuple[int, ...] = (), problem_indices: list[int] | None = None,
                   env_faults: str = "exclude") -> list[Group]:
    """Generate S samples (completions or episodes) per problem; reward each group as soon as its last one ends.
    env_faults: `filter.env_faults` (see `Group.scored`)."""
    size = rollout_cfg.group_size
    for problem, group in zip(problems, step_requests(rollout_cfg, prompt_ids, [str(g) for g in range(len(problems))],
                                                      base_seed, stop_ids)):
        for request in group:
            rollouts.start(request, problem)
    pending: dict[int, dict[int, object]] = {g: {} for g in range(len(problems))}
    groups: dict[int, Group] = {}
    while rollouts.has_unfinished():
        for result in rollouts.step():
            g, s = map(int, result.request_id.split(":"))
            pending[g][s] = result
            if len(pending[g]) == size:
                results = [pending[g][i] for i in range(size)]
                index = problem_indices[g] if problem_indices is not None else -1
                rewards, parts = score_samples(problems[g], results, reward_fn, decode)
                groups[g] = Group(problems[g], results, rewards, problem_index=index, env_faults=env_faults,
                                  reward_parts=parts)
    return [groups[g] for g in range(len(problems))]
