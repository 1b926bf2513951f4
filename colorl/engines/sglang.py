"""SGLang backend (CUDA only): an in-process `sglang.Engine` per rank behind colorl's `Engine`.

Written against the source of the pinned release, `SGLANG_VERSION` (tests/engines/
test_sglang_contract.py checks every name used here against that wheel). How colorl's verbs map:

    add / step     `async_generate(input_ids=..., return_logprob=True, stream=True, rid=...)` per
                   request on the engine's own event loop; one `step()` runs that loop until at
                   least one stream has a new chunk. Chunks are cumulative (SGLang's default
                   streaming), so a request's final chunk holds all its ids and log-probs.
    log-probs      `meta_info["output_token_logprobs"]`: (logprob, token id, text) per output token,
                   taken by SGLang from the temperature-scaled distribution it sampled from (the
                   same quantity as the native engine's), unless SGLANG_RETURN_ORIGINAL_LOGPROB
                   is set, which this adapter refuses.
    versions       SGLang records a weight-version change for every live request and returns
                   `meta_info["weight_versions"]`, spans {version, start, end} over the output
                   tokens; colorl's version v is SGLang's weight version str(v).
    weight sync    the checkpoint engine calls `load_weights` once per bucket, then sets
                   `version`. The first bucket opens the update (pause generation in place if
                   requests are in flight, `begin_weight_update`); each bucket is one
                   `update_weights_from_tensor(..., flush_cache=False)`; setting `version`
                   closes it (`end_weight_update`, the radix cache flushed once when idle,
                   `update_weight_version`, `continue_generation`).
    sleep / wake   `release_memory_occupation` / `resume_memory_occupation` with tags: KV cache at
                   level 1; KV cache, weights and CUDA graphs at level 2 (weights come back with
                   the next sync, which must happen before `wake`; with LoRA a sync re-sends only
                   the adapted matrices, so `engine.weights_cpu_backup` — SGLang's
                   `enable_weights_cpu_backup` — keeps a host copy of the rest).
    abort          `tokenizer_manager.abort_request(rid=...)`; the stream then ends with a chunk
                   whose finish reason is "abort", carrying the tokens generated so far, which
                   `interrupt` hands back.

Versions stay honest in bounded-lag (`engine.in_flight_updates`): in-flight updates keep each
running request's KV cache (PipelineRL style, pause mode "in_place", which sets a flag and leaves
the scheduler's state as it is); SGLang flushes its radix cache only when fully idle, which in
bounded-lag may never happen, so the radix cache is off there (no request starts from prompt KV
of an older version); and the overlap scheduler is off too, since an in-place pause leaves an
already-launched batch's result queued, and its token, computed on the old weights, would be
counted after the version change. Colocated mode syncs when idle: both stay on, and the cache
is flushed after every update. So no request reads KV computed before it was added; but SGLang's
weight-version spans cover output tokens only (its scheduler records a version change only for
requests that have some), and a prompt prefilled in chunks across an update is not told apart
from one prefilled after it: a request's state version is the version in force when it was added
(`carried_state_version` with the admission version: the oldest its prompt's KV can have, never newer than the truth). `stats()` counts KV
blocks from the lengths of the requests in flight (`engine.block_size` tokens a block) against
SGLang's pool size; SGLang's own allocator is not queried per step.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch

from colorl.engines.base import Engine, EngineStats, GenerationRequest, GenerationResult, carried_state_version

SGLANG_VERSION = "0.5.23"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# fa3 (Hopper) and flashinfer, SGLang's CUDA defaults, take fp16/bf16 only; torch_native (SDPA)
# takes float32 too, slowly: float32 serving is for exactness checks, bf16 for training runs
ATTENTION_BACKENDS = {torch.float32: "torch_native"}
RELEASE_TAGS = {1: ("kv_cache",), 2: ("kv_cache", "weights", "cuda_graph")}
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
VERIFY_ROWS = 64  # rows of each weight read back for the check after a sync
# the Llama and Qwen2 models' `stacked_params_mapping`: HF name part -> (SGLang's fused one, shard position)
STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
HOST_SIGNALS = (signal.SIGTERM, signal.SIGQUIT)


@contextlib.contextmanager
def _without_torchelastic_env():
    """SGLang's scheduler is a child process that inherits this environment; under torchrun it
    would find TORCHELASTIC_USE_AGENT_STORE and its own init_process_group would wait on an agent
    store nobody serves. The child starts without torchelastic's variables; this process keeps them."""
    saved = {key: os.environ.pop(key) for key in list(os.environ) if key.startswith("TORCHELASTIC_")}
    try:
        yield
    finally:
        os.environ.update(saved)


def unavailable_reason() -> str | None:
    """Why an SGLang engine cannot start on this machine, or None when it can."""
    if not torch.cuda.is_available():
        return "rollout.engine=sglang needs a CUDA device and none is available here"
    if importlib.util.find_spec("sglang") is None:
        return (f"rollout.engine=sglang: the sglang package is not installed "
                f"(pip install 'colorl[sglang]', which pins sglang=={SGLANG_VERSION})")
    return None


@dataclass
class _Live:
    """One request in flight: its stream and the read of its next chunk."""

    request: GenerationRequest
    stream: object  # the async iterator `async_generate(stream=True)` returned
    next: asyncio.Future
    oldest_version: int  # the version in force when it was added (fallback stamp, and its state version)
    tokens: int = 0  # output tokens seen so far
    interrupted: bool = False


async def _next_chunk(stream) -> dict | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


@dataclass
class _Throughput:
    tokens: int = 0
    seconds: float = 0.0
    finished: int = 0


class SGLangEngine(Engine):
    """`engine_cfg`: colorl's EngineConfig (memory_fraction -> mem_fraction_static, max_num_seqs ->
    max_running_requests). `device`: the rank's CUDA device."""

    keeps_kv_across_updates = True  # in-flight updates pause "in_place": running requests keep their KV
    # sglang.Engine sets these unless set (_set_envs_and_config): no NVLink SHARP buffers, no cuMem
    # allocations in NCCL, for the trainer's communicators too, whichever NCCL call comes first
    process_env = {"NCCL_NVLS_ENABLE": "0", "NCCL_CUMEM_ENABLE": "0"}

    def __init__(self, model_dir: Path | str, engine_cfg, device: str = "cuda", dtype: torch.dtype = torch.float32):
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes"):
            raise ValueError("SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would return log-probs "
                             "before temperature scaling, not those of the distribution it sampled from")
        import sglang
        from sglang.srt.managers import io_struct
        from transformers import AutoConfig

        from colorl.models import meta_model

        self._io = io_struct
        self._device = torch.device(device)  # where SGLang's weights are: checksums hash there
        self._reads_back: bool | None = None  # whether get_weights_by_name answers for this model family
        self._version = 0
        self._block_size = engine_cfg.block_size
        gpu = torch.cuda.current_device() if torch.device(device).type == "cuda" else 0
        self._host_handlers = {sig: signal.getsignal(sig) for sig in HOST_SIGNALS}
        with _without_torchelastic_env():
            self._engine = sglang.Engine(
                model_path=str(model_dir), dtype=DTYPE_NAMES[dtype], skip_tokenizer_init=True,
                attention_backend=ATTENTION_BACKENDS.get(dtype),
                mem_fraction_static=engine_cfg.memory_fraction, max_running_requests=engine_cfg.max_num_seqs,
                enable_memory_saver=True, base_gpu_id=gpu, weight_version=str(self._version), log_level="error",
                # without it a level-2 release discards the weights, and a LoRA sync restores only its targets
                enable_weights_cpu_backup=engine_cfg.weights_cpu_backup,
                # bounded-lag: the radix cache could not be flushed (SGLang flushes only when idle) and
                # an overlapped batch could finish a token on the old weights after an in-place pause
                disable_radix_cache=engine_cfg.in_flight_updates,
                disable_overlap_schedule=engine_cfg.in_flight_updates,
            )
        self._loop = self._engine.loop
        self._tm = self._engine.tokenizer_manager
        self._kv_tokens_total = int(self._engine.get_server_info()["max_total_num_tokens"])
        self._keep_host_signal_handlers()  # get_server_info was the tokenizer manager's first call
        model = meta_model(AutoConfig.from_pretrained(model_dir), dtype)
        self._weights = dict(model.named_parameters())
        self._live: dict[str, _Live] = {}
        self._released: set[str] = set()
        self._updating = False
        self._paused = False
        self._rate = _Throughput()

    # -- requests --------------------------------------------------------------------------------

    def add(self, request: GenerationRequest) -> None:
        # loads that set no version (the checkpoint engine's start-up load of LoRA base weights)
        # leave the update open until here
        self._close_session()
        self._resume()
        p = request.params
        params = {"temperature": p.temperature, "top_p": p.top_p, "ignore_eos": p.ignore_eos,
                  "max_new_tokens": p.max_new_tokens - len(request.output_ids),
                  "stop_token_ids": list(p.stop_token_ids)}
        if p.top_k > 0:
            params["top_k"] = p.top_k
        if p.seed is not None:  # SGLang uses it only with enable_deterministic_inference
            params["sampling_seed"] = p.seed
        stream = self._loop.run_until_complete(self._engine.async_generate(
            input_ids=list(request.prompt_ids) + list(request.output_ids), sampling_params=params,
            return_logprob=True, stream=True, rid=request.request_id))
        self._live[request.request_id] = _Live(request, stream, self._arm(stream), self._version)

    def _keep_host_signal_handlers(self) -> None:
        """SGLang's tokenizer manager puts its own SIGTERM/SIGQUIT handlers on the event loop at its
        first call (`auto_create_handle_loop`, main thread only; `get_server_info` at start is the
        first), and the engine's start sets SIGQUIT with signal.signal: give the process's own
        handlers back. colorl's SIGTERM saves a checkpoint at the step boundary; SIGQUIT (which a
        failing SGLang child sends its parent) keeps its default action and ends the rank, which
        the launcher reports, instead of waiting on a scheduler that is gone."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._host_handlers.items():
            self._loop.remove_signal_handler(sig)
            if signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)

    def _arm(self, stream) -> asyncio.Future:
        return asyncio.ensure_future(_next_chunk(stream), loop=self._loop)

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def step(self) -> list[GenerationResult]:
        """Run the engine's loop until some stream has a new chunk; return the requests that finished."""
        return self._advance(list(self._live.values()))

    def _advance(self, lives: list[_Live]) -> list[GenerationResult]:
        if not lives:
            return []
        start = time.perf_counter()
        self._loop.run_until_complete(asyncio.wait([live.next for live in lives],
                                                   return_when=asyncio.FIRST_COMPLETED))
        finished, new_tokens = [], 0
        for live in lives:
            if not live.next.done():
                continue
            chunk = live.next.result()
            if chunk is None or chunk["meta_info"]["finish_reason"] is not None:
                finished.append(self._finish(live, chunk))
                continue
            new_tokens += len(chunk["output_ids"]) - live.tokens
            live.tokens = len(chunk["output_ids"])
            live.next = self._arm(live.stream)
        self._rate.tokens += new_tokens
        self._rate.seconds += time.perf_counter() - start
        return finished

    def _finish(self, live: _Live, chunk: dict | None) -> GenerationResult:
        rid = live.request.request_id
        del self._live[rid]
        self._rate.finished += 1
        if chunk is None:
            raise RuntimeError(f"sglang: the stream of request {rid} ended without a finished chunk")
        meta = chunk["meta_info"]
        ids = list(chunk["output_ids"])
        logprobs = [float(entry[0]) for entry in meta["output_token_logprobs"]]
        if len(logprobs) != len(ids):
            raise RuntimeError(f"sglang: request {rid} returned {len(ids)} tokens but {len(logprobs)} log-probs")
        reason = FINISH_REASONS[meta["finish_reason"]["type"]]
        if reason == "abort" and live.interrupted:
            reason = "interrupt"
        req = live.request
        return GenerationResult(rid, list(req.prompt_ids), list(req.output_ids) + ids,
                                list(req.output_logprobs) + logprobs,
                                list(req.output_versions) + _versions(meta, len(ids), live.oldest_version), reason,
                                state_version=carried_state_version(req, live.oldest_version, bool(ids)))

    def abort(self, request_ids: Iterable[str]) -> None:
        self.interrupt(request_ids)

    def interrupt(self, request_ids: Iterable[str], keep_kv: bool = False) -> list[GenerationResult]:
        """Abort in SGLang and wait for each stream's last chunk: the tokens generated so far
        (finish reason "interrupt"; a request that finished before the abort reached the scheduler
        comes back finished, with its own reason, and must not be resumed).

        keep_kv: SGLang frees an aborted request's KV slots (its scheduler's abort path); what it
        keeps is in the radix cache, which serves the re-added request's prefix if nothing has
        flushed or evicted it since. There is no stronger promise to give."""
        stopping = [self._live[rid] for rid in list(request_ids) if rid in self._live]
        results: list[GenerationResult] = []
        for live in stopping:
            live.interrupted = True
            rid = live.request.request_id
            state = self._tm.rid_to_state.get(rid)
            if (state is None or not state.dispatched) and live.tokens == 0 and not live.next.done():
                # its scheduler has not received it (its stream was never advanced, or it waits for
                # the dispatch): an abort would be lost there and the request would run to its end.
                # Cancelled, the stream drops it before dispatch (generate_request's failure path)
                live.next.cancel()
                self._run(asyncio.gather(live.next, return_exceptions=True))
                del self._live[rid]
                req = live.request
                results.append(GenerationResult(rid, list(req.prompt_ids), list(req.output_ids),
                                                list(req.output_logprobs), list(req.output_versions), "interrupt",
                                                state_version=req.state_version))
                continue
            self._tm.abort_request(rid=rid)
        while pending := [live for live in stopping if live.request.request_id in self._live]:
            results.extend(self._advance(pending))
        return results

    # -- weights ---------------------------------------------------------------------------------

    def named_weights(self) -> Mapping[str, torch.Tensor]:
        """Meta tensors with SGLang's checkpoint names (those of the HF model): only whole tensors
        can be loaded, through `update_weights_from_tensor`."""
        return self._weights

    def compare_weights(self, expected: Mapping[str, torch.Tensor]):
        """The bit-exact check after a sync (colorl/sync/verify.py), against SGLang's own weights:
        row prefixes read back through `get_weights_by_name` where its model class offers it (the
        Llama family), else SGLang's weight checksums (`check_weights`, e.g. Qwen2 in 0.5.23)."""
        from colorl.sync.verify import compare

        if self._reads_back is None:
            first = next(iter(self._weights))
            self._reads_back = self._engine.get_weights_by_name(first, truncate_size=1) is not None
        return compare(self.read_weights(), expected) if self._reads_back else self._compare_checksums(expected)

    def read_weights(self, rows: int = VERIFY_ROWS) -> dict[str, torch.Tensor]:
        """The first `rows` rows of every weight as SGLang serves them (`get_weights_by_name`, which
        returns float32 lists: exact for bf16/fp16 weights). Only row prefixes are practical: it
        returns Python lists."""
        served = {}
        for name, meta in self._weights.items():
            values = self._engine.get_weights_by_name(name, truncate_size=rows)
            if values is None:
                raise RuntimeError(f"sglang get_weights_by_name({name!r}) gave nothing: this model family "
                                   f"cannot be read back from SGLang {SGLANG_VERSION}")
            served[name] = torch.tensor(values, dtype=torch.float32).to(meta.dtype)
        return served

    def _compare_checksums(self, expected: Mapping[str, torch.Tensor]):
        """SGLang's weight checker hashes every parameter of its model (`tensor_hash`: on CUDA a Triton
        kernel over the bytes, on the host sha256) in its fused layout: the expected weights are fused
        the same way (`STACKED`) and hashed with the same function on the same device."""
        from sglang.srt.managers.mm_utils import tensor_hash

        from colorl.sync.verify import Comparison

        ok, message, ranks, _ = self._run(self._tm.check_weights(self._io.CheckWeightsReqInput(action="checksum"), None))
        if not ok:
            raise RuntimeError(f"sglang check_weights failed: {message}")
        served = ranks[0]["checksums"]  # tensor-parallel size 1: one rank
        fused = _fused(expected)
        return Comparison(differing=[name for name, tensor in fused.items()
                                     if served.get(name) != f"{tensor_hash(tensor.to(self._device)):016x}"])

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One bucket of (HF name, full tensor); the first of a sync opens the update."""
        pairs = list(named_tensors)
        if not pairs:
            return
        if not self._updating:
            self._begin_update()
        ok, message = self._engine.update_weights_from_tensor(named_tensors=pairs, flush_cache=False)
        if not ok:
            raise RuntimeError(f"sglang update_weights_from_tensor failed: {message}")

    def _begin_update(self) -> None:
        if "weights" in self._released:  # sleep level 2: the weights' memory comes back for the load
            self._engine.resume_memory_occupation(tags=["weights"])
            self._released.discard("weights")
        if self._live:
            self._run(self._tm.pause_generation(self._io.PauseGenerationReqInput(mode="in_place")))
            self._paused = True
        ok, message = self._engine.begin_weight_update()
        if not ok:
            raise RuntimeError(f"sglang begin_weight_update failed: {message}")
        self._updating = True

    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        """The checkpoint engine sets the version after the last bucket: close the update there."""
        self._close_session()
        if value != self._version:
            self._run(self._tm.update_weight_version(
                self._io.UpdateWeightVersionReqInput(new_version=str(value), abort_all_requests=False)))
        self._version = value
        self._resume()

    def _close_session(self) -> None:
        if self._updating:
            ok, message = self._engine.end_weight_update()
            if not ok:
                raise RuntimeError(f"sglang end_weight_update failed: {message}")
            self._updating = False
            if not self._live and "kv_cache" not in self._released:
                self._engine.flush_cache()  # prefixes cached under the old weights

    def _resume(self) -> None:
        if self._paused:
            self._run(self._tm.continue_generation(self._io.ContinueGenerationReqInput()))
            self._paused = False

    def _run(self, coroutine):
        return self._loop.run_until_complete(coroutine)

    # -- memory ----------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        if self._live:
            raise RuntimeError(f"sglang engine: sleep with {len(self._live)} requests in flight")
        tags = [tag for tag in RELEASE_TAGS[level] if tag not in self._released]
        if tags:
            self._engine.release_memory_occupation(tags=tags)
            self._released.update(tags)

    def wake(self) -> None:
        if "weights" in self._released:
            raise RuntimeError("sglang engine: woken at sleep level 2 before a weight sync reloaded its weights")
        if self._released:
            self._engine.resume_memory_occupation(tags=sorted(self._released))
            self._released.clear()

    def stats(self) -> EngineStats:
        blocks = sum(-(-(len(l.request.prompt_ids) + len(l.request.output_ids) + l.tokens) // self._block_size)
                     for l in self._live.values())
        rate = self._rate.tokens / self._rate.seconds if self._rate.seconds else 0.0
        return EngineStats(running=len(self._live), waiting=0, finished=self._rate.finished,
                           kv_blocks_used=blocks, kv_blocks_total=self._kv_tokens_total // self._block_size,
                           decode_tokens_per_s=rate)

    def shutdown(self) -> None:
        self._engine.shutdown()


def _fused(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named weights in SGLang's layout: q/k/v and gate/up concatenated in shard order (`STACKED`)."""
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in weights.items():
        module, _, kind = name.rpartition(".")
        head, _, leaf = module.rpartition(".")
        fused, position = STACKED.get(leaf, (leaf, 0))
        shards.setdefault(f"{head}.{fused}.{kind}", {})[position] = tensor
    return {name: torch.cat([parts[i] for i in sorted(parts)]) for name, parts in shards.items()}


def _versions(meta: Mapping, count: int, fallback: int) -> list[int]:
    """Per-token versions from SGLang's weight-version spans. Without spans (a reply that
    carries none) every token gets the oldest version in force while the request lived, so a
    trajectory's staleness is never understated."""
    spans = meta.get("weight_versions")
    if not spans:
        return [fallback] * count
    versions = [fallback] * count
    for span in spans:
        for i in range(span["start"], min(span["end"], count)):
            versions[i] = int(span["version"])
    return versions
