"""Only the model's own tokens of a multi-turn episode train: the environment's get no gradient.

Real episodes from the native engine on the tiny model (tool results between the turns), a real
PolicyTrainer. The trained positions are exactly the sampled ones, and changing anything the loss
would read at an environment token (its behaviour log-prob) leaves every gradient bit-identical;
the same change with the environment's tokens trained (no loss mask) moves the gradients, so the
check can fail.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from colorl.config import EngineConfig
from colorl.engines.base import GenerationRequest, SamplingParams
from colorl.engines.native.engine import NativeEngine
from colorl.rollout.episodes import EpisodeSetup, Rollouts
from colorl.rollout.types import Group
from colorl.tasks.base import Problem
from colorl.train.batch import build_batch
from colorl.train.packing import pack
from exactness_helpers import _grads, trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from scripted_envs import TOOL_TEXT, ScriptedToolEnv  # noqa: E402


@pytest.fixture(scope="module")
def episode_group(tiny_model_dir) -> Group:
    from colorl.models import build_tokenizer

    tokenizer = build_tokenizer()
    engine = NativeEngine(tiny_model_dir, EngineConfig(num_blocks=256, block_size=4, max_num_seqs=8))
    setup = EpisodeSetup(ScriptedToolEnv, tokenizer, max_turns=4, turn_tokens=6, episode_tokens=400, timeout_s=5.0)
    rollouts = Rollouts(engine, setup)
    try:
        results = rollouts.generate([(GenerationRequest(f"0:{s}", [1], SamplingParams(max_new_tokens=6, seed=s)),
                                      Problem("What is 2 + 2?", "4")) for s in range(3)])
    finally:
        rollouts.close()
    for result in results:
        assert 0 < sum(result.loss_mask) < len(result.loss_mask)  # model turns and tool results
        assert TOOL_TEXT in tokenizer.decode([t for t, m in zip(result.output_ids, result.loss_mask) if not m])
    return Group(Problem("What is 2 + 2?", "4"), results, [0.0, 1.0, 0.5])


def _grads_of(t, groups: list[Group]) -> dict[str, torch.Tensor]:
    t.optimizer.zero_grad(set_to_none=True)
    t.accumulate_gradients(build_batch(groups, std_norm=True, pad_id=0))
    grads = _grads(t.model)
    t.optimizer.zero_grad(set_to_none=True)
    return grads


def _env_logprobs_changed(group: Group) -> Group:
    """The environment tokens' behaviour log-probs set far from the policy's: IS weights would change."""
    results = [replace(r, logprobs=[lp if m else -30.0 for lp, m in zip(r.logprobs, r.loss_mask)])
               for r in group.results]
    return replace(group, results=results)


def _unmasked(group: Group) -> Group:
    """What a trainer that ignored the loss mask would train: every output token."""
    return replace(group, results=[replace(r, loss_mask=None) for r in group.results])


def test_the_trained_tokens_are_exactly_the_sampled_ones(episode_group):
    batch = build_batch([episode_group], std_norm=True, pad_id=0)
    for i, result in enumerate(episode_group.results):
        micro = pack(batch, [i])
        start = len(result.prompt_ids)
        sampled = [start + k for k, m in enumerate(result.loss_mask) if m]
        assert (micro.predict_at + 1).tolist() == sampled
        assert micro.targets.tolist() == [result.output_ids[k - start] for k in sampled]
        assert micro.behaviour_logp.tolist() == pytest.approx([result.logprobs[k - start] for k in sampled])


def test_no_environment_token_gets_gradient(tiny_model_dir, episode_group):
    torch.manual_seed(0)
    t = trainer(tiny_model_dir, "loss.tis_cap=1e9")
    reference = _grads_of(t, [episode_group])
    assert any(g.abs().sum() > 0 for g in reference.values())
    changed = _grads_of(t, [_env_logprobs_changed(episode_group)])
    assert all(torch.equal(reference[name], changed[name]) for name in reference)
    # the control: were the environment's tokens trained, the same change would move the gradients
    unmasked, unmasked_changed = (_grads_of(t, [_unmasked(g)])
                                  for g in (episode_group, _env_logprobs_changed(episode_group)))
    assert not all(torch.equal(unmasked[name], unmasked_changed[name]) for name in unmasked)


def test_an_episode_whose_environment_faulted_does_not_train(episode_group):
    first = episode_group.results[0]
    faulted = replace(episode_group, results=[replace(first, episode=replace(first.episode, fault="raised")),
                                              *episode_group.results[1:]])
    trained = build_batch([faulted], std_norm=True, pad_id=0).trained_tokens()
    assert trained[0] == 0 and all(trained[1:] > 0)
