"""colorl's SGLang adapter driven end to end on CPU against a recording stand-in of the package.

The stand-in (tests/engines/sglang_standin.py) has sglang 0.5.23's signatures and result format
(checked against the wheel by test_sglang_contract.py) and a real tiny model behind it, so these
tests check what the adapter asks of SGLang, in which order, and what it makes of the answers.
"""
from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch

import sglang_wheel  # tests/helpers
from colorl import distributed
from colorl.config import EngineConfig, SyncConfig
from colorl.engines import build_engine
from colorl.engines.base import GenerationRequest, SamplingParams
from colorl.models import load_model, save_tiny_model
from colorl.rollout.episodes import Rollouts
from colorl.sync import CheckpointEngine

_spec = importlib.util.spec_from_file_location("sglang_standin", Path(__file__).parent / "sglang_standin.py")
standin = sys.modules.setdefault("sglang_standin", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(standin)

PARAMS = SamplingParams(temperature=0.8, max_new_tokens=6, seed=3)
LONG = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True, seed=5)
SMALL_BUCKETS = SyncConfig(bucket_mb=0.02)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("sgl-llama"), initializer_range=0.3)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The 'trainer': the same architecture with other weights (what a sync must deliver)."""
    return load_model(save_tiny_model(tmp_path_factory.mktemp("sgl-llama-2"), seed=1, initializer_range=0.3)).eval()


@pytest.fixture(autouse=True)
def _wheel():
    sglang_wheel.require()  # the stand-in runs the wheel's serialisation code


@pytest.fixture
def engine(model_dir, monkeypatch):
    standin.install(monkeypatch)
    built = build_engine("sglang", model_dir, EngineConfig(memory_fraction=0.4, max_num_seqs=8), "cpu", torch.float32)
    yield built
    built.shutdown()


def fake(engine) -> "standin.Engine":
    return engine._engine  # the stand-in sglang.Engine behind this adapter


def names(calls) -> list[str]:
    return [call[0] for call in calls]


def request(rid: str, params=PARAMS, prompt=(5, 6, 7, 8)) -> GenerationRequest:
    return GenerationRequest(rid, list(prompt), params)


def reference_logprobs(model, prompt, output, temperature) -> list[float]:
    """log p(token | prefix) at the sampling temperature, from the model itself."""
    ids = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        logits = model(ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits, -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def test_engine_is_started_with_colorls_memory_settings(engine, model_dir):
    kwargs = fake(engine).kwargs
    assert kwargs["model_path"] == str(model_dir)
    assert kwargs["mem_fraction_static"] == 0.4 and kwargs["max_running_requests"] == 8
    assert kwargs["enable_memory_saver"] and kwargs["skip_tokenizer_init"]
    assert kwargs["weight_version"] == "0" and kwargs["dtype"] == "float32"
    assert engine.keeps_kv_across_updates


def test_generate_returns_ids_logprobs_and_versions(engine, model_dir):
    results = engine.generate([request(f"r{i}", prompt=(5 + i, 6, 7)) for i in range(3)])
    model = load_model(model_dir).eval()
    for i, result in enumerate(results):
        assert result.request_id == f"r{i}" and result.finish_reason in ("stop", "length")
        assert 1 <= len(result.output_ids) <= PARAMS.max_new_tokens
        assert result.logprobs == pytest.approx(reference_logprobs(model, result.prompt_ids, result.output_ids, 0.8),
                                                abs=1e-5)
        assert result.versions == [0] * len(result.output_ids)
    assert names(fake(engine).calls).count("async_generate") == 3


def test_sync_goes_bucket_by_bucket_and_ends_bit_for_bit(engine, trained):
    sync = CheckpointEngine(trained, engine, SMALL_BUCKETS)
    fake(engine).calls.clear()
    sync.sync(engine, 1)
    calls = fake(engine).calls
    updates = [c for c in calls if c[0] == "update_weights_from_tensor"]
    assert 1 < len(updates) <= len(sync.buckets)  # one call per bucket that completes a tensor
    loaded_names = [name for _, batch, _ in updates for name in batch]
    assert sorted(loaded_names) == sorted(n for n, _ in trained.named_parameters())  # each exactly once
    assert all(flush is False for *_, flush in updates)  # flushed once, after the last bucket
    assert names(calls) == (["begin_weight_update"] + ["update_weights_from_tensor"] * len(updates)
                            + ["end_weight_update", "flush_cache", "update_weight_version"])
    loaded = dict(fake(engine).model.named_parameters())
    for name, p in trained.named_parameters():
        assert torch.equal(loaded[name], p), name
    assert engine.version == 1
    result = engine.generate([request("after")])[0]
    assert result.versions == [1] * len(result.output_ids)
    assert result.logprobs == pytest.approx(reference_logprobs(trained, result.prompt_ids, result.output_ids, 0.8),
                                            abs=1e-5)


def test_sleep_levels_release_and_resume_by_tag(engine, trained):
    sync = CheckpointEngine(trained, engine, SMALL_BUCKETS)
    engine.sleep(1)
    distributed.release_cached_device_memory("cpu")  # the hand-off the worker makes before each wake
    engine.wake()
    assert fake(engine).calls[-2:] == [("release_memory_occupation", ("kv_cache",)),
                                       ("resume_memory_occupation", ("kv_cache",))]
    engine.sleep(2)
    assert fake(engine).calls[-1] == ("release_memory_occupation", ("kv_cache", "weights", "cuda_graph"))
    with pytest.raises(RuntimeError, match="before a weight sync"):
        engine.wake()
    distributed.release_cached_device_memory("cpu")
    sync.sync(engine, 2)  # the weights' memory comes back for the load, then the rest on wake
    engine.wake()
    calls = fake(engine).calls
    assert ("resume_memory_occupation", ("weights",)) in calls
    assert calls[-1] == ("resume_memory_occupation", ("cuda_graph", "kv_cache"))
    assert "flush_cache" not in names(calls[calls.index(("resume_memory_occupation", ("weights",))):])
    result = engine.generate([request("woken")])[0]
    assert all(torch.isfinite(torch.tensor(result.logprobs))) and result.versions[0] == 2


def test_memory_the_trainer_still_caches_cannot_be_resumed_into(engine, trained):
    """The simulated device: what the engine releases, the trainer's allocator takes, until colorl
    hands it back; a resume before the hand-off fails as it would in SGLang's scheduler."""
    sync = CheckpointEngine(trained, engine, SMALL_BUCKETS)
    engine.sleep(1)
    with pytest.raises(RuntimeError, match="CUDA out of memory.*still reserved by the trainer"):
        engine.wake()
    engine.sleep(2)
    with pytest.raises(RuntimeError, match="CUDA out of memory: resume_memory_occupation\\('weights'\\)"):
        sync.sync(engine, 1)  # level 2: the sync maps the weights back first
    distributed.release_cached_device_memory("cpu")
    sync.sync(engine, 1)
    engine.wake()
    assert standin.DEVICE.hand_offs == 1 and standin.DEVICE.trainer_cached == 0


class Subclassed(torch.Tensor):
    """A tensor subclass outside SGLang's allow-list, as a DTensor shard would be."""


def test_tensors_pass_sglangs_serialisation_and_its_unpicklers_allow_list(engine):
    """What the real scheduler would refuse, the stand-in refuses: tensors reach it through the
    wheel's MultiprocessingSerializer and SafeUnpickler (one payload per TP rank)."""
    serializer = sglang_wheel.serializer()
    plain = [("model.norm.weight", torch.ones(4))]
    (name, received), = serializer.deserialize(serializer.serialize(plain))
    assert name == "model.norm.weight" and torch.equal(received, plain[0][1])

    with pytest.raises(RuntimeError, match="Blocked unsafe global"):
        serializer.deserialize(serializer.serialize([("model.norm.weight", torch.ones(4).as_subclass(Subclassed))]))
    with pytest.raises(RuntimeError, match="Blocked unsafe global"):
        serializer.deserialize(ForkingPickler.dumps(os.system))  # a payload that would run a command
    fake(engine).begin_weight_update()
    with pytest.raises(RuntimeError, match="Blocked unsafe global"):
        fake(engine).update_weights_from_tensor([("model.norm.weight", torch.ones(64).as_subclass(Subclassed))])


def test_interrupt_hands_back_partial_tokens_and_abort_drops(engine):
    for rid in ("a", "b", "c"):
        engine.add(request(rid, LONG))
    for _ in range(6):
        assert engine.step() == []
    (partial,) = engine.interrupt(["a"])
    assert partial.finish_reason == "interrupt" and 0 < len(partial.output_ids) < LONG.max_new_tokens
    assert len(partial.logprobs) == len(partial.versions) == len(partial.output_ids)
    engine.abort(["b"])
    assert ("abort_request", "a") in fake(engine).calls and ("abort_request", "b") in fake(engine).calls
    resumed = GenerationRequest("a", partial.prompt_ids, LONG, partial.output_ids, partial.logprobs, partial.versions)
    engine.add(resumed)  # partial rollout: re-prefill with the tokens it has
    done = {}
    while engine.has_unfinished():
        done.update((r.request_id, r) for r in engine.step())
    assert sorted(done) == ["a", "c"]
    assert done["a"].output_ids[: len(partial.output_ids)] == partial.output_ids
    assert len(done["a"].output_ids) == LONG.max_new_tokens and done["a"].finish_reason == "length"


@pytest.fixture
def bounded_lag_engine(model_dir, monkeypatch):
    """As bounded-lag mode builds it: weights change while requests are in flight."""
    standin.install(monkeypatch)
    built = build_engine("sglang", model_dir, EngineConfig(max_num_seqs=8, in_flight_updates=True), "cpu", torch.float32)
    yield built
    built.shutdown()


def test_in_flight_updates_run_without_radix_cache_and_overlap(bounded_lag_engine, engine, trained):
    """Issue 19 defect 8: SGLang flushes its radix cache only when idle and an in-place pause leaves an
    overlapped batch's token queued; with in-flight updates both are off (the stand-in refuses an
    in-flight update otherwise), in colocated mode both stay on."""
    assert fake(bounded_lag_engine).kwargs["disable_radix_cache"] is True
    assert fake(bounded_lag_engine).kwargs["disable_overlap_schedule"] is True
    assert fake(engine).kwargs["disable_radix_cache"] is False and fake(engine).kwargs["disable_overlap_schedule"] is False
    sync = CheckpointEngine(trained, engine, SMALL_BUCKETS)
    sync.sync(engine, 1)
    engine.add(request("x", LONG))
    engine.step()
    with pytest.raises(AssertionError, match="radix cache keeps prompt KV"):
        sync.publish(2).apply(engine)


def test_in_flight_update_pauses_in_place_and_stamps_token_versions(bounded_lag_engine, trained):
    engine = bounded_lag_engine
    sync = CheckpointEngine(trained, engine, SMALL_BUCKETS)  # start-up load (idle)
    sync.sync(engine, 1)
    engine.add(request("x", LONG))
    engine.add(request("y", LONG, prompt=(9, 10)))
    for _ in range(6):
        engine.step()
    fake(engine).calls.clear()
    with torch.no_grad():
        for p in trained.parameters():
            p.mul_(0.5)
    staged = sync.publish(2)
    staged.apply(engine)  # the rollout thread's step boundary
    calls = names(fake(engine).calls)
    assert calls[0] == "pause_generation" and fake(engine).calls[0][1] == "in_place"
    assert calls[-2:] == ["update_weight_version", "continue_generation"]
    assert "flush_cache" not in calls  # running requests keep their KV cache
    done = {}
    while engine.has_unfinished():
        done.update((r.request_id, r) for r in engine.step())
    before = 0
    for result in done.values():
        k = result.versions.index(2)
        assert result.versions == [1] * k + [2] * (len(result.output_ids) - k)
        before += k
        tail = reference_logprobs(trained, result.prompt_ids + result.output_ids[:k], result.output_ids[k:], 1.0)
        assert result.logprobs[k:] == pytest.approx(tail, abs=1e-5)  # sampled by the new weights
    assert before >= 6  # every step brought at least one token, all under version 1


def test_a_prompt_prefilled_across_an_update_keeps_the_older_version(bounded_lag_engine, trained, monkeypatch):
    """Issue 33: SGLang's scheduler (another process) prefills a long prompt in chunks while colorl goes on;
    an in-place update between two chunks leaves the prompt's KV of the old weights under tokens sampled by
    the new ones, and SGLang's version spans (output tokens only) say nothing of it. A sample's version is
    never newer than the oldest that computed its KV: the version in force when it was added."""
    engine = bounded_lag_engine
    monkeypatch.setattr(standin, "CHUNKED_PREFILL_SIZE", 1)
    sync = CheckpointEngine(trained, engine, SMALL_BUCKETS)
    sync.sync(engine, 1)
    engine.add(request("long", LONG, prompt=range(5, 17)))  # twelve chunks: the update lands between two
    scheduler = fake(engine).tokenizer_manager.rid_to_state
    while "long" not in scheduler or scheduler["long"].kv_version is None:
        engine._run(asyncio.sleep(0))  # the scheduler runs beside colorl: its first chunk, under version 1
    state = scheduler["long"]
    assert not state.output_ids
    sync.publish(2).apply(engine)
    engine.add(request("after", LONG, prompt=range(5, 17)))
    done = {}
    while engine.has_unfinished():
        done.update((r.request_id, r) for r in engine.step())
    assert done["long"].versions == [2] * LONG.max_new_tokens and state.kv_version == "1"
    assert done["long"].first_version == 1 and done["long"].state_version == 1
    assert done["after"].first_version == 2


def test_a_resumed_request_carries_its_state_version(engine):
    """An interrupted part's state version comes back in the result, whether SGLang had the request or not."""
    engine.version = 1  # same weights, a newer version than the interrupted part's
    engine.add(GenerationRequest("early", [5, 6, 7, 8], PARAMS, state_version=0))
    (cancelled,) = engine.interrupt(["early"])  # before its dispatch: cancelled here
    assert cancelled.finish_reason == "interrupt" and cancelled.state_version == 0
    (r,) = engine.generate([GenerationRequest("late", [5, 6, 7, 8], PARAMS, state_version=0)])
    assert set(r.versions) == {1} and r.state_version == 0 and r.first_version == 0


def test_bf16_lora_merges_float32_adapters_into_bf16_engine_weights(model_dir, monkeypatch):
    """The 7B LoRA example's case: a bf16 base with peft's float32 adapters."""
    from colorl.config import LoraConfig
    from colorl.train.policy import apply_lora

    standin.install(monkeypatch)
    engine = build_engine("sglang", model_dir, EngineConfig(), "cpu", torch.bfloat16)
    lora = LoraConfig(r=4, alpha=8)
    model = apply_lora(load_model(model_dir, torch.bfloat16), lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    sync = CheckpointEngine(model, engine, SMALL_BUCKETS, lora)
    sync.sync(engine, 1)
    merged = {name: p.float() for name, p in model.merge_and_unload().named_parameters()}
    for name, p in fake(engine).model.named_parameters():
        assert p.dtype == torch.bfloat16
        assert torch.allclose(p.float(), merged[name], rtol=1e-2, atol=1e-2), name
    engine.shutdown()


def test_scheduler_child_starts_without_torchrun_agent_store(model_dir, monkeypatch):
    """Issue 19 defect 6: under torchrun the scheduler child must not inherit TORCHELASTIC_USE_AGENT_STORE
    (its init_process_group would wait on an agent store nobody serves); this process keeps it."""
    import os

    standin.install(monkeypatch)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    built = build_engine("sglang", model_dir, EngineConfig(), "cpu", torch.float32)
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True" and os.environ["TORCHELASTIC_RUN_ID"] == "abc"
    built.shutdown()


def test_colorls_sigterm_handler_survives_sglangs_loop(model_dir, monkeypatch):
    """Issue 19 defect 7: the tokenizer manager's first request puts SGLang's SIGTERM handler on the
    event loop; the adapter gives the process's own back, so a SIGTERM still reaches it (under torchrun,
    colorl's handler saves a checkpoint at the step boundary)."""
    import os
    import signal

    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        standin.install(monkeypatch)
        built = build_engine("sglang", model_dir, EngineConfig(), "cpu", torch.float32)
        built.generate([request("a")])
        assert fake(built).tokenizer_manager.event_loop is not None  # SGLang's handlers were installed
        os.kill(os.getpid(), signal.SIGTERM)
        assert received == [signal.SIGTERM]
        assert ("sigterm",) not in fake(built).calls
        built.shutdown()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_colorls_handlers_are_back_as_soon_as_the_engine_is_built(model_dir, monkeypatch):
    """Issue 30 defect 3: `get_server_info()` at start is the tokenizer manager's first call, which puts
    SGLang's SIGTERM and SIGQUIT handlers on its loop, and the engine's start sets SIGQUIT: the process's
    own handlers are back before the start-up sync, not only after the first request."""
    import os
    import signal

    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    quit_handler = signal.getsignal(signal.SIGQUIT)
    try:
        standin.install(monkeypatch)
        built = build_engine("sglang", model_dir, EngineConfig(), "cpu", torch.float32)
        assert fake(built).tokenizer_manager.event_loop is not None  # SGLang's handlers were installed
        assert signal.getsignal(signal.SIGQUIT) is quit_handler
        os.kill(os.getpid(), signal.SIGTERM)
        built.generate([request("a")])  # SGLang's loop runs: a SIGTERM it had caught would reach it now
        assert received == [signal.SIGTERM] and ("sigterm",) not in fake(built).calls
        built.shutdown()
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGQUIT, quit_handler)


def test_a_request_finished_before_the_interrupt_is_not_resumed(engine):
    """Issue 30 defect 2: an interrupt's reply holds requests the scheduler finished before the abort
    arrived (here its step in flight gives the last token of the budget). They are done: `Rollouts`
    hands them on and does not re-add them, which would decode past their end."""
    rollouts = Rollouts(engine)
    rollouts.start(request("a", SamplingParams(temperature=1.0, max_new_tokens=2, ignore_eos=True, seed=5)), None)
    assert rollouts.step() == []  # one token
    rollouts.resume(rollouts.interrupt(["a"]))
    (done,) = rollouts.step()
    assert done.finish_reason == "length" and len(done.output_ids) == 2 and not rollouts.has_unfinished()
    assert ("abort_request", "a") in fake(engine).calls


def test_an_interrupt_before_the_dispatch_cancels_the_request(engine):
    """Issue 30 defect 2: SGLang registers a request, then dispatches it to its scheduler some loop turns
    later; an abort in between is lost and the request runs to its end. Here it is held registered by
    an in-place pause that lifts while the interrupt waits: the adapter cancels it before the dispatch."""
    tm, loop = fake(engine).tokenizer_manager, fake(engine).loop
    loop.run_until_complete(tm.pause_generation(standin.PauseGenerationReqInput(mode="in_place")))
    engine.add(request("held", LONG))
    loop.run_until_complete(asyncio.sleep(0.01))
    assert "held" in tm.rid_to_state and not tm.rid_to_state["held"].dispatched
    loop.call_later(0.05, lambda: loop.create_task(tm.continue_generation(standin.ContinueGenerationReqInput())))
    (result,) = engine.interrupt(["held"])
    assert result.finish_reason == "interrupt" and result.output_ids == []
    assert "held" not in tm.rid_to_state and ("dispatched", "held") not in fake(engine).calls


def test_bf16_serving_from_fp32_master_weights(model_dir, trained, monkeypatch):
    """Issue 19 defect 2: SGLang's CUDA attention (fa3, flashinfer) takes fp16/bf16 only. The engine serves
    bf16 while the trainer keeps fp32; the checkpoint engine casts each tensor as it unpacks a bucket,
    so the engine holds the trainer's weights rounded once to bf16, bit for bit. float32 serving starts
    only on an attention backend that takes it (torch_native), which the adapter picks."""
    standin.install(monkeypatch)
    with pytest.raises(ValueError, match="does not support dtype float32"):
        standin.Engine(model_path=str(model_dir), dtype="float32")
    engine = build_engine("sglang", model_dir, EngineConfig(), "cpu", torch.bfloat16)
    assert fake(engine).kwargs["attention_backend"] is None and fake(engine).kwargs["dtype"] == "bfloat16"
    assert trained.model.norm.weight.dtype == torch.float32
    CheckpointEngine(trained, engine, SMALL_BUCKETS).sync(engine, 1)
    served = dict(fake(engine).model.named_parameters())
    for name, p in trained.named_parameters():
        assert served[name].dtype == torch.bfloat16 and torch.equal(served[name], p.detach().to(torch.bfloat16)), name
    assert engine.generate([request("a")])[0].finish_reason in ("stop", "length")
    engine.shutdown()
    fp32 = build_engine("sglang", model_dir, EngineConfig(), "cpu", torch.float32)
    assert fake(fp32).kwargs["attention_backend"] == "torch_native"
    fp32.shutdown()


def test_interrupt_before_a_request_reached_sglang(engine):
    """SGLang's stream registers the request only when first advanced: an abort before that finds
    nothing and the request would run to its end. The adapter cancels such a request instead."""
    engine.add(request("early", LONG))
    (result,) = engine.interrupt(["early"])
    assert result.finish_reason == "interrupt" and result.output_ids == [] and not engine.has_unfinished()
    assert "early" not in fake(engine).tokenizer_manager.rid_to_state
    engine.add(request("later", LONG))
    engine.step()
    (result,) = engine.interrupt(["later"])
    assert result.finish_reason == "interrupt" and 0 < len(result.output_ids) < LONG.max_new_tokens
