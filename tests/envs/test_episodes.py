"""colorl/rollout/episodes.py: multi-turn episodes through a real engine on the tiny model."""
from __future__ import annotations

import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from chat_templates import ALTERNATING, END_OF_TURN, TEMPLATES, template_tokenizer  # tests/helpers
from colorl.config import EngineConfig
from colorl.engines.base import GenerationRequest, SamplingParams
from colorl.engines.native.engine import NativeEngine
from colorl.rollout.episodes import ENV_POLL_S, EpisodeSetup, Rollouts
from colorl.tasks.base import Problem

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
import scripted_envs  # noqa: E402
from scripted_envs import TOOL_TEXT  # noqa: E402

PROBLEM = Problem("What is 2 + 2?", "4")
ODD = Problem("What is 2 + 3?", "5")  # the scripted misbehaving environments misbehave on odd answers


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return NativeEngine(tiny_model_dir, EngineConfig(num_blocks=256, block_size=4, max_num_seqs=8))


@pytest.fixture(scope="module")
def tokenizer():
    from colorl.models import build_tokenizer

    return build_tokenizer()


def _setup(tokenizer, env=scripted_envs.ScriptedToolEnv, **limits) -> EpisodeSetup:
    defaults = {"max_turns": 4, "turn_tokens": 6, "episode_tokens": 400, "timeout_s": 0.5}
    return EpisodeSetup(env, tokenizer, **{**defaults, **limits})


def _request(rid: str, seed: int = 1, max_new: int = 6) -> GenerationRequest:
    return GenerationRequest(rid, [1], SamplingParams(max_new_tokens=max_new, seed=seed))


def _run(engine, setup, n=1) -> list:
    rollouts = Rollouts(engine, setup)
    try:
        return rollouts.generate([(_request(f"0:{s}", seed=s), PROBLEM) for s in range(n)])
    finally:
        rollouts.close()


def _spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) runs of a 0/1 mask."""
    spans, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            spans.append((mask[start], start, i))
            start = i
    return spans


def test_an_episode_is_its_turns_and_the_tool_results_between_them(engine, tokenizer):
    (result,) = _run(engine, _setup(tokenizer))
    record, mask = result.episode, result.loss_mask
    assert record.turns == 3 and record.fault is None and not record.truncated and result.finish_reason == "stop"
    assert len(mask) == len(result.output_ids) == len(result.logprobs) == len(result.versions)
    model_spans = [(s, e) for value, s, e in _spans(mask) if value == 1]
    context_spans = [(s, e) for value, s, e in _spans(mask) if value == 0]
    assert len(model_spans) == 3 and len(context_spans) == 2  # turn, tool result, turn, tool result, turn
    assert all(e - s <= 6 for s, e in model_spans)  # task.turn_tokens per model message
    for s, e in context_spans:  # the environment's tokens: its text, no behaviour log-prob
        assert TOOL_TEXT in tokenizer.decode(result.output_ids[s:e])
        assert all(lp == 0.0 for lp in result.logprobs[s:e])
    assert all(lp < 0 for s, e in model_spans for lp in result.logprobs[s:e])
    opening = tokenizer.decode(result.prompt_ids)
    assert "Use the tool." in opening and "lookup" in opening and PROBLEM.prompt in opening  # tools declared
    assert result.sampled_tokens == sum(mask) and result.first_version == engine.version


def test_each_turn_prompts_with_the_whole_conversation_and_reuses_its_kv(engine, tokenizer):
    seen = []
    add = engine.add
    hits_before = engine.scheduler.num_prefix_hit_tokens
    try:
        engine.add = lambda request: (seen.append(request), add(request))[1]
        (result,) = _run(engine, _setup(tokenizer))
    finally:
        del engine.add
    turns = [r for r in seen if "/turn" in r.request_id]
    assert [r.request_id for r in turns] == ["0:0/turn0", "0:0/turn1", "0:0/turn2"]
    everything = result.prompt_ids + result.output_ids
    for turn in turns:
        assert everything[:len(turn.prompt_ids)] == turn.prompt_ids  # a prefix of the final episode
    assert len(turns[2].prompt_ids) > len(turns[1].prompt_ids) > len(turns[0].prompt_ids) == len(result.prompt_ids)
    assert engine.scheduler.num_prefix_hit_tokens > hits_before  # later turns found the earlier turns' KV


def test_the_same_seeds_give_the_same_episodes(engine, tokenizer):
    first, second = _run(engine, _setup(tokenizer), n=2), _run(engine, _setup(tokenizer), n=2)
    assert [r.output_ids for r in first] == [r.output_ids for r in second]
    assert first[0].output_ids != first[1].output_ids


@pytest.mark.parametrize("env, fault", [(scripted_envs.RaisingEnv, "raised"), (scripted_envs.HangingEnv, "timeout"),
                                        (scripted_envs.GarbageEnv, "invalid"),
                                        (scripted_envs.BrokenConstructorEnv, "raised")])
def test_a_faulty_environment_ends_only_its_episode_with_reward_0(engine, tokenizer, env, fault):
    rollouts = Rollouts(engine, _setup(tokenizer, env=env, timeout_s=0.3))
    try:
        results = rollouts.generate([(_request("0:0"), ODD), (_request("1:0"), PROBLEM)])
    finally:
        rollouts.close()
    done = {r.request_id: r for r in results}
    assert done["0:0"].episode.fault == fault and done["0:0"].episode.reward == 0.0
    assert done["1:0"].episode.fault is None and done["1:0"].episode.turns == 3


class BlockedToolEnv(scripted_envs.ScriptedToolEnv):
    """On odd answers, every tool step blocks until the test releases it."""

    release = threading.Event()

    def step(self, assistant_text: str):
        if scripted_envs.misbehaves(self.problem):
            assert self.release.wait(timeout=20), "never released"
        return super().step(assistant_text)


def test_a_slow_tool_does_not_hold_the_other_sequences(engine, tokenizer):
    """The blocked episode's step runs on the pool: the other one decodes to its end meanwhile (were the
    tool run on the engine's loop, the other episode could never finish and the tool never be released)."""
    BlockedToolEnv.release.clear()
    rollouts = Rollouts(engine, _setup(tokenizer, env=BlockedToolEnv, timeout_s=30.0))
    order = []
    try:
        rollouts.start(_request("1:0"), ODD)
        rollouts.start(_request("0:0"), PROBLEM)
        while rollouts.has_unfinished():
            finished = [r.request_id for r in rollouts.step()]
            order += finished
            if "0:0" in finished:  # only the blocked episode is left: the engine idles, waiting on its tool
                assert [rollouts.step() for _ in range(3)] == [[], [], []]
                BlockedToolEnv.release.set()
    finally:
        BlockedToolEnv.release.set()
        rollouts.close()
    assert order == ["0:0", "1:0"]
    assert rollouts.take_env_wait_s() > 2 * ENV_POLL_S  # counted: the engine had nothing to decode


def test_max_turns_and_the_token_caps_end_an_episode_with_reward_0(engine, tokenizer):
    (turns,) = _run(engine, _setup(tokenizer, env=scripted_envs.NeverDoneEnv, max_turns=2))
    assert turns.episode.turns == 2 and turns.episode.truncated and turns.episode.reward == 0.0
    assert turns.finish_reason == "length"
    (tokens,) = _run(engine, _setup(tokenizer, env=scripted_envs.NeverDoneEnv, max_turns=50, episode_tokens=60))
    assert tokens.episode.truncated and tokens.episode.reward == 0.0 and len(tokens.output_ids) <= 60


def _drive(engine, setup, every: int, between) -> tuple[list, list]:
    """Episodes "0:0" and "0:1" through `Rollouts`, `between(rollouts, steps)` after every `every` steps that
    sampled tokens (what the bounded-lag loop does in flight: interrupts, weight updates); the results and the
    requests the engine got. Counted by the engine's sampled tokens, not per `Rollouts.step`: how many steps
    only wait on the environments' threads, or only prefill, or decode a whole burst, depends on the machine,
    and must not decide whether an update lands between two sampled tokens (or whether a re-prefill finishes
    before the next interrupt)."""
    seen, add = [], engine.add
    rollouts = Rollouts(engine, setup)
    try:
        engine.add = lambda request: (seen.append(request), add(request))[1]
        for s in range(2):
            rollouts.start(_request(f"0:{s}", seed=s), PROBLEM)
        done, steps = {}, 0
        while rollouts.has_unfinished():
            sampled = engine.num_generated_tokens
            done.update({r.request_id: r for r in rollouts.step()})
            if engine.num_generated_tokens != sampled:
                steps += 1
                if steps % every == 0:
                    between(rollouts, steps)
    finally:
        del engine.add
        rollouts.close()
    return [done["0:0"], done["0:1"]], seen


def test_interrupted_turns_resume_with_their_tokens(engine, tokenizer):
    """The bounded-lag loop interrupts in-flight turns (a weight update, an eval) and resumes them."""
    plain = _run(engine, _setup(tokenizer), n=2)
    # park everything mid-turn, then continue where it stopped
    resumed, _ = _drive(engine, _setup(tokenizer), 3,
                        lambda rollouts, steps: rollouts.resume(rollouts.interrupt(["0:0", "0:1"], keep_kv=steps % 2 == 0)))
    assert [r.output_ids for r in resumed] == [r.output_ids for r in plain]


def test_without_an_environment_samples_are_the_engines_completions(engine):
    request = _request("0:0", max_new=5)
    rollouts = Rollouts(engine)
    (result,) = rollouts.generate([(request, PROBLEM)])
    (direct,) = engine.generate([replace(request, request_id="x")])
    assert result.output_ids == direct.output_ids and result.loss_mask is None and result.episode is None


def test_task_env_options_reach_the_environments_constructor(engine, tokenizer):
    from colorl.config import load_config
    from colorl.envs.calculator import CalculatorEnv

    cfg = load_config("configs/tiny.yaml", ["task.env=calculator", "task.env_options={latency_s: 0.05}",
                                            "task.max_turns=1"], check_paths=False)
    setup = EpisodeSetup.from_config(cfg.task, cfg.rollout, tokenizer)
    assert setup.env_class is CalculatorEnv and setup.options == {"latency_s": 0.05}
    (result,) = _run(engine, setup)
    assert result.episode.turns == 1 and result.episode.env_seconds >= 0.05  # the one step slept


def test_an_episode_ends_when_the_next_turn_would_not_fit_the_models_context(engine, tokenizer):
    seen = []
    add = engine.add
    (full,) = _run(engine, _setup(tokenizer))
    context = len(full.prompt_ids) + 12  # room for the first turn (6 tokens) and little more
    try:
        engine.add = lambda request: (seen.append(request), add(request))[1]
        (cut,) = _run(engine, replace(_setup(tokenizer), context=context))
    finally:
        del engine.add
    assert cut.episode.truncated and cut.episode.reward == 0.0 and cut.episode.turns < 3
    assert all(len(r.prompt_ids) + r.params.max_new_tokens <= context for r in seen)


def test_an_environment_answer_past_the_context_is_not_kept_in_the_sample(engine, tokenizer):
    """The tool's answer leaves no room for another turn: the episode ends at the model's last token, so
    the sample never holds untrained context tokens, nor more tokens than the model's context."""
    (full,) = _run(engine, _setup(tokenizer))
    first_turn = next(e for value, _, e in _spans(full.loss_mask) if value == 1)
    context = len(full.prompt_ids) + first_turn + 10  # the first tool result's text alone is longer
    (cut,) = _run(engine, replace(_setup(tokenizer), context=context))
    assert cut.episode.truncated and cut.episode.turns == 1
    assert len(cut.prompt_ids) + len(cut.output_ids) <= context
    assert cut.loss_mask == [1] * len(cut.output_ids) and len(cut.logprobs) == len(cut.versions) == first_turn


@pytest.fixture(scope="module")
def template_engine():
    """A tiny model whose vocabulary holds every template's special tokens (prefill in chunks of 64)."""
    from transformers import AutoModelForCausalLM

    from colorl.models import tiny_config

    tokenizer = template_tokenizer("chatml")
    config = tiny_config(len(tokenizer))
    config.eos_token_id = sorted({tokenizer.convert_tokens_to_ids(t) for t in END_OF_TURN.values()})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return NativeEngine(None, EngineConfig(num_blocks=512, block_size=4, max_num_seqs=8, max_prefill_tokens=64),
                        model=model)


def _episodes_across_updates(engine, setup, mode: str) -> tuple[list, list]:
    """"colocated": at one version. "keep" / "recompute": new weights (here the same values) after every step
    that sampled, with in-flight turns kept on their KV or re-prefilled: tokens sampled in different steps
    come from different versions on any machine, and a re-prefill always gets to sample before the next one."""
    weights = {name: tensor.clone() for name, tensor in engine.named_weights().items()}

    def update(rollouts, steps) -> None:
        engine.update_weights(weights.items(), engine.version + 1)
        if mode == "recompute":
            rollouts.resume(rollouts.interrupt(["0:0", "0:1"]))

    return _drive(engine, setup, 1, update if mode != "colocated" else lambda rollouts, steps: None)


@pytest.mark.matrix
@pytest.mark.parametrize("mode", ["colocated", "keep", "recompute"])
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_episodes_under_each_chat_template_in_both_modes(template_engine, name, mode):
    """ChatML, ChatML that trims, Llama 3 (trims, a header per turn), SmolLM2 (a default system turn),
    Llama-2 style (a BOS per turn): real turns on the engine, tool results between them, in colocated
    mode and across weight updates as bounded-lag mode makes them."""
    tokenizer = template_tokenizer(name)
    start = template_engine.version
    results, seen = _episodes_across_updates(template_engine, _setup(tokenizer, env=scripted_envs.ShortScriptedEnv),
                                             mode)
    for result in results:
        record, mask = result.episode, result.loss_mask
        assert record.turns == 3 and record.fault is None and not record.truncated
        assert len(mask) == len(result.output_ids) == len(result.logprobs) == len(result.versions)
        spans = _spans(mask)
        assert [value for value, _, _ in spans] == [1, 0, 1, 0, 1]
        assert all(TOOL_TEXT in tokenizer.decode(result.output_ids[s:e]) for value, s, e in spans if value == 0)
        assert all(lp < 0 for value, s, e in spans if value == 1 for lp in result.logprobs[s:e])
        assert PROBLEM.prompt in tokenizer.decode(result.prompt_ids)
        everything = result.prompt_ids + result.output_ids
        turns = [r for r in seen if r.request_id.startswith(result.request_id + "/turn")]
        assert len(turns) >= 3 and all(everything[:len(r.prompt_ids)] == r.prompt_ids for r in turns)
        assert start <= result.first_version <= min(result.sampled_versions)
    moved = {v for r in results for v in r.sampled_versions}
    assert (len(moved) > 1) == (mode != "colocated")  # the updates came while the episodes ran


def test_a_template_that_cannot_render_the_environments_messages_ends_that_episode(engine):
    """The environment's message breaks the template (roles must alternate): an environment fault, not a crash."""
    from colorl.models import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = ALTERNATING
    (result,) = _run(engine, _setup(tokenizer, env=scripted_envs.ShortScriptedEnv))
    assert result.episode.fault == "invalid" and result.episode.reward == 0.0 and result.episode.turns == 1
    assert sum(result.loss_mask) == len(result.output_ids) > 0  # the first turn, nothing after it
