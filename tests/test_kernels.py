"""colorl/kernels.py: the oneDNN products equal torch's, values and gradients, and each dtype
takes oneDNN only where this machine's oneDNN really runs it and was measured the faster here."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from colorl import kernels
from colorl.kernels import PACK_ROWS_HINT, OneDNNLinear, linear, onednn_available, onednn_dtypes, onednn_enabled, use_onednn_linears
from colorl.machine import machine_key

pytestmark = pytest.mark.skipif(not onednn_enabled(), reason="oneDNN off (not in this torch, not x86, or COLORL_ONEDNN=0)")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_matches_f_linear_forward_and_backward(dtype, tol, bias):
    """Where oneDNN refuses `dtype` (bf16 on an AVX2-only CPU) the same call runs torch's kernels."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 37, 24, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(40, 24, generator=gen).to(dtype).requires_grad_()
    b = torch.randn(40, generator=gen).to(dtype).requires_grad_() if bias else None
    grad = torch.randn(3, 37, 40, generator=gen).to(dtype)
    inputs = (x, w) + ((b,) if bias else ())
    expected = torch.nn.functional.linear(x, w, b)
    expected_grads = torch.autograd.grad(expected, inputs, grad)
    got = OneDNNLinear.apply(x, w, b)
    got_grads = torch.autograd.grad(got, inputs, grad)
    rel = lambda a, e: ((a.float() - e.float()).abs().max() / e.float().abs().max()).item()  # noqa: E731
    assert rel(got, expected) < tol
    for g, e in zip(got_grads, expected_grads):
        assert g.shape == e.shape and rel(g, e) < tol


def test_frozen_weight_gets_no_gradient_and_strided_operands_work():
    x = torch.randn(16, 8).t().requires_grad_()  # [8, 16], non-contiguous
    w = torch.randn(16, 12).t()  # [12, 16] view: frozen
    out = OneDNNLinear.apply(x, w, None)
    (gx,) = torch.autograd.grad(out.sum(), (x,))
    assert torch.allclose(out, x @ w.t(), atol=1e-5) and torch.allclose(gx, torch.ones(8, 12) @ w, atol=1e-5)
    assert torch.allclose(linear(x.detach(), w), x.detach() @ w.t(), atol=1e-5)


def test_use_onednn_linears_switches_plain_linears_and_keeps_training_exact():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 3))
    reference = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 3))
    reference.load_state_dict(model.state_dict())
    assert use_onednn_linears(model, "meta") == 0  # not a CPU run: nothing switched
    assert use_onednn_linears(model, "cpu") == 2
    x = torch.randn(7, 10)
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_says_what_onednn_really_runs(dtype):
    """A dtype is routed to oneDNN exactly when oneDNN's packed and plain products run for it here."""
    x, weight = torch.randn(2, 16).to(dtype), torch.randn(8, 16).to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        runs = True
    except RuntimeError:
        runs = False
    assert (dtype in onednn_dtypes()) == runs


@pytest.mark.skipif(not onednn_available(), reason="no oneDNN linear ops in this torch or not an x86 CPU")
def test_onednn_held_to_avx2_keeps_fp32_and_gives_bf16_to_torch():
    """An AVX-512 machine held to AVX2 answers like an AVX2-only CPU: no bf16 path in oneDNN, and a bf16
    product still runs (torch's kernels) and matches fp32."""
    code = ("import torch; from colorl.kernels import onednn_dtypes, linear; torch.manual_seed(0);"
            "x, w = torch.randn(5, 32), torch.randn(12, 32);"  # seeded: unseeded draws crossed 0.1 now and then
            "err = (linear(x.bfloat16(), w.bfloat16()).float() - linear(x, w)).abs().max().item();"
            "print(sorted(str(d) for d in onednn_dtypes()), err < 0.1)")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "COLORL_ONEDNN": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['torch.float32']", "True"]


@pytest.fixture
def fresh_choice(monkeypatch, tmp_path):
    monkeypatch.delenv("COLORL_ONEDNN", raising=False)
    monkeypatch.setenv("COLORL_CACHE", str(tmp_path))  # no verdict kept yet
    kernels._chosen.cache_clear()
    yield
    kernels._chosen.cache_clear()


def verdict_of(won: bool) -> dict:
    return {"won": ["onednn"] if won else [], "busy": False, "seconds": {"onednn": [[1.0, 2.0 if won else 0.5]] * 2}}


@pytest.mark.parametrize("chosen", [True, False])
def test_the_library_this_cpu_measures_faster_does_the_products(fresh_choice, monkeypatch, chosen):
    monkeypatch.setattr(kernels, "race_onednn", lambda dtype: verdict_of(chosen))
    assert kernels.onednn_chosen(torch.float32) is chosen
    x, weight = torch.randn(5, 16), torch.randn(8, 16)
    assert kernels._runs_on_onednn(x, weight) is chosen
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight), rtol=1e-4, atol=1e-4)


def test_serving_and_training_race_apart(fresh_choice, monkeypatch, tmp_path):
    """The engine's products (packed, decode sizes) and a training layer's (plain weights, forward and backward)
    are raced and kept apart: oneDNN can win one and lose the other (a Zen 3 at 2 threads: won serving by 16 %,
    lost training by 12-20 %). The trainer's modules, LM head and lean layers follow the training verdict."""
    monkeypatch.setattr(kernels, "race_onednn", lambda dtype: verdict_of(True))
    monkeypatch.setattr(kernels, "race_onednn_training", lambda dtype: verdict_of(False))
    assert kernels.onednn_chosen(torch.float32) and not kernels.onednn_chosen(torch.float32, kernels.TRAINING)
    assert sorted(json.loads((tmp_path / "kernels.json").read_text())) == sorted(
        f"{machine_key()} {kernels.onednn_verdict_name(torch.float32, torch.get_num_threads(), use)}"
        for use in (kernels.SERVING, kernels.TRAINING))
    calls = []
    monkeypatch.setattr(kernels.OneDNNLinear, "apply", lambda *args: calls.append(args[-1]) or F.linear(*args[:3]))
    trained, served = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
    assert use_onednn_linears(trained, "cpu", kernels.TRAINING) == use_onednn_linears(served, "cpu") == 1
    x = torch.randn(5, 16)
    trained(x).sum().backward()
    assert calls == [] and trained.weight.grad is not None  # torch's default products, with autograd
    served(x)
    assert calls == [kernels.SERVING]
    assert kernels._runs_on_onednn(x, served.weight) and not kernels._runs_on_onednn(x, served.weight, kernels.TRAINING)
    assert kernels._runs_on_onednn(x, served.weight, kernels.RACED)  # a race's contender runs oneDNN regardless
    with pytest.raises(ValueError, match="use must be"):
        kernels.onednn_chosen(torch.float32, "inference")


def test_the_verdict_is_kept_for_every_later_process(fresh_choice, monkeypatch, tmp_path):
    """A run and its resume (and every rank) compute with the same library: raced once per machine."""
    monkeypatch.setattr(kernels, "race_onednn", lambda dtype: verdict_of(False))
    assert not kernels.onednn_chosen(torch.float32)
    kernels._chosen.cache_clear()  # as a new process would start

    def no_race(dtype):
        raise AssertionError("raced again")

    monkeypatch.setattr(kernels, "race_onednn", no_race)
    assert not kernels.onednn_chosen(torch.float32)
    (verdict,) = json.loads((tmp_path / "kernels.json").read_text()).values()
    assert {k: v for k, v in verdict.items() if k != "measured"} == verdict_of(False)


def test_the_verdict_is_kept_per_thread_count(fresh_choice, monkeypatch):
    """bounded-lag runs its loops at other thread counts than a colocated step: each races for itself."""
    raced = []
    monkeypatch.setattr(kernels, "race_onednn",
                        lambda dtype: raced.append(torch.get_num_threads()) or verdict_of(torch.get_num_threads() == 1))
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 1, 2):
            torch.set_num_threads(count)
            assert kernels.onednn_chosen(torch.float32) is (count == 1)
    finally:
        torch.set_num_threads(threads)
    assert raced == [1, 2]


@pytest.mark.parametrize("forced", ["0", "1"])
def test_colorl_onednn_forces_either_verdict_without_a_race(fresh_choice, monkeypatch, forced):
    def no_race(dtype):
        raise AssertionError("raced")

    monkeypatch.setenv("COLORL_ONEDNN", forced)
    monkeypatch.setattr(kernels, "race_onednn", no_race)
    assert kernels.onednn_chosen(torch.float32) is (forced == "1")
    x, weight = torch.randn(5, 16), torch.randn(8, 16)
    assert kernels._runs_on_onednn(x, weight) is (forced == "1")


_MEASURE_AS_THIS_PROCESS = """
import os, time
from colorl.verdicts import measured_verdict
def measure():
    time.sleep(0.5)  # long enough that the processes started together all ask before any has written
    return {"measured_by": os.getpid()}
print(measured_verdict("test verdict", measure)["measured_by"])
"""


def test_processes_that_ask_at_once_take_one_verdict(tmp_path):
    """The ranks of a run start together: had each kept its own measurement, two ranks could compute
    with different kernels and round differently (a two-rank run would not resume bit-exactly)."""
    env = {**os.environ, "COLORL_CACHE": str(tmp_path)}
    processes = [subprocess.Popen([sys.executable, "-c", _MEASURE_AS_THIS_PROCESS], env=env, stdout=subprocess.PIPE, text=True)
                 for _ in range(3)]
    answers = {p.communicate(timeout=120)[0].strip() for p in processes}
    assert len(answers) == 1 and answers <= {str(p.pid) for p in processes}


def test_a_capped_instruction_set_is_measured_apart(fresh_choice, monkeypatch):
    """`ONEDNN_MAX_CPU_ISA=AVX2` runs other kernels than the uncapped machine: its own verdict."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    from colorl.machine import machine_key

    uncapped = machine_key()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert machine_key() != uncapped


def test_the_training_race_times_a_layer_forward_and_backward_both_ways():
    verdict = kernels.race_onednn_training(torch.float32)
    assert set(verdict["seconds"]) == {"onednn"} and set(verdict["won"]) <= {"onednn"}
    assert all(0 < seconds < 5 for passes in verdict["seconds"]["onednn"] for seconds in passes)
    onednn, default = (kernels.training_layer(torch.float32, product) for product in
                       (lambda x, w: kernels.OneDNNLinear.apply(x, w, None, kernels.RACED), F.linear))
    onednn(), default()  # both contenders run forward and backward to the end


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_the_training_race_runs_wherever_it_is_first_asked_for(context):
    """A product asks for its verdict where it first runs: on a machine busy at an earlier race, that was under the
    engine's no_grad in a bounded-lag run (a crash at its first step); the race times a backward all the same."""
    with context():
        verdict = kernels.race_onednn_training(torch.float32)
    assert set(verdict["seconds"]) == {"onednn"}


def test_the_race_times_both_libraries_at_both_shapes():
    verdict = kernels.race_onednn(torch.float32)
    assert set(verdict["seconds"]) == {"onednn"} and set(verdict["won"]) <= {"onednn"}
    assert all(0 < seconds < 5 for passes in verdict["seconds"]["onednn"] for seconds in passes)