"""The stand-in of vLLM 0.32's CUDA build (tests/engines/vllm_standin.py): its surface and rules read
against the CUDA wheel's source, and colorl's vLLM adapter driven through its CUDA branch, on CPU,
as rank 1 of a two-GPU box under the device-placement recorder."""
from __future__ import annotations

import ast
import inspect

import pytest
import torch

import vllm_wheel  # tests/helpers
from colorl.config import EngineConfig
from colorl.engines import vllm as adapter
from colorl.models import load_model, save_tiny_model
from colorl.engines.base import GenerationRequest, SamplingParams
from device_recorder import WrongDevice, install as install_recorder
from sglang_wheel import methods_of
from standin_rank import load_standin

MAX_NEW = 6
standin = load_standin("vllm_standin")


@pytest.fixture(scope="module")
def wheel():
    reason = vllm_wheel.missing()
    if reason:
        pytest.skip(reason)
    return vllm_wheel.wheel()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def rank1(wheel, monkeypatch):
    """This process as rank 1 of a two-GPU box, with `import vllm` finding the stand-in."""
    standin.install(monkeypatch)
    recorder = install_recorder(monkeypatch, rank=1, world=2)
    torch.cuda.set_device(1)
    yield recorder
    recorder.__exit__(None, None, None)


def build(model_dir, **cfg) -> adapter.VLLMEngine:
    return adapter.VLLMEngine(model_dir, EngineConfig(max_num_seqs=4, **cfg), device="cuda:1")


def standin_llm(model_dir, **options):
    """The stand-in's LLM on this rank's device (plain vLLM would pick cuda:0)."""
    return standin.LLM(model=str(model_dir), logprobs_mode="processed_logprobs",
                       distributed_executor_backend=adapter._executor_on(1), **options)


def requests(n: int, tag: str) -> list[GenerationRequest]:
    return [GenerationRequest(f"{tag}{i}", [5, 6, 7, 8 + i], SamplingParams(max_new_tokens=MAX_NEW, seed=i, ignore_eos=True))
            for i in range(n)]


def teacher_forced(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


# -- the surface and the rules, against the wheel -------------------------------------------------

def test_the_wheel_is_the_release_colorl_pins(wheel):
    assert vllm_wheel.VLLM_VERSION == adapter.VLLM_VERSION == wheel.version()


SURFACE = [  # (stand-in class, wheel file, wheel class, methods)
    (standin.LLM, "vllm/entrypoints/llm.py", "LLM", ("sleep", "wake_up", "collective_rpc", "apply_model", "reset_prefix_cache")),
    (standin.LLMEngine, "vllm/v1/engine/llm_engine.py", "LLMEngine",
     ("add_request", "step", "abort_request", "collective_rpc", "reset_prefix_cache", "apply_model")),
    (standin.EngineCore, "vllm/v1/engine/core.py", "EngineCore", ("set_weight_version", "get_weight_version", "pause_scheduler",
                                                                   "resume_scheduler", "sleep", "wake_up", "reset_prefix_cache",
                                                                   "collective_rpc", "abort_requests", "shutdown")),
    (standin.Scheduler, "vllm/v1/core/sched/scheduler.py", "Scheduler", ("reset_prefix_cache",)),
    (standin.Executor, "vllm/v1/executor/abstract.py", "Executor", ("sleep", "wake_up", "supports_async_scheduling")),
    (standin.UniProcExecutor, "vllm/v1/executor/uniproc_executor.py", "UniProcExecutor",
     ("collective_rpc", "_init_executor", "_distributed_args", "supports_async_scheduling")),
    (standin.Worker, "vllm/v1/worker/gpu_worker.py", "Worker", ("init_device", "load_model", "sleep", "wake_up")),
    (standin.Worker, "vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner", ("reload_weights",)),
]


def wheel_parameters(node: ast.FunctionDef) -> list[tuple[str, str | None]]:
    args = node.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + [ast.unparse(d) for d in args.defaults]
    kw_defaults = [None if d is None else ast.unparse(d) for d in args.kw_defaults]
    return [(a.arg, d) for a, d in zip(positional, defaults)] + [(a.arg, d) for a, d in zip(args.kwonlyargs, kw_defaults)]


def standin_parameters(function) -> list[tuple[str, str | None]]:
    return [(p.name, None if p.default is inspect.Parameter.empty else repr(p.default))
            for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("cls, path, name, methods", SURFACE, ids=[f"{s[2]}" for s in SURFACE])
def test_every_method_has_the_wheels_parameters(wheel, cls, path, name, methods):
    """Each stand-in method takes the wheel's parameters, in its order, with its defaults (a prefix
    of them: what colorl does not pass may be left out)."""
    theirs = methods_of(wheel.classes(path)[name])
    for method in methods:
        ours = standin_parameters(inspect.getattr_static(cls, method).__func__
                                  if isinstance(inspect.getattr_static(cls, method), classmethod) else getattr(cls, method))
        expected = wheel_parameters(theirs[method])
        if ours and ours[0][0] == "cls":
            ours = [("cls", None)] + ours[1:]
        elif not ours or ours[0][0] != "self":
            ours = [("self", None)] + ours
        assert ours == expected[: len(ours)], f"{name}.{method}"


def wheel_fields(wheel, path: str, name: str) -> list[str]:
    return [n.target.id for n in wheel.classes(path)[name].body if isinstance(n, ast.AnnAssign)]


def test_options_params_and_outputs_are_the_wheels(wheel):
    assert standin.ENGINE_ARGS <= set(wheel_fields(wheel, "vllm/engine/arg_utils.py", "EngineArgs"))
    assert set(standin.SamplingParams.__dataclass_fields__) <= set(wheel_fields(wheel, "vllm/sampling_params.py", "SamplingParams"))
    for cls, path in ((standin.WeightVersionSpan, "vllm/outputs.py"), (standin.CompletionOutput, "vllm/outputs.py"),
                      (standin.Logprob, "vllm/logprobs.py")):
        ours, theirs = list(cls.__dataclass_fields__), wheel_fields(wheel, path, cls.__name__)
        assert ours[:5] == theirs[:5] and set(ours) <= set(theirs), cls  # positional order as the adapter may rely on
    assert [m.name for m in standin.RequestOutputKind] == [
        n.targets[0].id for n in wheel.classes("vllm/sampling_params.py")["RequestOutputKind"].body if isinstance(n, ast.Assign)]


def test_the_rules_it_enforces_are_in_the_wheels_source(wheel):
    """Where each rule of the stand-in comes from, so a new pin that changes one fails here."""
    suspend = ast.unparse(vllm_wheel.method("vllm/device_allocator/sleep_mode_backend.py", "CuMemBackend", "suspend"))
    assert "if level == 1:\n        offload_tags = ('weights', *offload_tags)" in suspend  # level 2 discards the weights
    init_device = ast.unparse(vllm_wheel.method("vllm/v1/worker/gpu_worker.py", "Worker", "init_device"))
    assert "torch.device(f'cuda:{visible_device_index}')" in init_device
    assert "torch.accelerator.set_device_index(self.device)" in init_device  # the building thread's device switches
    assert ast.unparse(vllm_wheel.method("vllm/v1/executor/uniproc_executor.py", "UniProcExecutor",
                                         "supports_async_scheduling")).endswith("return True")
    assert "async_scheduling: bool | None = None" in wheel.text("vllm/config/scheduler.py")
    assert "self.scheduler_config.async_scheduling = True" in wheel.text("vllm/config/vllm.py")  # None: on, when supported
    assert "self.batch_queue_size = vllm_config.max_concurrent_batches" in wheel.text("vllm/v1/engine/core.py")


def test_the_wheels_executor_puts_every_engine_on_device_0_unless_told():
    theirs = vllm_wheel.distributed_args()
    config = lambda device: type("E", (), {"vllm_config": type("C", (), {"device_config": type("D", (), {"device": device})})})()  # noqa: E731
    assert theirs(config(torch.device("cuda")))[2] == 0  # what vLLM builds for any rank: "cuda"
    assert theirs(config(torch.device("cuda:2")))[2] == 2


# -- colorl's adapter through its CUDA branch --------------------------------------------------------

def test_each_ranks_engine_is_built_and_run_on_its_own_device(rank1, model_dir, monkeypatch):
    engine = build(model_dir)
    worker = standin.LLM.instances[-1].llm_engine._core.worker
    assert worker.device == torch.device("cuda", 1) and rank1.current_index() == 1
    assert len(engine.generate(requests(2, "a"))) == 2
    monkeypatch.setattr(adapter, "_executor_on", lambda index: None)  # vLLM's own executor: index 0 from "cuda"
    with pytest.raises(WrongDevice, match="uses cuda:0, not rank 1's cuda:1"):
        build(model_dir)


def test_async_scheduling_is_on_by_default_and_off_for_in_flight_updates(rank1, model_dir):
    colocated = build(model_dir)
    assert colocated._core.batch_queue_size == 2  # colorl leaves vLLM's default in colocated mode
    assert len(colocated.generate(requests(2, "c"))) == 2
    bounded = build(model_dir, in_flight_updates=True)
    assert bounded._core.batch_queue_size == 1
    for r in requests(2, "b"):
        bounded.add(r)
    assert bounded.step() == [] and bounded.step() == []
    bounded.version = 1  # weights change with requests running: every token stamped with its computing version
    results = []
    while bounded.has_unfinished():
        results += bounded.step()
    assert all(r.versions == [0, 0, 1, 1, 1, 1] for r in results)


def test_a_load_while_async_scheduling_holds_a_batch_fails(rank1, model_dir):
    engine = standin_llm(model_dir).llm_engine
    params = standin.SamplingParams(max_tokens=4, logprobs=0, output_kind=standin.RequestOutputKind.DELTA)
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, params)
    assert engine.step() == []  # its first token is computed, and handed back a step later
    (out,) = engine.step()
    assert len(out.outputs[0].token_ids) == 1
    weights = dict(load_model(model_dir).named_parameters())
    with pytest.raises(RuntimeError, match="computed on the old weights"):
        engine.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_unmaps_the_weights_level_1_offloads_them_level_2_discards_them(rank1, model_dir, level):
    llm = standin_llm(model_dir, enable_sleep_mode=True)
    worker = llm.llm_engine._core.worker
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    llm.sleep(level=level)
    weights = dict(load_model(model_dir).named_parameters())
    with pytest.raises(RuntimeError, match="illegal memory access"):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
    assert llm.wake_up()
    woken = dict(worker.model.named_parameters())
    if level == 1:  # what was offloaded at sleep comes back
        assert all(torch.equal(woken[n], before[n]) for n in before)
    else:  # fresh memory: nothing to serve until a load
        assert all(torch.isnan(p).all() for p in woken.values())
        params = standin.SamplingParams(max_tokens=2, logprobs=0, output_kind=standin.RequestOutputKind.DELTA)
        llm.llm_engine.add_request("r", {"prompt_token_ids": [5, 6]}, params)
        with pytest.raises(RuntimeError, match="woken from sleep level 2"):
            llm.llm_engine.step()


@pytest.mark.parametrize("level", [1, 2])
def test_a_sync_while_asleep_is_served_after_wake(rank1, model_dir, level):
    """The colocated cycle: sleep, train, sync into the sleeping engine, wake, generate: the woken engine
    serves the synced weights (teacher-forced against the model)."""
    engine = build(model_dir, sleep_level=level)
    model = load_model(model_dir).eval()
    engine.generate(requests(1, "before"))
    engine.sleep(level)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.mul_(1.5)
            engine.named_weights()[name].copy_(p)
    engine.version = 1
    engine.wake()
    (r,) = engine.generate(requests(1, "after"))
    assert r.versions == [1] * MAX_NEW
    torch.testing.assert_close(torch.tensor(r.logprobs), teacher_forced(model, r.prompt_ids, r.output_ids), atol=1e-5, rtol=0)
