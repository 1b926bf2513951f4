"""A recording stand-in for the `sglang` package, on CPU, for driving colorl's SGLang adapter.

It speaks sglang==0.5.23's call signatures and result format: every method and keyword here has
the name it has in that wheel (test_sglang_contract.py checks this file's signatures against the
wheel's source), and the chunks have the wheel's shape: cumulative `output_ids`, `meta_info` with
`finish_reason` ({"type": "stop"|"length"|"abort", ...} or None), `completion_tokens`,
`output_token_logprobs` [(logprob, token id, None)] and, on the last chunk, `weight_versions`
spans. Behind it runs a real tiny Hugging Face model, so a weight update changes what is sampled
and the log-probs can be checked against the model. Semantics it enforces like SGLang does:
`update_weights_from_tensor` only inside begin/end_weight_update and, with requests in flight,
only while generation is paused; releasing memory only when idle; released weights lose their
contents (NaN) until loaded again unless `enable_weights_cpu_backup`; no generation while the KV
cache is released; its scheduler child hangs (here: fails at start) when it inherits torchrun's
`TORCHELASTIC_USE_AGENT_STORE`; the tokenizer manager's first call (`get_server_info` at start, else
the first request) installs SIGTERM and SIGQUIT handlers on the event loop from the main thread
(`auto_create_handle_loop`); an abort reaches the scheduler only once it has the request (one sent
while the request waits for its dispatch is lost, and it runs to its end), and a request the
scheduler's step in flight finishes comes back finished in an interrupt's reply.

Two things come from the wheel itself (tests/helpers/sglang_wheel.py reads its source):
- tensors reach the "scheduler" as they do in SGLang: one `MultiprocessingSerializer` payload per TP
  rank (torch's ForkingPickler), loaded back with SGLang's `SafeUnpickler`, whose allow-list refuses
  what the real scheduler would (a DTensor, a tensor that requires grad, any other global);
- the device is simulated (`SimulatedDevice`): memory the engine releases, and the unsharded model
  the trainer loaded before sharding it, are held by the trainer's caching allocator until colorl
  hands them back (the engine refuses to start before that) (`colorl.distributed.release_cached_device_memory`,
  which `install` wraps), and a `resume_memory_occupation` that does not fit fails with an
  out-of-memory error, as torch_memory_saver's re-mapping does in SGLang's scheduler.
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch

import sglang_wheel  # tests/helpers
from colorl import distributed
from colorl.models import load_model

NCCL_SETTINGS = ("NCCL_NVLS_ENABLE", "NCCL_CUMEM_ENABLE")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# prompt tokens the scheduler prefills per loop turn (SGLang's `chunked_prefill_size`, which it sizes by
# GPU memory: thousands of tokens); the first token is sampled with the last chunk
CHUNKED_PREFILL_SIZE = 2048


# -- sglang.srt.managers.io_struct (field names and defaults as in the wheel) --------------------

@dataclass(kw_only=True)
class PauseGenerationReqInput:
    mode: str = "abort"


@dataclass(kw_only=True)
class ContinueGenerationReqInput:
    torch_empty_cache: bool = True


@dataclass(kw_only=True)
class UpdateWeightVersionReqInput:
    new_version: str
    abort_all_requests: bool = True


@dataclass(kw_only=True)
class CheckWeightsReqInput:
    action: str = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: list | None = None
    selector: str = "all"


# SGLang's fused layout of the Llama and Qwen2 families (their `stacked_params_mapping`): HF name part ->
# (SGLang's, shard position); the weight checker hashes the fused tensors
STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
READ_BACK_FAMILIES = ("llama",)  # model types whose SGLang model class has get_weights_by_name (not Qwen2)


def sglang_layout(model) -> dict[str, torch.Tensor]:
    """The model's parameters as SGLang's model holds them: q/k/v and gate/up fused."""
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for name, p in model.named_parameters():
        module, _, kind = name.rpartition(".")
        head, _, leaf = module.rpartition(".")
        fused, position = STACKED.get(leaf, (leaf, 0))
        shards.setdefault(f"{head}.{fused}.{kind}", {})[position] = p.detach()
    return {name: torch.cat([parts[i] for i in sorted(parts)]) for name, parts in shards.items()}


@dataclass(kw_only=True)
class FlushCacheReqOutput:
    success: bool
    message: str = ""


class SimulatedDevice:
    """One device shared by the trainer (this process's caching allocator) and SGLang's scheduler
    (another process, which can only map memory the allocator has returned)."""

    TOTAL = 1 << 30
    CUDA_GRAPH_BYTES = 1 << 20

    def __init__(self):
        self.engine_held: dict[str, int] = {}  # tag -> bytes mapped by the engine
        self.trainer_cached = 0  # bytes the trainer's allocator keeps reserved after use
        self.hand_offs = 0

    def free(self) -> int:
        return self.TOTAL - sum(self.engine_held.values()) - self.trainer_cached

    def map(self, tag: str, size: int) -> None:
        if size > self.free():
            raise RuntimeError(f"CUDA out of memory: resume_memory_occupation({tag!r}) needs {size} bytes, "
                               f"{self.free()} free ({self.trainer_cached} still reserved by the trainer's caching "
                               f"allocator: empty its cache before waking the engine)")
        self.engine_held[tag] = size

    def unmap(self, tag: str) -> None:
        self.engine_held.pop(tag, None)
        self.trainer_cached = self.TOTAL - sum(self.engine_held.values())  # the trainer runs next and fills it

    def hand_off(self) -> None:
        self.trainer_cached = 0
        self.hand_offs += 1


DEVICE = SimulatedDevice()


@dataclass
class _Req:
    rid: str
    input_ids: list[int]
    params: dict
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    events: list[tuple[str, int]] = field(default_factory=list)  # (old version, tokens then)
    aborted: bool = False  # the scheduler received the abort
    dispatched: bool = False  # as ReqState.dispatched: the scheduler has the request
    abort_sent: bool = False  # as ReqState.abort_sent
    kv_version: str | None = None  # the weight version of its first prefill chunk (SGLang reports none)


class TokenizerManager:
    def __init__(self, engine: "Engine"):
        self.engine = engine
        self.rid_to_state: dict[str, _Req] = {}
        self.is_pause = False
        self.event_loop = None
        self._resumed = asyncio.Event()
        self._resumed.set()

    def auto_create_handle_loop(self):
        """As TokenizerManager.auto_create_handle_loop: once, and from the main thread only, SGLang's
        SIGTERM (drain and shut down) and SIGQUIT handlers go onto the event loop."""
        if self.event_loop is not None:
            return
        self.event_loop = self.engine.loop
        if threading.current_thread() is threading.main_thread():
            self.event_loop.add_signal_handler(signal.SIGTERM, self._sigterm)
            self.event_loop.add_signal_handler(signal.SIGQUIT, self._sigterm)

    def _sigterm(self):
        self.engine.calls.append(("sigterm",))

    def abort_request(self, rid: str = "", abort_all: bool = False):
        """As the wheel's: an abort goes to the scheduler once per request; one for a request the
        scheduler has not received yet is lost there (the request then runs to its end)."""
        self.engine.calls.append(("abort_request", rid))
        state = self.rid_to_state.get(rid)
        if state is None or state.abort_sent:
            return
        state.abort_sent = True
        if state.dispatched:
            state.aborted = True
        else:
            self.engine.calls.append(("abort_lost", rid))

    async def pause_generation(self, obj: PauseGenerationReqInput):
        assert obj.mode in ("abort", "retract", "in_place"), obj.mode
        self.engine.calls.append(("pause_generation", obj.mode))
        self.is_pause = True
        self._resumed.clear()

    async def continue_generation(self, obj: ContinueGenerationReqInput):
        self.engine.calls.append(("continue_generation",))
        self.is_pause = False
        self._resumed.set()

    async def update_weight_version(self, obj: UpdateWeightVersionReqInput) -> None:
        self.engine.calls.append(("update_weight_version", obj.new_version, obj.abort_all_requests))
        old = self.engine.weight_version
        if obj.new_version == old:
            return
        for state in self.rid_to_state.values():  # as the scheduler's record_weight_version_events
            if state.output_ids:
                state.events.append((old, len(state.output_ids)))
        self.engine.weight_version = obj.new_version


    async def check_weights(self, obj: CheckWeightsReqInput, request=None):
        """As TokenizerControlMixin.check_weights with action "checksum" (one TP rank): (success, message,
        [the rank's ChecksumInfo], per-engine checksum); each weight hashed as WeightChecker does, in
        SGLang's fused layout, with the wheel's own tensor_hash."""
        import hashlib

        assert obj.action == "checksum", obj.action
        self.engine.calls.append(("check_weights", obj.action))
        checksums = {name: f"{sglang_wheel.tensor_hash()(t):016x}" for name, t in sglang_layout(self.engine.model).items()}
        overall = hashlib.sha256()
        for name in sorted(checksums):
            overall.update(name.encode())
            overall.update(checksums[name].encode())
        info = {"checksums": checksums, "per_gpu_checksum": overall.hexdigest(),
                "parallelism_info": [{"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1,
                                      "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}]}
        return True, "Success.", [info], hashlib.sha256(info["per_gpu_checksum"].encode()).hexdigest()


class Engine:
    """sglang.Engine: `Engine(**server_args)`, an event loop `loop` and a `tokenizer_manager`."""

    instances: list["Engine"] = []

    def __init__(self, **kwargs):
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE"):  # its scheduler's init_process_group would wait
            raise RuntimeError("scheduler child inherited TORCHELASTIC_USE_AGENT_STORE: it would wait forever "
                               "on a torchelastic agent store nobody serves")
        dtype = kwargs.get("dtype", "auto")
        if dtype == "float32" and kwargs.get("attention_backend") not in ("torch_native",):
            raise ValueError(f"attention backend {kwargs.get('attention_backend') or 'fa3'} does not support "
                             f"dtype float32 (fa3 and flashinfer take float16/bfloat16)")
        if torch.distributed.is_initialized() and any(key not in os.environ for key in NCCL_SETTINGS):
            raise RuntimeError(f"SGLang sets {', '.join(NCCL_SETTINGS)} in this process now, after its process "
                               f"group was made: its NCCL communicators would not all share one setting")
        for key in NCCL_SETTINGS:  # as _set_envs_and_config: unless set
            os.environ.setdefault(key, "0")
        self.kwargs = kwargs
        self.calls: list[tuple] = []
        if threading.current_thread() is threading.main_thread():  # the launch phase's SIGQUIT handler
            signal.signal(signal.SIGQUIT, lambda signum, frame: self.calls.append(("sigquit",)))
        self.model = load_model(Path(kwargs["model_path"]), DTYPES[kwargs.get("dtype", "float32")]).eval()
        self.weight_version = kwargs.get("weight_version", "default")
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = TokenizerManager(self)
        self.released: set[str] = set()
        self.session_open = False
        self.tp_size = 1
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.sizes = {"weights": weights, "cuda_graph": DEVICE.CUDA_GRAPH_BYTES,
                      "kv_cache": int(kwargs.get("mem_fraction_static", 0.5) * DEVICE.TOTAL) - weights}
        if DEVICE.trainer_cached:  # SGLang measures the free memory before it loads, and sizes its pool on it
            raise RuntimeError(f"SGLang starts with {DEVICE.trainer_cached} bytes still cached by the trainer's "
                               f"allocator (the unsharded model): its KV pool would be sized without them")
        for tag, size in self.sizes.items():
            DEVICE.map(tag, size)
        Engine.instances.append(self)

    def get_server_info(self):
        self.tokenizer_manager.auto_create_handle_loop()  # as get_internal_state, which it awaits
        return {"max_total_num_tokens": 4096, "weight_version": self.weight_version}

    # -- generation
    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, *, return_logprob=False,
                             stream=False, rid=None):
        assert prompt is None and stream and return_logprob, "colorl asks for ids, streamed, with log-probs"
        self.tokenizer_manager.auto_create_handle_loop()
        self.calls.append(("async_generate", rid))
        return self._stream(_Req(rid, list(input_ids), dict(sampling_params)))

    async def _stream(self, state: _Req):
        """As TokenizerManager.generate_request, an async generator: the request reaches the tokenizer
        manager (and an abort can find it) only when the stream is first advanced; it is registered
        there, then waits a loop turn (pause, lock, tokenizer) before it is dispatched to the scheduler.
        Cancelled before the dispatch, it is dropped (`_release_req_states_on_failure`)."""
        tm = self.tokenizer_manager
        tm.rid_to_state[state.rid] = state
        try:
            await tm._resumed.wait()
            await asyncio.sleep(0)
            state.dispatched = True
        except BaseException:
            del tm.rid_to_state[state.rid]
            raise
        self.calls.append(("dispatched", state.rid))
        gen = torch.Generator().manual_seed(state.params.get("sampling_seed", 0))
        # the prompt's KV, chunk by chunk (a chunk per scheduler turn; paused, none): the logits below are
        # computed whole, so only the version of the oldest chunk is kept, for the tests to compare
        state.kv_version = self.weight_version
        for _ in range(1, -(-len(state.input_ids) // CHUNKED_PREFILL_SIZE)):
            await asyncio.sleep(0)
            await tm._resumed.wait()
            if state.aborted:
                break
        while True:
            await tm._resumed.wait()
            if state.aborted:
                # the scheduler's batch in flight when the abort arrived ran first: a request it
                # finished comes back finished; otherwise its token is dropped with the abort
                finish = self._decode(state, gen)
                if finish is None:
                    state.output_ids.pop(), state.logprobs.pop()
                    finish = {"type": "abort", "message": "Abort in waiting queue"}
                del tm.rid_to_state[state.rid]  # as _handle_batch_output: gone before the last chunk is read
                yield self._chunk(state, finish)
                return
            finish = self._decode(state, gen)
            if finish is not None:
                del tm.rid_to_state[state.rid]
                yield self._chunk(state, finish)
                return
            yield self._chunk(state, finish)
            await asyncio.sleep(0)

    def _decode(self, state: _Req, gen: torch.Generator) -> dict | None:
        """One token for `state`; the finish reason it ends the request with, if any."""
        assert "kv_cache" not in self.released, "generation while the KV cache is released"
        params = state.params
        with torch.no_grad():
            logits = self.model(torch.tensor([state.input_ids + state.output_ids])).logits[0, -1].float()
        logprobs = torch.log_softmax(logits / params["temperature"], dim=-1)
        token = int(torch.multinomial(logprobs.exp(), 1, generator=gen))
        state.output_ids.append(token)
        state.logprobs.append(float(logprobs[token]))
        if token in params.get("stop_token_ids", []) and not params.get("ignore_eos"):
            return {"type": "stop", "matched": token}
        if len(state.output_ids) >= params["max_new_tokens"]:
            return {"type": "length", "length": params["max_new_tokens"]}
        return None

    def _chunk(self, state: _Req, finish: dict | None) -> dict:
        meta = {"id": state.rid, "finish_reason": finish, "prompt_tokens": len(state.input_ids),
                "weight_version": self.weight_version, "completion_tokens": len(state.output_ids),
                "output_token_logprobs": [(lp, t, None) for lp, t in zip(state.logprobs, state.output_ids)]}
        if finish is not None:
            meta["weight_versions"] = _spans(state.events, self.weight_version, len(state.output_ids))
        return {"output_ids": state.output_ids, "meta_info": meta}

    # -- weights
    def begin_weight_update(self, selector: str = "all"):
        self.calls.append(("begin_weight_update",))
        self.session_open = True
        return True, "Success"

    def end_weight_update(self):
        self.calls.append(("end_weight_update",))
        self.session_open = False
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update_weights_from_tensor", [name for name, _ in named_tensors], flush_cache))
        if not self.session_open:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        busy = any(not s.aborted for s in self.tokenizer_manager.rid_to_state.values())
        assert not busy or self.tokenizer_manager.is_pause, "would wait for the requests in flight (writer lock)"
        if busy:  # what SGLang 0.5.23 would get wrong with requests in flight
            assert self.kwargs.get("disable_radix_cache"), "radix cache keeps prompt KV of the old weights (no flush while busy)"
            assert self.kwargs.get("disable_overlap_schedule"), "an in-place pause leaves an overlapped batch's token on the old weights"
        assert "weights" not in self.released, "weights loaded into released memory"
        # Engine._serialize_tensors_per_rank, then the scheduler's TpModelWorker.deserialize_own_rank
        payloads = [sglang_wheel.serializer().serialize(named_tensors) for _ in range(self.tp_size)]
        received = sglang_wheel.serializer().deserialize(payloads[0])
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in received:
                params[name].copy_(tensor)
        return True, "Success"

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        """As LlamaForCausalLM.get_weights_by_name: the first `truncate_size` rows as float32 lists."""
        self.calls.append(("get_weights_by_name", name, truncate_size))
        if self.model.config.model_type not in READ_BACK_FAMILIES:  # the model class lacks it: SGLang logs, gives None
            return None
        params = dict(self.model.named_parameters())
        if name == "lm_head.weight" and name not in params:
            name = "model.embed_tokens.weight"
        return params[name].detach().cpu().to(torch.float32).numpy().tolist()[:truncate_size]

    def flush_cache(self):
        idle = not self.tokenizer_manager.rid_to_state
        self.calls.append(("flush_cache", idle))
        return FlushCacheReqOutput(success=idle)

    # -- memory
    def release_memory_occupation(self, tags=None):
        assert not self.tokenizer_manager.rid_to_state, "release_memory_occupation should be called only when idle"
        self.calls.append(("release_memory_occupation", tuple(tags)))
        self.released.update(tags)
        for tag in tags:
            DEVICE.unmap(tag)
        if "weights" in tags:  # gone, unless enable_weights_cpu_backup saved them to host memory
            if self.kwargs.get("enable_weights_cpu_backup"):
                self.cpu_backup = {n: p.detach().clone() for n, p in self.model.named_parameters()}
            with torch.no_grad():
                for p in self.model.parameters():
                    p.fill_(float("nan"))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume_memory_occupation", tuple(tags)))
        for tag in tags:
            DEVICE.map(tag, self.sizes[tag])
        self.released.difference_update(tags)
        if "weights" in tags and getattr(self, "cpu_backup", None) is not None:
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    p.copy_(self.cpu_backup[name])
            self.cpu_backup = None

    def shutdown(self):
        self.calls.append(("shutdown",))
        for tag in self.sizes:
            DEVICE.engine_held.pop(tag, None)
        self.loop.close()


def _spans(events: list[tuple[str, int]], current: str, count: int) -> list[dict]:
    """sglang.srt.utils.weight_versions: spans from the recorded version changes."""
    spans: list[dict] = []
    for version, end in events + [(current, count)]:
        end = min(end, count)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans


def install(monkeypatch) -> None:
    """Put the stand-in where `import sglang` and its io_struct import find it, on a fresh simulated
    device whose cache colorl's memory hand-off empties. Needs the wheel (sglang_wheel.obtain)."""
    global DEVICE
    sglang_wheel.serializer()
    DEVICE = SimulatedDevice()
    for key in NCCL_SETTINGS:  # the stand-in's engine sets them in this process, as SGLang's: undone after
        monkeypatch.delenv(key, raising=False)
    release = distributed.release_cached_device_memory

    def release_and_hand_off(device):
        release(device)
        DEVICE.hand_off()

    monkeypatch.setattr(distributed, "release_cached_device_memory", release_and_hand_off)
    from colorl.train.policy import PolicyTrainer
    build_trainer = PolicyTrainer.__init__

    def trainer_then_cached(trainer, *args, **kwargs):  # the trainer loads the whole model onto the device,
        build_trainer(trainer, *args, **kwargs)           # then shards it: what it frees stays cached
        DEVICE.trainer_cached = sum(p.numel() * p.element_size() for p in trainer.model.parameters())

    monkeypatch.setattr(PolicyTrainer, "__init__", trainer_then_cached)
    io_struct = types.ModuleType("sglang.srt.managers.io_struct")
    for cls in (PauseGenerationReqInput, ContinueGenerationReqInput, UpdateWeightVersionReqInput, FlushCacheReqOutput,
                CheckWeightsReqInput):
        setattr(io_struct, cls.__name__, cls)
    mm_utils = types.ModuleType("sglang.srt.managers.mm_utils")
    mm_utils.tensor_hash = sglang_wheel.tensor_hash()
    package = types.ModuleType("sglang")
    package.Engine = Engine
    package.__version__ = "0.5.23"
    srt, managers = types.ModuleType("sglang.srt"), types.ModuleType("sglang.srt.managers")
    package.srt, srt.managers, managers.io_struct, managers.mm_utils = srt, managers, io_struct, mm_utils
    for name, module in (("sglang", package), ("sglang.srt", srt), ("sglang.srt.managers", managers),
                         ("sglang.srt.managers.io_struct", io_struct), ("sglang.srt.managers.mm_utils", mm_utils)):
        monkeypatch.setitem(sys.modules, name, module)
    Engine.instances.clear()
