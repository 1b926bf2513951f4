"""The inference-engine interface every backend implements.

The trainer talks to engines only through this module's types, so backends
(hf, native, sglang) are interchangeable in both modes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

from colorl.engines.weights import copy_rows
from colorl.envs.base import EpisodeRecord


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # Partial rollout: tokens already generated for this request (resume by re-prefill),
    # with their behaviour log-probs and versions, carried into the result.
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    state_version: int | None = None  # the interrupted part's `GenerationResult.state_version`


@dataclass
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of each output token, at the sampling temperature
    versions: list[int]  # policy version that produced each output token
    finish_reason: str  # "stop" | "length" | "abort" | "interrupt"
    # A multi-turn episode (colorl/rollout/episodes.py): its output interleaves the model's tokens
    # (mask 1) with the environment's (tool results, user turns: mask 0, log-prob 0, the version
    # of the model token before them). None: every output token was sampled.
    loss_mask: list[int] | None = None
    episode: EpisodeRecord | None = None
    # The oldest version that computed KV some sampled token read, where the engine records it: a
    # prompt prefilled in chunks across a weight update, read by tokens sampled after it (keep-mode
    # partial rollout), is older than every token's version. None: no older state than the tokens.
    state_version: int | None = None

    @property
    def sampled_tokens(self) -> int:
        """Output tokens the model sampled (an episode's environment tokens were prefilled, not decoded)."""
        return len(self.output_ids) if self.loss_mask is None else sum(self.loss_mask)

    @property
    def sampled_versions(self) -> list[int]:
        """The versions of the tokens the model sampled."""
        if self.loss_mask is None:
            return self.versions
        return [v for v, m in zip(self.versions, self.loss_mask) if m]

    @property
    def first_version(self) -> int | None:
        """V_traj: the oldest version that computed any state the sampled tokens depend on (their own
        versions and `state_version`); None when the model sampled nothing (no state was computed)."""
        versions = self.sampled_versions
        if not versions:
            return None
        return min(versions) if self.state_version is None else min(self.state_version, *versions)


def oldest_version(*versions: int | None) -> int | None:
    """The oldest of the versions given, None (no state recorded) left out; None when all are."""
    return min((v for v in versions if v is not None), default=None)


def carried_state_version(request: GenerationRequest, kv_version: int | None, sampled: bool) -> int | None:
    """`GenerationResult.state_version` of a request whose prompt KV in this life may date from
    `kv_version` (None: no older than its tokens). An engine that cannot see which version computed
    the KV (SGLang's scheduler, another process) passes the admission version, the oldest possible:
    never newer than the truth, older by at most the updates between admission and the first token;
    vLLM passes the version ending at the first update the request had KV computed before. It counts
    once the model sampled a token in this life (none sampled: no token read that KV, and a resume
    computes it again). The prefix cache must hold no KV older than the admission (reset at every
    update, or off while requests run across one)."""
    return oldest_version(request.state_version, kv_version) if sampled else request.state_version


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    finished: int
    kv_blocks_used: int
    kv_blocks_total: int
    decode_tokens_per_s: float


class Engine(ABC):
    """A rollout engine. Weights use Hugging Face parameter names."""

    version: int = 0
    # In-flight sequences continue on their KV cache across `update_weights` (partial rollout "keep").
    keeps_kv_across_updates: bool = False
    # Every step runs with the thread count the engine was built with (vLLM's CPU attention), so in
    # bounded-lag mode the worker builds it with the rollout loop's share of the cores.
    keeps_build_threads: bool = False
    # The loggers of the library behind the engine: their records go to RUN_DIR/engine.log, and the
    # engine's start-up output with them (colorl/engines/engine_log.py).
    log_names: tuple[str, ...] = ()
    # Environment the engine sets in the rank's own process when it starts; the rank sets it first,
    # before its first collective, so every NCCL communicator of the rank is made under it.
    process_env: Mapping[str, str] = {}

    @classmethod
    def model_refusal(cls, hf_config, device: str) -> str | None:
        """Why this engine cannot serve a model with this Hugging Face config on `device` (one line
        for the user, checked before launch), or None."""
        return None

    @abstractmethod
    def add(self, request: GenerationRequest) -> None: ...

    @abstractmethod
    def step(self) -> list[GenerationResult]:
        """Advance every running request by one scheduling step; return those that finished."""

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    @abstractmethod
    def abort(self, request_ids: Iterable[str]) -> None: ...

    @abstractmethod
    def interrupt(self, request_ids: Iterable[str], keep_kv: bool = False) -> list[GenerationResult]:
        """Stop the requests and hand back what they generated so far (finish_reason 'interrupt').

        keep_kv: the caller will re-add them with the same tokens soon (e.g. after an evaluation):
        an engine that can keeps their KV for that; one that cannot re-prefills them then."""

    @abstractmethod
    def named_weights(self) -> Mapping[str, torch.Tensor]:
        """The engine's live weight tensors by HF name: targets for in-place loads."""

    def full_load_targets(self) -> Mapping[str, torch.Tensor]:
        """`named_weights()` for a writer that overwrites every one of them and then sets `version`
        (the checkpoint engine's sync of a full fine-tune): an engine that released its weights at
        sleep level 2 gives their memory back here."""
        return self.named_weights()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the engine's weights in place (caller guarantees a step boundary)."""
        targets = self.named_weights()
        with torch.no_grad():
            for name, tensor in named_tensors:
                copy_rows(targets[name], 0, tensor)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.load_weights(named_tensors)
        self.version = version

    @abstractmethod
    def sleep(self, level: int = 1) -> None: ...

    @abstractmethod
    def wake(self) -> None: ...

    @abstractmethod
    def stats(self) -> EngineStats: ...

    def generate(self, requests: Iterable[GenerationRequest]) -> list[GenerationResult]:
        """Run requests to completion; results in request order."""
        order = []
        for request in requests:
            order.append(request.request_id)
            self.add(request)
        done: dict[str, GenerationResult] = {}
        while self.has_unfinished():
            for result in self.step():
                done[result.request_id] = result
        return [done[rid] for rid in order]
