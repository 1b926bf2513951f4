"""A stand-in for vLLM 0.32's CUDA build, on CPU, as strict as its CUDA branch, for driving the
CUDA branch of colorl's vLLM adapter (colorl/engines/vllm.py) under the device-placement recorder
(tests/helpers/device_recorder.py).

It is the `vllm` package as far as the adapter reaches into it: `LLM(**engine_args)`, its
`llm_engine` (`add_request`, `step`, `abort_request`, `collective_rpc`, `reset_prefix_cache`), the
in-process `EngineCore` under it (`set_weight_version`, `pause_scheduler`, `resume_scheduler`,
`sleep`, `wake_up`, the scheduler's queues and block pool), `SamplingParams`, `RequestOutputKind`,
`UniProcExecutor` and the request outputs with their weight-version spans; every method and
keyword has the name it has in the wheel (test_vllm_standin.py checks them against its source).
Behind it runs a real tiny Hugging Face model, so a weight update changes what is sampled and
the log-probs are the sampled distribution's. What it enforces as vLLM's CUDA build does
(uniproc_executor.py, gpu_worker.py, device_allocator/sleep_mode_backend.py and cumem.py,
v1/engine/core.py, config/vllm.py):

- device per rank: the executor's `_distributed_args` is the wheel's own (tests/helpers/vllm_wheel.py):
  the device index comes from `device_config.device`, plain "cuda" unless the executor says
  otherwise, so index 0; the worker makes `cuda:<index>` current in the building thread
  (`init_device`) and loads the model there, and every step runs on the stepping thread's current
  device: under the recorder, rank r's engine anywhere but cuda:r fails the run;
- sleep (needs `enable_sleep_mode`): level 1 offloads the weights to host memory and unmaps them,
  level 2 discards them; both drop the KV cache and the prefix cache, and pause the scheduler
  (requests in flight are aborted) until every tag is awake again. A weight load or a forward
  into unmapped weights fails (a CUDA illegal memory access); a level-1 wake maps back what was
  offloaded at sleep; a level-2 wake maps fresh memory that holds no weights (NaN here) until a
  load, and a forward over them fails;
- async scheduling, on unless `async_scheduling=False` (vLLM enables it for any executor that
  supports it, the uniproc one included): a batch queue two deep, so a step hands back the tokens
  of the batch scheduled one step earlier. Loading weights while a queued batch holds tokens of
  live requests fails: they were computed on the old weights and would come back after the update;
- the prefix cache: a prompt whose cached blocks were computed on older weights fails its
  request (colorl must reset the cache after every update); `reset_prefix_cache` refuses (False)
  while requests run.
"""
from __future__ import annotations

import importlib.machinery
import math
import sys
import types
import uuid
import weakref
from collections import defaultdict, deque
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import SimpleNamespace

import torch

import vllm_wheel  # tests/helpers
from colorl.models import load_model

BLOCK_SIZE = 16  # vLLM's CUDA default
NUM_GPU_BLOCKS = 1024
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ENGINE_ARGS = {"model", "dtype", "skip_tokenizer_init", "seed", "logprobs_mode", "max_num_seqs", "max_num_batched_tokens",
               "enable_prefix_caching", "max_model_len", "gpu_memory_utilization", "enable_sleep_mode",
               "distributed_executor_backend", "async_scheduling", "enforce_eager", "enable_chunked_prefill",
               "kv_cache_memory_bytes"}  # the EngineArgs fields colorl sets; the test checks they are the wheel's


# -- vllm.sampling_params, vllm.logprobs, vllm.outputs --------------------------------------------

class RequestOutputKind(Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(kw_only=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class WeightVersionSpan:
    version: str
    start: int
    end: int


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    weight_versions: list[WeightVersionSpan] | None = None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    finished: bool


class VocabParallelEmbedding(torch.nn.Module):
    """vllm.model_executor.layers.vocab_parallel_embedding's: the HF model behind holds none."""


# -- the worker and executor (gpu_worker.py, uniproc_executor.py, executor/abstract.py) -------------

class Worker:
    """One CUDA worker: the model on `cuda:<local_rank>` and vLLM's sleep mode over it."""

    def __init__(self, vllm_config, local_rank: int, rank: int):
        self.config, self.local_rank, self.rank = vllm_config, local_rank, rank
        self.unmapped = 0  # the sleep level whose weights are not mapped (0: mapped)
        self.offloaded: dict[str, torch.Tensor] = {}
        self.generation = 0  # bumped by every change of the weights: the prefix cache is keyed on it

    def init_device(self) -> None:
        self.device = torch.device(f"cuda:{self.local_rank}")
        torch.cuda.set_device(self.device)  # gpu_worker.py: torch.accelerator.set_device_index(self.device)

    def load_model(self) -> None:
        args = self.config.args
        self.model = load_model(Path(args["model"]), DTYPES[args.get("dtype", "float32")]).to(self.device).eval()

    def sleep(self, level: int = 1) -> None:
        """CuMemBackend.suspend: level 1 offloads the "weights" allocations to host memory, level 2
        discards them; either way their device memory is unmapped."""
        params = dict(self.model.named_parameters())
        if level == 1:
            self.offloaded = {name: p.detach().to("cpu", copy=True) for name, p in params.items()}
        with torch.no_grad():
            for p in params.values():
                p.fill_(float("nan"))
        self.unmapped = level

    def wake_up(self, tags: list[str] | None = None) -> None:
        if tags is not None and "weights" not in tags:
            return
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in self.offloaded:
                    p.copy_(self.offloaded[name])
        if not self.offloaded:  # fresh memory: whatever the allocator maps, not the weights
            self.generation += 1
        self.offloaded, self.unmapped = {}, 0

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format: bool = True) -> None:
        self._require_mapped("reload_weights")
        assert is_checkpoint_format and weights_iterator is not None, "colorl hands over checkpoint-format tensors"
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights_iterator:
                params[name].copy_(tensor)  # an unknown name fails, as the model's load_weights does
        self.generation += 1

    def execute(self, requests: list["_Request"]) -> list[tuple["_Request", int, float]]:
        """One token for each request, on this worker's device, from the stepping thread's current stream."""
        self._require_mapped("a forward pass")
        torch.cuda.current_stream()  # the model runner's stream: the thread's current device must be ours
        by_length: dict[int, list[_Request]] = {}  # one forward for the sequences of each length: no padding
        for req in requests:
            by_length.setdefault(len(req.prompt) + len(req.computed), []).append(req)
        sampled = {}
        for same in by_length.values():
            ids = torch.tensor([req.prompt + req.computed for req in same], device=self.device)
            with torch.no_grad():
                logits = self.model(ids).logits[:, -1].float()
            if torch.isnan(logits).any():
                raise RuntimeError("forward over weights that hold no values (woken from sleep level 2 and not "
                                   "loaded since): the engine would serve garbage")
            for req, row in zip(same, logits):
                sampled[id(req)] = _sample(row, req.params, req.generator)
        batch = []
        for req in requests:
            token, logprob = sampled[id(req)]
            req.computed.append(token)
            batch.append((req, token, logprob))
        return batch

    def _require_mapped(self, what: str) -> None:
        if self.unmapped:
            raise RuntimeError(f"CUDA error: an illegal memory access was encountered ({what} touches weights "
                               f"unmapped by sleep level {self.unmapped}; wake_up maps them back)")


class Executor:
    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return False

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.sleeping_tags: set[str] = set()
        self._init_executor()

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    def sleep(self, level: int = 1) -> None:
        if "weights" in self.sleeping_tags:  # "Executor is already sleeping."
            return
        self.collective_rpc("sleep", kwargs=dict(level=level))
        self.sleeping_tags |= {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        if not self.is_sleeping or (tags and any(tag not in self.sleeping_tags for tag in tags)):
            return  # vLLM warns and does nothing
        self.collective_rpc("wake_up", kwargs=dict(tags=tags))
        self.sleeping_tags -= set(tags) if tags else self.sleeping_tags


class UniProcExecutor(Executor):
    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    def _init_executor(self) -> None:
        _, rank, local_rank = self._distributed_args()
        self.driver_worker = Worker(self.vllm_config, local_rank, rank)
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    def _distributed_args(self) -> tuple[str, int, int]:
        return vllm_wheel.distributed_args()(self)  # the wheel's own code

    def collective_rpc(self, method, timeout=None, args: tuple = (), kwargs: dict | None = None,
                       non_block: bool = False, single_value: bool = False):
        worker = self.driver_worker
        result = method(worker, *args, **(kwargs or {})) if callable(method) else getattr(worker, method)(*args, **(kwargs or {}))
        return result if single_value else [result]


# -- the engine core and its scheduler (v1/engine/core.py, v1/core/sched/scheduler.py) ------------

@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    computed: list[int] = field(default_factory=list)  # sampled, handed back or still queued
    finish: tuple[int, str] | None = None  # (tokens, reason) when the computed tokens end the request
    delivered: int = 0
    version_starts: list[tuple[str, int]] = field(default_factory=list)  # output_processor.py's spans
    aborted: bool = False
    external_id: str = ""  # the caller's id; request_id is vLLM's internal one (input_processor.py adds 8 characters)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (request.py): the prompt's, from its first step


class _BlockPool:
    def __init__(self, scheduler: "Scheduler"):
        self.scheduler, self.num_gpu_blocks = scheduler, NUM_GPU_BLOCKS

    def get_num_free_blocks(self) -> int:
        used = sum(math.ceil((len(r.prompt) + len(r.computed)) / BLOCK_SIZE) for r in self.scheduler.running)
        return self.num_gpu_blocks - used


class Scheduler:
    def __init__(self, max_num_seqs: int):
        self.max_num_seqs = max_num_seqs
        self.running: list[_Request] = []
        self.waiting: list[_Request] = []
        self.kv_cache_manager = SimpleNamespace(block_pool=_BlockPool(self))
        self.pause_state = "UNPAUSED"
        self.requests: dict[str, _Request] = {}  # every request it holds, by internal id
        self.cached_blocks: dict[tuple[int, ...], int] = {}  # prompt prefix -> weights generation it was computed on

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        if self.running and not reset_running_requests:
            return False
        self.cached_blocks.clear()
        return True


class EngineCore:
    def __init__(self, args: dict, executor: Executor, async_scheduling: bool):
        self.args, self.model_executor = args, executor
        self.scheduler = Scheduler(args.get("max_num_seqs", 256))
        self.batch_queue_size = 2 if async_scheduling else 1
        self.batch_queue: deque[list] = deque()
        self._weight_version = "default"

    @property
    def worker(self) -> Worker:
        return self.model_executor.driver_worker

    def set_weight_version(self, weight_version: str) -> None:
        self._weight_version = weight_version

    def get_weight_version(self) -> str:
        return self._weight_version

    def add(self, req: _Request) -> None:
        self.scheduler.waiting.append(req)
        self.scheduler.requests[req.request_id] = req

    def step(self) -> list[RequestOutput]:
        """step() / step_with_batch_queue(): schedule and run a batch; hand back the oldest queued one."""
        scheduler = self.scheduler
        if self.model_executor.is_sleeping or scheduler.pause_state != "UNPAUSED":
            raise RuntimeError(f"step while the scheduler is paused ({'asleep' if self.model_executor.is_sleeping else scheduler.pause_state}): "
                               f"no request would advance")
        while scheduler.waiting and len(scheduler.running) < scheduler.max_num_seqs:
            req = scheduler.waiting.pop(0)
            self._prefill_from_cache(req)
            scheduler.running.append(req)
        ready = [r for r in scheduler.running if r.finish is None]
        if ready:
            batch = self.worker.execute(ready)
            for req in ready:
                req.finish = _finish(req, self.args)
                req.num_computed_tokens = len(req.prompt) + len(req.computed) - 1  # the newest token's KV is next step's
            self.batch_queue.appendleft(batch)
            if len(self.batch_queue) < self.batch_queue_size:
                return []
        elif not self.batch_queue:
            return []
        return self._outputs(self.batch_queue.pop())

    def _prefill_from_cache(self, req: _Request) -> None:
        if not self.args.get("enable_prefix_caching", True):
            return
        generation, cache = self.worker.generation, self.scheduler.cached_blocks
        for end in range(BLOCK_SIZE, len(req.prompt) + 1, BLOCK_SIZE):
            prefix = tuple(req.prompt[:end])
            if cache.get(prefix, generation) != generation:
                raise RuntimeError(f"request {req.request_id}: its prompt's first {end} tokens would be served from "
                                   f"prefix-cache KV computed on older weights (the cache was not reset after a weight update)")
            cache[prefix] = generation

    def _outputs(self, batch: list[tuple[_Request, int, float]]) -> list[RequestOutput]:
        """update_from_output + the output processor: deltas stamped with the version current now."""
        outputs = []
        for req, token, logprob in batch:
            if req.aborted:
                continue
            starts = req.version_starts
            if not starts or starts[-1][0] != self._weight_version:
                starts.append((self._weight_version, req.delivered))
            req.delivered += 1
            done = req.finish is not None and req.finish[0] == req.delivered
            spans = None
            if done:
                self.scheduler.running.remove(req)
                self.scheduler.requests.pop(req.request_id, None)
                ends = [start for _, start in starts[1:]] + [req.delivered]
                spans = [WeightVersionSpan(v, s, e) for (v, s), e in zip(starts, ends)]
            completion = CompletionOutput(0, "", [token], None, [{token: Logprob(logprob, 1)}],
                                          req.finish[1] if done else None, spans)
            outputs.append(RequestOutput(req.external_id or req.request_id, [completion], done))
        return outputs

    def abort_requests(self, request_ids: list[str]) -> None:
        for queue in (self.scheduler.running, self.scheduler.waiting):
            for req in [r for r in queue if r.request_id in request_ids]:
                req.aborted = True
                queue.remove(req)
                self.scheduler.requests.pop(req.request_id, None)

    def collective_rpc(self, method, timeout=None, args: tuple = (), kwargs: dict | None = None):
        if method == "reload_weights":
            stale = {req.request_id for batch in self.batch_queue for req, _, _ in batch if not req.aborted}
            if stale:
                raise RuntimeError(f"weights loaded while the batch queue (async scheduling) holds tokens of "
                                   f"{sorted(stale)} computed on the old weights: they would come back after the update")
        return self.model_executor.collective_rpc(method, timeout, args, kwargs)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return self.scheduler.reset_prefix_cache(reset_running_requests, reset_connector)

    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True):
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"Invalid pause mode: {mode}")
        if mode == "wait":
            raise ValueError("'wait' mode can't be used in inproc-engine mode")
        if mode == "abort":
            self.abort_requests([r.request_id for r in self.scheduler.running + self.scheduler.waiting])
            self.batch_queue.clear()
        self.scheduler.pause_state = "PAUSED_ALL" if mode == "keep" else "PAUSED_NEW"
        if clear_cache and not self.reset_prefix_cache(reset_running_requests=True, reset_connector=True):
            raise RuntimeError("Failed to reset the KV connector cache.")
        return None

    def resume_scheduler(self) -> None:
        self.scheduler.pause_state = "UNPAUSED"

    def sleep(self, level: int = 1, mode: str = "abort"):
        if not self.args.get("enable_sleep_mode"):
            raise RuntimeError("sleep without enable_sleep_mode: no allocation is tagged, nothing would be released")
        self.pause_scheduler(mode=mode, clear_cache=level >= 1)
        if level >= 1:
            self.model_executor.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        if tags is not None and "scheduling" in tags:
            tags = [t for t in tags if t != "scheduling"]
        if tags is None or tags:
            self.model_executor.wake_up(tags)
        fully_awake = not self.model_executor.is_sleeping
        if fully_awake:
            self.resume_scheduler()
        return fully_awake

    def shutdown(self) -> None:
        self.batch_queue.clear()


class InprocClient:
    def __init__(self, engine_core: EngineCore):
        self.engine_core = engine_core
        self._finalizer = weakref.finalize(self, lambda: None)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class LLMEngine:
    def __init__(self, core: EngineCore):
        self.engine_core = InprocClient(core)
        self._seed = core.args.get("seed", 0)
        self.output_processor = SimpleNamespace(external_req_ids=defaultdict(list))  # output_processor.py's map

    @property
    def _core(self) -> EngineCore:
        return self.engine_core.engine_core

    def add_request(self, request_id: str, prompt, params: SamplingParams, arrival_time=None, lora_request=None,
                    tokenization_kwargs=None, trace_headers=None, priority: int = 0) -> None:
        assert params.output_kind is RequestOutputKind.DELTA and params.logprobs == 0, "colorl streams deltas with one log-prob"
        seed = params.seed if params.seed is not None else self._seed
        internal_id = f"{request_id}-{uuid.uuid4().hex[:8]}"  # input_processor.py: uniqueness by a random suffix
        self.output_processor.external_req_ids[request_id].append(internal_id)
        self._core.add(_Request(internal_id, list(prompt["prompt_token_ids"]), params,
                                torch.Generator().manual_seed(seed), external_id=request_id))

    def step(self) -> list[RequestOutput]:
        outputs = self._core.step()
        for output in outputs:
            if output.finished:
                self.output_processor.external_req_ids.pop(output.request_id, None)
        return outputs

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        """External ids abort every internal request made for them (output_processor.abort_requests)."""
        mapped = self.output_processor.external_req_ids
        self._core.abort_requests(list(request_ids) if internal else
                                  [i for rid in request_ids for i in mapped.pop(rid, [])])

    def collective_rpc(self, method, timeout=None, args: tuple = (), kwargs: dict | None = None):
        return self._core.collective_rpc(method, timeout, args, kwargs)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return self._core.reset_prefix_cache(reset_running_requests, reset_connector)

    def apply_model(self, func):
        return self.collective_rpc(lambda worker: func(worker.model))


class LLM:
    instances: list["LLM"] = []

    def __init__(self, **kwargs):
        unknown = set(kwargs) - ENGINE_ARGS
        if unknown:
            raise TypeError(f"EngineArgs.__init__() got unexpected keyword arguments {sorted(unknown)}")
        assert kwargs.get("logprobs_mode") == "processed_logprobs", "colorl's behaviour log-probs"
        backend = kwargs.get("distributed_executor_backend")
        if backend in (None, "uni"):
            executor_class = UniProcExecutor
        elif isinstance(backend, type) and issubclass(backend, Executor):
            executor_class = backend
        else:
            raise ValueError(f"distributed_executor_backend={backend!r}: the stand-in plays the in-process executor only")
        async_scheduling = kwargs.get("async_scheduling")
        if async_scheduling is None:  # config/vllm.py: on for any executor that supports it
            async_scheduling = executor_class.supports_async_scheduling()
        elif async_scheduling and not executor_class.supports_async_scheduling():
            raise ValueError(f"`{backend}` does not support async scheduling yet.")
        config = SimpleNamespace(args=kwargs, device_config=SimpleNamespace(device=torch.device("cuda")))
        self.llm_engine = LLMEngine(EngineCore(kwargs, executor_class(config), async_scheduling))
        LLM.instances.append(self)

    @property
    def _core(self) -> EngineCore:
        return self.llm_engine._core

    def collective_rpc(self, method, timeout=None, args: tuple = (), kwargs: dict | None = None):
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func):
        return self.llm_engine.apply_model(func)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return self.llm_engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def sleep(self, level: int = 1, mode: str = "abort"):
        self._core.sleep(level=level, mode=mode)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        return self._core.wake_up(tags)


def _sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """The sampled token and its log-prob under the distribution it was sampled from (processed_logprobs)."""
    if params.temperature < 1e-5:  # greedy
        logprobs = torch.log_softmax(logits, -1)
        token = int(logprobs.argmax())
        return token, float(logprobs[token])
    scaled = logits / params.temperature
    if params.top_k > 0:
        scaled[scaled < scaled.topk(min(params.top_k, scaled.numel())).values[-1]] = -float("inf")
    if params.top_p < 1.0:
        ordered, order = scaled.sort(descending=True)
        beyond = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1) > params.top_p
        scaled[order[beyond]] = -float("inf")
    logprobs = torch.log_softmax(scaled, -1)
    token = int(torch.multinomial(logprobs.exp(), 1, generator=generator))
    return token, float(logprobs[token])


def _finish(req: _Request, args: dict) -> tuple[int, str] | None:
    """Whether the tokens computed so far end the request (stop id, max_tokens, max_model_len)."""
    count = len(req.computed)
    if req.computed[-1] in (req.params.stop_token_ids or ()):
        return count, "stop"
    if count >= req.params.max_tokens or len(req.prompt) + count >= args.get("max_model_len", 1 << 30):
        return count, "length"
    return None


def install(monkeypatch) -> None:
    """Put the stand-in where `import vllm` and the adapter's imports of its submodules find it (and
    where `importlib.util.find_spec("vllm")`, which config validation asks, does). Needs the wheel."""
    vllm_wheel.distributed_args()
    modules = {
        "vllm": {"LLM": LLM, "SamplingParams": SamplingParams, "__version__": vllm_wheel.VLLM_VERSION},
        "vllm.sampling_params": {"SamplingParams": SamplingParams, "RequestOutputKind": RequestOutputKind},
        "vllm.outputs": {"RequestOutput": RequestOutput, "CompletionOutput": CompletionOutput,
                         "WeightVersionSpan": WeightVersionSpan},
        "vllm.v1": {}, "vllm.v1.executor": {},
        "vllm.v1.executor.uniproc_executor": {"UniProcExecutor": UniProcExecutor},
        "vllm.model_executor": {}, "vllm.model_executor.layers": {},
        "vllm.model_executor.layers.vocab_parallel_embedding": {"VocabParallelEmbedding": VocabParallelEmbedding},
    }
    for name, members in modules.items():
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        vars(module).update(members)
        monkeypatch.setitem(sys.modules, name, module)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    LLM.instances.clear()
