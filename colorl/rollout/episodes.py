"""What the modes drive: samples that are one completion, or multi-turn episodes with an environment.

`Rollouts` stands between a mode's loop and its engine with the engine's own verbs (start,
step, has_unfinished, abort, interrupt and resume), so colocated mode, the bounded-lag rollout
thread and the held-out eval run episodes with the code that runs completions.

Without an environment a sample is one engine request and `Rollouts` adds nothing. With one
(`task.env`), a sample is an episode:

    env = Env(problem); reset() on the environment pool -> the opening messages
    each turn: one engine request whose prompt is the whole conversation so far (the engine's
        prefix cache finds the earlier turns' KV), at most `turn_tokens` new tokens
    its message -> step() on the pool, while the engine decodes the other sequences
    -> the next messages (appended as context, mask 0) and the next turn, or the end and its reward

An episode also ends, with reward 0, when the environment faults (raises, hangs past
`env_timeout_s`, answers with something that is not an EnvStep: colorl/envs/guard.py, or with
messages the chat template cannot render: fault "invalid"), after
`max_turns` model messages, or when its tokens after the opening prompt would pass
`episode_tokens` (or the conversation would leave no room in the model's context). The finished sample is one `GenerationResult`: the opening prompt, then every
later token with its loss mask, behaviour log-prob and version, and an `EpisodeRecord`.

While every live episode waits on its environment, the engine has nothing to decode: that time
is counted (`take_env_wait_s`), the idle time the bounded-lag mode's overlap can recover.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

from colorl.distributed import use_device
from colorl.engines.base import Engine, GenerationRequest, GenerationResult, oldest_version
from colorl.envs import (Conversation, ConversationError, EnvRunner, Environment, GuardedStep, Message, PendingStep,
                         parse_tool_calls)
from colorl.envs.base import TRUNCATED_BY_TOKENS, TRUNCATED_BY_TURNS, EpisodeRecord
from colorl.tasks.base import Problem
from colorl.tasks.weighted_rewards import WeightedRewards

ENV_POLL_S = 0.005  # how long a step waits on an environment when the engine has nothing to decode
TURN_SEED_STRIDE = 1_000_003  # turn t of a sample samples with seed + t * stride (mod 2**31): each turn its own stream


@dataclass(frozen=True)
class EpisodeSetup:
    """An environment class and the episode limits (the `task.env*` keys)."""

    env_class: type[Environment]
    tokenizer: object
    max_turns: int
    turn_tokens: int
    episode_tokens: int
    timeout_s: float
    workers: int = 8
    options: dict = field(default_factory=dict)  # task.env_options, the constructor's keyword arguments
    context: int | None = None  # the model's context: a turn whose prompt and answer would not fit is not run
    device: str = "cpu"  # the rank's device, made current in each of the environment pool's threads

    @classmethod
    def from_config(cls, task_cfg, rollout_cfg, tokenizer, context: int | None = None,
                    device: str = "cpu") -> EpisodeSetup | None:
        if not task_cfg.env:
            return None
        from colorl.envs import resolve_env

        return cls(resolve_env(task_cfg.env), tokenizer, task_cfg.max_turns,
                   task_cfg.turn_tokens or rollout_cfg.max_new_tokens, task_cfg.episode_tokens,
                   task_cfg.env_timeout_s, task_cfg.env_workers, dict(task_cfg.env_options), context, device)


@dataclass
class _Episode:
    request: GenerationRequest  # the sample's id and sampling params (its prompt ids are not used)
    env: Environment | None
    conversation: Conversation | None = None
    prompt_len: int = 0  # tokens of the opening prompt
    logprobs: list[float] = field(default_factory=list)  # per token after the opening prompt
    versions: list[int] = field(default_factory=list)
    state_version: int | None = None  # the oldest of its turns' `GenerationResult.state_version`
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    turns_cut: int = 0  # model messages cut at their token cap
    env_seconds: float = 0.0
    turn: GenerationRequest | None = None  # the model turn in the engine
    partial: GenerationResult | None = None  # an interrupted turn, until `resume`
    pending: PendingStep | None = None  # reset or step under way on the pool


class Rollouts:
    """One engine's samples, as completions (`setup` None) or as episodes."""

    def __init__(self, engine: Engine, setup: EpisodeSetup | None = None) -> None:
        self.engine, self.setup = engine, setup
        self._episodes: dict[str, _Episode] = {}
        self._runner: EnvRunner | None = None
        self._env_wait_s = 0.0
        self._done: list[GenerationResult] = []  # samples finished since the last step's return
        self._requests: dict[str, GenerationRequest] = {}  # completions in the engine, for `resume`
        self._parked: dict[str, GenerationResult] = {}  # interrupted completions, until `resume`

    def start(self, request: GenerationRequest, problem: Problem) -> None:
        if self.setup is None:
            self._requests[request.request_id] = request
            self.engine.add(request)
            return
        episode = _Episode(request, env=None)
        self._episodes[request.request_id] = episode
        build = functools.partial(self.setup.env_class, problem, **self.setup.options)
        episode.pending = self._pool().submit_open(build, self.setup.timeout_s)  # a fault there ends the episode

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished() or bool(self._episodes) or bool(self._done)

    def step(self) -> list[GenerationResult]:
        """One engine step (or, when only environments are working, a short wait for one); what finished."""
        if self.setup is None:
            results, self._done = self._done + (self.engine.step() if self.engine.has_unfinished() else []), []
            for result in results:
                self._requests.pop(result.request_id, None)
            return results
        self._settle_environments()
        if self.engine.has_unfinished():
            for result in self.engine.step():
                self._model_turn_done(result)
        elif self._waiting() and not self._done:
            started = time.perf_counter()
            next(p for e in self._episodes.values() if (p := e.pending) is not None).wait(ENV_POLL_S)
            self._env_wait_s += time.perf_counter() - started
            self._settle_environments()
        done, self._done = self._done, []
        return done

    def abort(self, request_ids: Iterable[str]) -> None:
        if self.setup is None:
            ids = list(request_ids)
            self.engine.abort(ids)
            for rid in ids:
                self._requests.pop(rid, None)
                self._parked.pop(rid, None)
            return
        for rid in request_ids:
            episode = self._episodes.pop(rid, None)
            if episode is not None and episode.turn is not None:
                self.engine.abort([episode.turn.request_id])

    def interrupt(self, request_ids: Iterable[str], keep_kv: bool = False) -> list[str]:
        """Stop generating for these samples until `resume` (their tokens keep their versions). A
        request that finished before the interrupt reached the engine is done, not parked: the
        next `step` hands it on, and `resume` leaves it alone (re-adding it would decode past its end)."""
        ids = list(request_ids)
        if self.setup is None:
            for result in self.engine.interrupt(ids, keep_kv=keep_kv):
                if result.finish_reason == "interrupt":
                    self._parked[result.request_id] = result
                else:
                    self._requests.pop(result.request_id, None)
                    self._done.append(result)
            return ids
        turns = {e.turn.request_id: e for rid in ids if (e := self._episodes.get(rid)) and e.turn is not None}
        for result in self.engine.interrupt(list(turns), keep_kv=keep_kv):
            if result.finish_reason == "interrupt":
                turns[result.request_id].partial = result
            else:
                self._model_turn_done(result)
        return ids

    def resume(self, request_ids: Iterable[str]) -> None:
        """Continue interrupted samples where they stopped: re-added with what they generated."""
        for rid in request_ids:
            if self.setup is None:
                if rid not in self._parked:
                    continue  # finished before the interrupt
                request, partial = self._requests[rid], self._parked.pop(rid)
            else:
                episode = self._episodes.get(rid)
                if episode is None or episode.partial is None:
                    continue  # waiting on its environment, not in the engine
                request, partial, episode.partial = episode.turn, episode.partial, None
            self.engine.add(GenerationRequest(request.request_id, request.prompt_ids, request.params,
                                              partial.output_ids, partial.logprobs, partial.versions,
                                              partial.state_version))

    def take_env_wait_s(self) -> float:
        """Seconds the engine had nothing to decode because every live episode waited on its environment."""
        waited, self._env_wait_s = self._env_wait_s, 0.0
        return waited

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()

    def generate(self, samples: list[tuple[GenerationRequest, Problem]]) -> list[GenerationResult]:
        """Run samples to completion; results in the given order."""
        for request, problem in samples:
            self.start(request, problem)
        done: dict[str, GenerationResult] = {}
        while self.has_unfinished():
            for result in self.step():
                done[result.request_id] = result
        return [done[request.request_id] for request, _ in samples]

    # ------------------------------------------------------------------ episodes
    def _pool(self) -> EnvRunner:
        if self._runner is None:
            self._runner = EnvRunner(self.setup.workers, functools.partial(use_device, self.setup.device))
        return self._runner

    def _waiting(self) -> bool:
        return any(e.pending is not None for e in self._episodes.values())

    def _settle_environments(self) -> None:
        for episode in [e for e in self._episodes.values() if e.pending is not None and e.pending.done()]:
            pending, episode.pending = episode.pending, None
            self._environment_answered(episode, pending.result(), next(iter(pending.built), None))

    def _environment_answered(self, episode: _Episode, answer: GuardedStep, env: Environment | None) -> None:
        episode.env = episode.env or env
        episode.env_seconds += answer.seconds
        episode.tool_errors += answer.step.tool_errors
        if answer.fault is not None:
            self._finish(episode, 0.0, fault=answer.fault)
        elif answer.step.done:
            self._finish(episode, answer.step.reward)
        elif episode.conversation is None:  # the opening messages
            try:
                episode.conversation = Conversation.start(self.setup.tokenizer, answer.step.messages, episode.env.tools)
            except ConversationError:  # messages the chat template cannot render: the environment's fault
                self._finish(episode, 0.0, fault="invalid")
                return
            episode.prompt_len = len(episode.conversation.token_ids)
            self._next_turn(episode)
        elif episode.turns >= self.setup.max_turns:
            self._finish(episode, 0.0, truncated=TRUNCATED_BY_TURNS)
        else:
            self._add_context(episode, answer.step.messages)

    def _add_context(self, episode: _Episode, messages: list[Message]) -> None:
        conversation = episode.conversation
        before = len(conversation.token_ids)
        try:
            conversation.add_env_messages(messages)
        except ConversationError:  # as above; the conversation is unchanged, the episode ends at the model's turn
            self._finish(episode, 0.0, fault="invalid")
            return
        added = len(conversation.token_ids) - before
        if len(conversation.token_ids) - episode.prompt_len >= self.setup.episode_tokens:  # no room to answer
            self._finish(episode, 0.0, truncated=TRUNCATED_BY_TOKENS)
            return
        episode.logprobs += [0.0] * added
        episode.versions += [episode.versions[-1] if episode.versions else self.engine.version] * added
        self._next_turn(episode)

    def _next_turn(self, episode: _Episode) -> None:
        used = len(episode.conversation.token_ids) - episode.prompt_len
        budget = min(self.setup.turn_tokens, self.setup.episode_tokens - used)
        if self.setup.context is not None:  # the whole conversation is the turn's prompt
            budget = min(budget, self.setup.context - len(episode.conversation.token_ids))
        if budget < 1:
            self._finish(episode, 0.0, truncated=TRUNCATED_BY_TOKENS)
            return
        params = episode.request.params
        seed = None if params.seed is None else (params.seed + episode.turns * TURN_SEED_STRIDE) % 2**31
        episode.turn = GenerationRequest(f"{episode.request.request_id}/turn{episode.turns}",
                                         list(episode.conversation.token_ids),
                                         replace(params, max_new_tokens=budget, seed=seed))
        self.engine.add(episode.turn)

    def _model_turn_done(self, result: GenerationResult) -> None:
        rid = result.request_id.rpartition("/turn")[0]
        episode = self._episodes.get(rid)
        if episode is None or episode.turn is None or episode.turn.request_id != result.request_id:
            return  # an aborted episode's last turn
        episode.turn = None
        text = episode.conversation.add_model_turn(result.output_ids)
        episode.logprobs += result.logprobs
        episode.versions += result.versions
        episode.state_version = oldest_version(episode.state_version, result.state_version)
        episode.turns += 1
        episode.turns_cut += result.finish_reason == "length"
        if episode.env.tools:
            episode.tool_calls += len(parse_tool_calls(text, episode.env.tools))
        episode.pending = self._pool().submit_step(episode.env, text, self.setup.timeout_s)

    def _finish(self, episode: _Episode, reward: float, fault: str | None = None, truncated: str | None = None) -> None:
        """The sample ends at the model's last token: context the environment added after it (an answer
        that left no room for another turn, in the episode's tokens or the model's context) trains
        nothing and would only lengthen the sequence, past the context even."""
        del self._episodes[episode.request.request_id]
        conversation, start = episode.conversation, episode.prompt_len
        record = EpisodeRecord(reward, episode.turns, episode.tool_calls, episode.tool_errors, episode.env_seconds,
                               fault, truncated, episode.turns_cut)
        if conversation is None:  # ended before its opening messages: nothing generated
            self._done.append(GenerationResult(episode.request.request_id, list(episode.request.prompt_ids), [], [], [],
                                               "stop", loss_mask=[], episode=record))
            return
        end = len(conversation.token_ids)
        while end > start and not conversation.loss_mask[end - 1]:
            end -= 1
        self._done.append(GenerationResult(
            episode.request.request_id, conversation.token_ids[:start], conversation.token_ids[start:end],
            episode.logprobs[:end - start], episode.versions[:end - start], "length" if truncated else "stop",
            loss_mask=conversation.loss_mask[start:end], episode=record, state_version=episode.state_version))


def sample_rewards(problem: Problem, results: list[GenerationResult], reward_fn: Callable,
                   decode: Callable[[list[int]], str]) -> list[float]:
    """Each sample's reward: an episode's from its environment, a completion's from the task's reward."""
    return score_samples(problem, results, reward_fn, decode)[0]


def score_samples(problem: Problem, results: list[GenerationResult], reward_fn: Callable,
                  decode: Callable[[list[int]], str]) -> tuple[list[float], dict[str, list[float]]]:
    """Each sample's reward, and with several reward functions (`WeightedRewards`) each one's score per
    sample, for its own metric; {} otherwise."""
    if not isinstance(reward_fn, WeightedRewards):
        return [r.episode.reward if r.episode is not None else reward_fn(problem.prompt, decode(r.output_ids), problem.answer)
                for r in results], {}
    scored = [reward_fn.parts(problem.prompt, decode(r.output_ids), problem.answer) for r in results]
    return [reward_fn.total(parts) for parts in scored], {name: [p[name] for p in scored] for name in reward_fn.names}
