"""The native engine: scheduler -> model runner -> sampler, one step at a time.

`step()` is the whole loop: schedule (continuous batching, chunked prefill, preemption), run
the model once over every scheduled token, sample, post-process (append, stop, free blocks).
While every running sequence decodes with the compiled draw on CPU, one `step()` runs a burst of up
to `engine.decode_burst` such steps in one compiled call, ending at the first stop token drawn, and
post-processes them in turn: the same tokens, log-probs and stops, with the Python around a step
paid once per burst.
Around it sit the RL controls the trainer needs and a serving engine usually hides:
- every output token carries its behaviour log-prob (sampler.py says exactly which
  distribution) and the policy version that produced it;
- `abort`, `interrupt` (partial results back), resume by re-adding a request with its generated
  tokens (re-prefill, "recompute") or, with `interrupt(..., keep_kv=True)`, on its kept KV;
- `update_weights` / `load_weights` in place at a step boundary; `version` stamps later tokens.
  Writes through `named_weights()` take effect when `version` is next set (the checkpoint engine
  always sets it): that is when the CPU matmuls' packed weights are refreshed (colorl/kernels.py).
  Running sequences keep their KV across an update (PipelineRL style); the prefix cache is
  dropped so no *new* request reuses KV computed by older weights;
- `sleep(1)` frees the KV pool (in-flight sequences are re-prefilled after `wake()`) and the
  packed weight copies; `sleep(2)` also releases the weights, as vLLM's level 2 discards them:
  colocated mode's next sync rewrites every one of them anyway, so the training phase gets their
  memory. They come back only through a full load (`full_load_targets()` then setting `version`,
  or `load_weights` with every weight); until then the engine refuses to wake or generate. With
  `engine.weights_cpu_backup` (LoRA turns it on: its sync writes the adapted matrices only) level 2
  keeps them instead, in host memory.

Resumed requests: `params.max_new_tokens` bounds the whole output, carried tokens included, and
the sampling stream continues at the carried length (same seed -> same continuation).
"""
from __future__ import annotations

import dataclasses
import enum
import random
import time
from collections import deque
from pathlib import Path
from typing import Iterable, Mapping

import torch

from colorl.engines.base import Engine, EngineStats, GenerationRequest, GenerationResult, SamplingParams
from colorl.engines.native.block_manager import BlockManager
from colorl.engines.native.host_memory import mapped_tensors
from colorl.engines.native.model import CausalLM, Rotary, read_hf_folder
from colorl.engines.native.model_runner import ModelRunner, kv_pool_blocks
from colorl.engines.native.sampler import Sampler, SampleRow, uniform
from colorl.engines.native.scheduler import ScheduledBatch, Scheduler, Sequence
from colorl.models import eos_token_ids

RATE_WINDOW_STEPS = 64  # decode tokens/s is measured over the last this many steps


class WeightState(enum.Enum):
    LOADED = "loaded"
    RELEASED = "released"  # sleep level 2 without a backup: no storage
    LOADING = "loading"  # storage back, written by a full load that ends when `version` is set


class NativeEngine(Engine):
    keeps_kv_across_updates = True

    def __init__(self, model_dir: Path | str | None, engine_cfg, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, model=None) -> None:
        """model: optional weight source instead of the folder's files: a native `CausalLM`, any
        torch module with HF parameter names (e.g. the trainer's), or a name -> tensor mapping.
        The folder still provides config.json (unless model has a `.config`)."""
        self.device = torch.device(device)
        self.dtype = dtype
        config = getattr(model, "config", None) if model_dir is None else _load_config(Path(model_dir))
        if isinstance(model, CausalLM):
            self.model = model.to(self.device)
        else:
            if config is None:
                raise ValueError("NativeEngine needs model_dir (or a model with a .config)")
            self.model = _build_model(config, self.device, dtype)
            if model is None:
                source = read_hf_folder(model_dir)
            elif hasattr(model, "state_dict"):
                source = model.state_dict().items()
            else:
                source = model.items()
            self.model.load_hf_weights(source)
        self.model.eval()
        self.model.repack()
        self.spec = self.model.spec
        self.eos_ids = eos_token_ids(None if model_dir is None else Path(model_dir), config)

        num_blocks = kv_pool_blocks(engine_cfg, self.spec, self.device, dtype)
        self.blocks = BlockManager(num_blocks, engine_cfg.block_size)
        self.scheduler = Scheduler(self.blocks, engine_cfg.max_num_seqs, engine_cfg.max_prefill_tokens)
        self.decode_burst = engine_cfg.decode_burst
        self.runner = ModelRunner(self.model, num_blocks, engine_cfg.block_size, self.device, dtype)
        self.runner.allocate_kv()
        self.sampler = Sampler()
        self._version = 0
        self._sleep_level = 0
        self._keeps_weights_asleep = engine_cfg.weights_cpu_backup
        self._weights = WeightState.LOADED
        self._shapes = {name: param.shape for name, param in self.model.named_parameters()}  # to allocate them again
        self._finished_count = 0
        self._pending: list[GenerationResult] = []  # decided without a model step (e.g. added complete)
        self._rate: deque[tuple[int, float]] = deque(maxlen=RATE_WINDOW_STEPS)
        self._seeds = random.Random()
        self.num_computed_tokens = 0  # tokens run through the model (prefill + decode)
        self.num_generated_tokens = 0

    # ------------------------------------------------------------ version
    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        if value != self._version:
            self.blocks.reset_prefix_cache()  # new weights: cached prefixes are stale
        self._version = value
        if self._weights is WeightState.RELEASED:  # a version stamp without a load: still nothing to serve
            return
        self._weights = WeightState.LOADED
        self.model.repack()  # setting the version is how a weight writer says it is done

    # ------------------------------------------------------------ requests
    def add(self, request: GenerationRequest) -> None:
        rid = request.request_id
        if self.scheduler.find(rid) is not None and rid not in self.scheduler.parked:
            raise ValueError(f"request {rid!r} is already in the engine")
        n_out = len(request.output_ids)
        if len(request.output_logprobs) != n_out or len(request.output_versions) != n_out:
            raise ValueError(f"request {rid!r}: output_ids, output_logprobs and output_versions differ in length")
        if not request.prompt_ids:
            raise ValueError(f"request {rid!r}: empty prompt")
        params = request.params
        if params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < 0:
            raise ValueError(f"request {rid!r}: bad sampling params {params}")
        tokens = list(request.prompt_ids) + list(request.output_ids)
        seq = self.scheduler.resume_parked(rid, tokens)  # parked with its KV: continue on it
        resumed = seq is not None
        if seq is None:
            seq = Sequence(
                request_id=rid, token_ids=tokens, num_prompt_tokens=len(request.prompt_ids), params=params,
                seed=params.seed if params.seed is not None else self._seeds.getrandbits(63),
            )
        seq.params = params
        seq.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        seq.logprobs = list(request.output_logprobs)
        seq.versions = list(request.output_versions)
        seq.state_version = request.state_version
        reason = Scheduler.stop_reason(seq)
        if reason is not None:  # nothing left to generate
            if resumed:
                self.scheduler.remove(rid)
            seq.finish_reason = reason
            self._pending.append(self._result(seq, reason))
        elif not resumed:
            self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished()

    def step(self) -> list[GenerationResult]:
        if self._sleep_level:
            raise RuntimeError("engine is asleep: call wake() before step()")
        self._check_weights("generate")
        results, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        burst = self._burst_steps(batch)
        if burst > 1:  # several decode steps in one compiled call, up to the first stop token drawn
            finished = self._run_burst(batch, burst)
        else:
            sampled: dict[int, tuple[int, float]] = {}
            if batch.seqs:
                started = time.perf_counter()
                logits, rows = self.runner.run(batch)  # [N, V], batch index of each row
                tokens, logps = self.sampler(logits, [self._sample_row(batch.seqs[i]) for i in rows],
                                             self.model.compiled(torch.float32, self.device))
                sampled = dict(zip(rows, zip(tokens, logps)))
                self.num_computed_tokens += sum(batch.num_tokens)
                self.num_generated_tokens += len(sampled)
                self._rate.append((len(sampled), time.perf_counter() - started))
            elif not results and not batch.truncated and self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests pending (KV pool too small?)")
            finished = self.scheduler.postprocess(batch, sampled, self.version)
        for seq in finished:
            results.append(self._result(seq, seq.finish_reason))
        self._finished_count += len(results)
        return results

    @torch.inference_mode()
    def score(self, prompt_ids: list[int], output_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Teacher-forced log-probs of `output_ids` after `prompt_ids` under the weights served now, of
        the distribution `step()` samples from at `temperature` (its behaviour log-probs): for checking
        this engine's numerics against another engine on the very same tokens. One prefill through
        the model runner in free KV blocks, every output position's logits kept."""
        if self._sleep_level:
            raise RuntimeError("engine is asleep: call wake() before score()")
        self._check_weights("score")
        tokens = [*prompt_ids, *output_ids]
        blocks = self.blocks.allocate(self.blocks.blocks_for(len(tokens)))
        try:
            seq = Sequence(request_id="score", token_ids=tokens, num_prompt_tokens=len(prompt_ids),
                           params=SamplingParams(temperature=temperature), seed=0, block_table=blocks)
            batch = ScheduledBatch()
            batch.add(seq, len(tokens))
            step, _ = self.runner.prepare(batch)
            rows = torch.arange(len(prompt_ids) - 1, len(tokens) - 1, device=self.device)
            logits = self.model(dataclasses.replace(step, logit_rows=rows, every_token_samples=False), self.runner.kv_cache)  # [N, V] float32
            if temperature > 0:
                logits = logits / temperature
            chosen = torch.tensor(output_ids, device=self.device)[:, None]
            return torch.log_softmax(logits, -1).gather(-1, chosen).squeeze(-1).tolist()
        finally:
            self.blocks.free(blocks)

    def abort(self, request_ids: Iterable[str]) -> None:
        ids = set(request_ids)
        self._pending = [r for r in self._pending if r.request_id not in ids]
        for rid in ids:
            self.scheduler.remove(rid)

    def interrupt(self, request_ids: Iterable[str], keep_kv: bool = False) -> list[GenerationResult]:
        """Stop the requests; return what each generated so far (finish_reason 'interrupt').

        keep_kv: park their KV blocks so that re-adding the same request (same tokens) resumes
        without re-prefill, even across a weight update. Parked KV is released by `abort`, by
        `sleep`, or when the pool needs it (the resume then re-prefills).
        """
        ids = list(request_ids)
        done = {r.request_id: r for r in self._pending if r.request_id in ids}
        self._pending = [r for r in self._pending if r.request_id not in done]
        results = []
        for rid in ids:
            if rid in done:
                results.append(done[rid])
                continue
            seq = self.scheduler.remove(rid, keep_kv=keep_kv)
            if seq is not None:
                results.append(self._result(seq, "interrupt"))
        return results

    # ------------------------------------------------------------ weights and memory
    def named_weights(self) -> Mapping[str, torch.Tensor]:
        if self._weights is WeightState.RELEASED:
            raise RuntimeError(
                "native engine: its weights were released at sleep level 2 and only a load of every weight "
                "brings them back (full_load_targets(), or load_weights with all of them); a partial write such "
                "as a LoRA merge needs engine.weights_cpu_backup")
        return self.model.hf_weights()

    def full_load_targets(self) -> Mapping[str, torch.Tensor]:
        """Released weights get their memory back here, unwritten: the caller writes every one of them
        and then sets `version`, which makes them servable again."""
        if self._weights is WeightState.RELEASED:
            _allocate_parameters(self.model, self._shapes, self.device)
            self._weights = WeightState.LOADING
        return self.model.hf_weights()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self._weights is WeightState.RELEASED:  # only all of them at once bring them back
            _allocate_parameters(self.model, self._shapes, self.device)
            self._weights = WeightState.LOADING
            try:
                self.model.load_hf_weights(named_tensors, strict=True)
            except Exception:
                self._release()
                raise
            self._weights = WeightState.LOADED
        else:
            self.model.load_hf_weights(named_tensors, strict=False)
        self.blocks.reset_prefix_cache()

    @property
    def weights_released(self) -> bool:
        """Asleep at level 2 without a backup, before the full load that brings the weights back."""
        return self._weights is not WeightState.LOADED

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool and the packed copies of the weight matrices (on CPU a second full copy
        of them: the training phase gets that memory). Whatever packs them next (the version set
        after a sync, or the first step after `wake`) packs them again. Level 2 also releases the
        weights (module docstring), or with a backup moves them to host memory."""
        self.scheduler.drop_all_kv()
        self.runner.free_kv()
        self.model.linears.clear()
        if level >= 2 and not self._keeps_weights_asleep:
            self._release()
        elif level >= 2 and self.device.type != "cpu":
            _move_parameters(self.model, torch.device("cpu"))
        self._sleep_level = max(self._sleep_level, level)

    def wake(self) -> None:
        if not self._sleep_level:
            return
        self._check_weights("wake")
        if self._sleep_level >= 2 and self._keeps_weights_asleep and self.device.type != "cpu":
            _move_parameters(self.model, self.device)
        self.runner.allocate_kv()
        self._sleep_level = 0

    def _release(self) -> None:
        for param in self.model.parameters():
            param.data = torch.empty(0, dtype=param.dtype, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._weights = WeightState.RELEASED

    def _check_weights(self, action: str) -> None:
        if self._weights is not WeightState.LOADED:
            raise RuntimeError(
                f"native engine: cannot {action}: its weights were released at sleep level 2 and no full load "
                "(a weight sync of every weight) has brought them back yet")

    def stats(self) -> EngineStats:
        tokens = sum(n for n, _ in self._rate)
        seconds = sum(s for _, s in self._rate)
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting), finished=self._finished_count,
            kv_blocks_used=self.blocks.num_used_blocks, kv_blocks_total=self.blocks.num_blocks,
            decode_tokens_per_s=tokens / seconds if seconds else 0.0,
        )

    # ------------------------------------------------------------ helpers
    def _burst_steps(self, batch: ScheduledBatch) -> int:
        """How many decode steps the batch may run in one compiled call (it ends sooner at a stop token drawn; 1: a
        step as usual). A burst needs every running sequence decoding with the compiled draw (temperature > 0, no
        top-k/top-p), blocks for all its steps, and no sequence reaching its max_new_tokens before its last step; it
        stops at engine.decode_burst steps, so a weight update or an interrupt waits at most that many. Requests
        may wait only for a place among max_num_seqs: no step before a sequence finishes (which ends the burst)
        could admit them, while one waiting for blocks might be admitted by the next step, whose blocks the burst
        would take."""
        if self.decode_burst < 2 or not batch.seqs or self._pending or batch.preempted:
            return 1
        if self.scheduler.waiting and len(self.scheduler.running) < self.scheduler.max_num_seqs:
            return 1
        if len(batch) != len(self.scheduler.running) or not all(n == 1 for n in batch.num_tokens):
            return 1
        params = [seq.params for seq in batch.seqs]
        if not all(p.temperature > 0 and p.top_k == 0 and p.top_p >= 1.0 for p in params):
            return 1
        left = [p.max_new_tokens - seq.num_output_tokens for p, seq in zip(params, batch.seqs)]  # this step's included
        steps = min(self.decode_burst, *left)
        if steps < 2 or not self.model.bursts(len(batch), self.dtype, self.device):
            return 1
        return steps if self.scheduler.reserve_ahead(batch, steps) else 1

    def _run_burst(self, batch: ScheduledBatch, steps: int) -> list[Sequence]:
        """Up to `steps` decode steps of the batch in one call, each row drawn at its own counter
        (`sampler.uniform`), then post-processed step by step; returns the sequences that finished."""
        started = time.perf_counter()
        draws = [[uniform(seq.seed, seq.num_output_tokens + j) for j in range(steps)] for seq in batch.seqs]
        drawn = self.runner.run_burst(batch, steps, draws)
        before = sum(seq.num_output_tokens for seq in batch.seqs)
        finished = self.scheduler.postprocess_burst(batch, drawn, self.version)
        generated = sum(seq.num_output_tokens for seq in batch.seqs) - before
        self.num_computed_tokens += len(drawn) * len(batch)
        self.num_generated_tokens += generated
        self._rate.append((generated, time.perf_counter() - started))
        return finished

    @staticmethod
    def _sample_row(seq: Sequence) -> SampleRow:
        p = seq.params
        return SampleRow(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=seq.seed, index=seq.num_output_tokens)

    @staticmethod
    def _result(seq: Sequence, reason: str) -> GenerationResult:
        return GenerationResult(
            request_id=seq.request_id, prompt_ids=seq.token_ids[:seq.num_prompt_tokens], output_ids=seq.output_ids,
            logprobs=list(seq.logprobs), versions=list(seq.versions), finish_reason=reason,
            state_version=seq.state_version,
        )


def _load_config(folder: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def _build_model(config, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """The model with unwritten `dtype` weights, which the caller loads, every one (`load_hf_weights` is
    strict): built on the meta device and given its storage once, where `_allocate_parameters` puts it (on
    CPU a mapping on huge pages: never a first copy on the heap, which a rank keeps)."""
    with torch.device("meta"):
        model = CausalLM(config)
    model.rotary = Rotary(config, model.spec).to(device)  # RoPE tables built from HF helpers on the CPU
    for param in model.parameters():
        param.data = param.data.to(dtype)
    _allocate_parameters(model, {name: param.shape for name, param in model.named_parameters()}, device)
    return model


def _allocate_parameters(model: CausalLM, shapes: Mapping[str, torch.Size], device: torch.device) -> None:
    """Fresh, unwritten storage of each parameter's full shape (at build, and after `NativeEngine._release`):
    on CPU one mapping per dtype, outside the heap, on huge pages where the kernel gives them
    (host_memory.py); the device's allocator elsewhere."""
    params = dict(model.named_parameters())
    placed = {}
    if device.type == "cpu":
        for dtype in {param.dtype for param in params.values()}:
            placed.update(mapped_tensors({name: tuple(shapes[name]) for name, param in params.items()
                                          if param.dtype == dtype}, dtype))
    for name, param in params.items():
        storage = placed[name] if placed else torch.empty(shapes[name], dtype=param.dtype, device=device)
        if param.device.type == "meta":  # just built: `.data` cannot leave the meta device
            torch.utils.swap_tensors(param, torch.nn.Parameter(storage, requires_grad=param.requires_grad))
        else:
            param.data = storage


def _move_parameters(model: CausalLM, device: torch.device) -> None:
    for param in model.parameters():
        moved = param.data.to(device)
        param.data = moved.pin_memory() if device.type == "cpu" and torch.cuda.is_available() else moved
