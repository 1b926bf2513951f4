"""The baseline engine: Hugging Face `generate` on a whole batch, static (no continuous batching).

It is what most GRPO scripts do, kept as the reference the native engine is measured against.
Deviations from a serving engine, on purpose: one `step()` runs a whole batch to completion, so
`interrupt` only ever returns requests that had not started; per-request seeds are not
independent (the batch is sampled from one generator seeded by its first request), and a batch
decodes until its longest request is done.
In bounded-lag mode nothing is ever in flight at a step boundary (a step finishes its batch), so
new weights apply between batches: no partial rollout, and `partial_rollout: keep` is refused.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Mapping

import torch

from colorl.engines.base import Engine, EngineStats, GenerationRequest, GenerationResult, SamplingParams
from colorl.kernels import use_onednn_linears
from colorl.models import load_model


class HFEngine(Engine):
    def __init__(self, model_dir: Path | str, engine_cfg, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 max_batch: int | None = None) -> None:
        self.model = load_model(Path(model_dir), dtype).to(device).eval()
        use_onednn_linears(self.model, device)  # on CPU, the native engine's products (colorl/kernels.py)
        self.device = device
        self.max_batch = max_batch or engine_cfg.max_num_seqs
        self.eos_id = self.model.generation_config.eos_token_id
        self.pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0
        self.version = 0
        self._waiting: deque[GenerationRequest] = deque()
        self._finished = 0
        self._tokens, self._seconds = 0, 0.0
        self._asleep_weights: dict[str, torch.Tensor] | None = None

    # -- requests
    def add(self, request: GenerationRequest) -> None:
        self._waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self._waiting)

    def abort(self, request_ids: Iterable[str]) -> None:
        ids = set(request_ids)
        self._waiting = deque(r for r in self._waiting if r.request_id not in ids)

    def interrupt(self, request_ids: Iterable[str], keep_kv: bool = False) -> list[GenerationResult]:
        """Waiting requests only (a batch runs to its end): they hold no KV, so keep_kv changes nothing."""
        ids = set(request_ids)
        taken = [r for r in self._waiting if r.request_id in ids]
        self.abort(ids)
        return [_result(r, [], [], self.version, "interrupt") for r in taken]

    def step(self) -> list[GenerationResult]:
        """Generate the next batch: the waiting requests that share the first one's sampling params."""
        if not self._waiting:
            return []
        params = _batch_key(self._waiting[0].params)
        batch: list[GenerationRequest] = []
        rest: deque[GenerationRequest] = deque()
        for request in self._waiting:
            same = _batch_key(request.params) == params
            (batch if same and len(batch) < self.max_batch else rest).append(request)
        self._waiting = rest
        started = time.perf_counter()
        results = self._generate(batch)
        self._seconds += time.perf_counter() - started
        self._finished += len(results)
        return results

    @torch.no_grad()
    def _generate(self, batch: list[GenerationRequest]) -> list[GenerationResult]:
        params: SamplingParams = batch[0].params
        contexts = [r.prompt_ids + r.output_ids for r in batch]
        width = max(len(c) for c in contexts)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, ctx in enumerate(contexts):  # left padding: generation continues at the right edge
            input_ids[i, width - len(ctx):] = torch.tensor(ctx)
            attention[i, width - len(ctx):] = 1
        budget = [r.params.max_new_tokens - len(r.output_ids) for r in batch]
        stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else _as_list(self.eos_id))
        torch.manual_seed(batch[0].params.seed if batch[0].params.seed is not None else 0)
        out = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
            do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None,
            max_new_tokens=max(1, max(budget)), eos_token_id=stop_ids or None, pad_token_id=self.pad_id,
            min_new_tokens=max(budget) if params.ignore_eos and not params.stop_token_ids else None,
            output_scores=True, return_dict_in_generate=True,
        )
        new_tokens = out.sequences[:, width:]  # [N, T]
        # scores are the processed logits actually sampled from (temperature, top-k, top-p applied);
        # one step at a time, so no [N, T, V] tensor is ever built
        token_logp = torch.stack([
            torch.log_softmax(step_scores.float(), dim=-1).gather(-1, new_tokens[:, t : t + 1]).squeeze(-1)
            for t, step_scores in enumerate(out.scores)
        ], 1).cpu()  # [N, T]
        new_tokens = new_tokens.cpu()
        results = []
        for i, request in enumerate(batch):
            ids, reason = [], "length"
            for t in range(min(budget[i], new_tokens.shape[1])):
                token = int(new_tokens[i, t])
                ids.append(token)
                if token in stop_ids:
                    reason = "stop"
                    break
            self._tokens += len(ids)
            results.append(_result(request, ids, token_logp[i, : len(ids)].tolist(), self.version, reason))
        return results

    # -- weights and memory
    def named_weights(self) -> Mapping[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def sleep(self, level: int = 1) -> None:
        """No KV cache outlives a step here; level 2 moves the weights to host memory (CUDA only)."""
        if level >= 2 and self.device != "cpu":
            self.model.to("cpu")

    def wake(self) -> None:
        if self.device != "cpu":
            self.model.to(self.device)

    def stats(self) -> EngineStats:
        rate = self._tokens / self._seconds if self._seconds else 0.0
        return EngineStats(running=0, waiting=len(self._waiting), finished=self._finished,
                           kv_blocks_used=0, kv_blocks_total=0, decode_tokens_per_s=rate)


def _batch_key(params: SamplingParams) -> SamplingParams:
    """Requests that may share one `generate` call: same params but for length and seed."""
    return replace(params, max_new_tokens=0, seed=None)


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _result(request: GenerationRequest, ids: list[int], logps: list[float], version: int, reason: str) -> GenerationResult:
    return GenerationResult(
        request_id=request.request_id, prompt_ids=request.prompt_ids,
        output_ids=request.output_ids + ids, logprobs=request.output_logprobs + logps,
        versions=request.output_versions + [version] * len(ids), finish_reason=reason,
        state_version=request.state_version,  # one generate call computes the prompt and the tokens
    )
