"""Phase 2 of a step: turn problems into finished, rewarded groups through an Engine.

Rewards are computed as soon as all S samples of a group are done, while the engine keeps
decoding the others.
"""
from __future__ import annotations

import random
from typing import Callable

from colorl.engines.base import Engine, GenerationRequest, SamplingParams
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


def collect_groups(engine: Engine, problems: list[Problem], prompt_ids: list[list[int]], rollout_cfg,
                   reward_fn, decode: Callable[[list[int]], str], base_seed: int,
                   stop_ids: tuple[int, ...] = ()) -> list[Group]:
    """Generate S samples per problem and reward each group as soon as its last sample finishes."""
    size = rollout_cfg.group_size
    # `rollout.length_override`: the simulator's length model, EOS ignored, so real runs match it
    length = LengthModel(**rollout_cfg.length_override.model_dump()) if rollout_cfg.length_override else None
    rng = random.Random(base_seed)
    pending: dict[int, dict[int, object]] = {}
    for g, ids in enumerate(prompt_ids):
        pending[g] = {}
        for s in range(size):
            params = sampling_params(rollout_cfg, base_seed * 100_003 + g * size + s, length, rng, stop_ids)
            engine.add(GenerationRequest(request_id=f"{g}:{s}", prompt_ids=list(ids), params=params))
    groups: dict[int, Group] = {}
    while engine.has_unfinished():
        for result in engine.step():
            g, s = map(int, result.request_id.split(":"))
            pending[g][s] = result
            if len(pending[g]) == size:
                results = [pending[g][i] for i in range(size)]
                problem = problems[g]
                rewards = [reward_fn(problem.prompt, decode(r.output_ids), problem.answer) for r in results]
                groups[g] = Group(problem, results, rewards)
    return [groups[g] for g in range(len(problems))]
