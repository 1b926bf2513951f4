"""What `train.mixed_precision: auto` / `engine.dtype: auto` become: explicit settings kept, bf16 only on a CPU
with bf16 products whose race it wins, the race kept per machine; the same on every CPU (the CPU's own answers
are stood in for where they decide)."""
from __future__ import annotations

import platform

import pytest
import torch

from colorl import kernels, precision, verdicts
from colorl.config import load_config


def config(*sets):
    return load_config("configs/tiny.yaml", list(sets))


@pytest.fixture
def raced(monkeypatch, tmp_path):
    """No forced verdict, a fresh verdict cache, and a CPU that runs bf16 products; the race's answer is set
    by the test (`raced.answer`) and each race counted."""
    monkeypatch.delenv("COLORL_BF16", raising=False)
    monkeypatch.setenv("COLORL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(verdicts, "_run_record", None)
    monkeypatch.setattr(kernels, "onednn_dtypes", lambda: frozenset({torch.float32, torch.bfloat16}))
    monkeypatch.setattr(kernels, "onednn_chosen", lambda dtype, use=kernels.SERVING: True)
    monkeypatch.setattr(verdicts, "machine_busy", lambda: False)

    class Race:
        answer = {"won": ["bfloat16"], "busy": False, "seconds": {"bfloat16": [[1.0, 1.8], [1.1, 1.9]]}}
        count = 0

        def __call__(self):
            self.count += 1
            return dict(self.answer)

    race = Race()
    monkeypatch.setattr(precision, "race_bf16_layer", race)
    return race


def test_the_defaults_are_auto_and_explicit_settings_are_kept(monkeypatch):
    cfg = config()
    assert (cfg.train.mixed_precision, cfg.engine.dtype) == ("auto", "auto")
    monkeypatch.setenv("COLORL_BF16", "1")
    assert precision.choose(config("train.mixed_precision=null"), "cpu") == precision.Precision(None, None, "as configured")
    # bf16 compute set by hand: the engine keeps serving the fp32 weights unless engine.dtype says otherwise
    assert precision.choose(config("train.mixed_precision=bfloat16"), "cpu").served is None
    assert precision.choose(config("train.mixed_precision=bfloat16", "engine.dtype=bfloat16"), "cpu").served == "bfloat16"
    # compute left to colorl, serving set: the served dtype stays as set
    assert precision.choose(config("engine.dtype=float32"), "cpu") == precision.Precision(
        "bfloat16", "float32", "auto: forced by COLORL_BF16=1")


def test_forced_and_the_cases_that_never_race(monkeypatch, raced):
    monkeypatch.setenv("COLORL_BF16", "1")
    assert precision.compute_dtype(config(), "cpu") is torch.bfloat16
    assert precision.served_dtype(config(), "cpu") is torch.bfloat16
    monkeypatch.setenv("COLORL_BF16", "0")
    assert precision.compute_dtype(config(), "cpu") is None and precision.served_dtype(config(), "cpu") is torch.float32
    monkeypatch.delenv("COLORL_BF16")
    bf16_weights = precision.choose(config("model.dtype=bfloat16"), "cpu")
    assert (bf16_weights.compute, bf16_weights.served) == (None, None) and "model.dtype=bfloat16" in bf16_weights.why
    on_cuda = precision.choose(config(), "cuda")
    assert (on_cuda.compute, on_cuda.served) == (None, None) and "CUDA" in on_cuda.why
    monkeypatch.setattr(kernels, "onednn_dtypes", lambda: frozenset({torch.float32}))
    no_bf16 = precision.choose(config(), "cpu")
    assert no_bf16.compute is None and "no bf16 matrix products" in no_bf16.why
    assert raced.count == 0


def test_the_race_decides_once_per_machine_and_thread_count(raced):
    won = precision.choose(config(), "cpu")
    assert (won.compute, won.served) == ("bfloat16", "bfloat16")
    assert "1.80x float32" in won.why  # the best float32 pass over the best bf16 pass
    assert raced.count == 1
    precision.choose(config(), "cpu")
    assert raced.count == 1  # kept in the machine's kernels.json
    assert precision.verdict_name(torch.get_num_threads()) in str(verdicts.read_verdicts(verdicts.verdicts_path()))


@pytest.mark.parametrize("answer, why", [
    ({"won": [], "busy": False, "seconds": {"bfloat16": [[1.0, 1.02], [1.0, 1.01]]}}, "not clearly faster"),
    ({"won": [], "busy": True, "seconds": {"bfloat16": [[1.0, 3.0]]}}, "busy machine"),
])
def test_a_lost_or_busy_race_keeps_float32(raced, answer, why):
    raced.answer = answer
    chosen = precision.choose(config(), "cpu")
    assert (chosen.compute, chosen.served) == (None, None) and why in chosen.why
    assert chosen.line("float32").startswith("precision: compute float32, serving float32 (auto: ")


def test_the_real_race_times_a_training_layer_both_ways():
    verdict = precision.race_bf16_layer()
    assert set(verdict["seconds"]) == {"bfloat16"}
    assert all(len(each) == 2 and min(each) > 0 for each in verdict["seconds"]["bfloat16"])
    assert set(verdict["won"]) <= {"bfloat16"}


def test_bf16_products_widened_where_the_cpu_has_no_bf16_instructions(monkeypatch):
    """Without bf16 instructions colorl runs a bf16 product as the float32 product of the same bf16 values, rounded
    once (what a bf16 matrix unit computes): forward, both gradients and the engine's products agree with torch's
    own bf16 kernels to a bf16 rounding; the answer here follows the CPU's own (torch's) bf16 check."""
    from colorl.kernels import OneDNNLinear, PackedLinears, linear

    assert kernels.bf16_widened() == (kernels.onednn_available() and platform.machine().lower() in ("x86_64", "amd64")
                                      and not torch.ops.mkldnn._is_mkldnn_bf16_supported())
    monkeypatch.setattr(kernels, "bf16_widened", lambda: True)  # every CPU takes the widened path here,
    monkeypatch.setattr(kernels, "onednn_chosen", lambda dtype, use=kernels.SERVING: True)  # even one whose oneDNN would take bf16
    gen = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*shape, generator=gen).bfloat16() for shape in ((37, 96), (80, 96), (80,)))
    widened = linear(x, weight, bias)
    assert widened.dtype == torch.bfloat16
    assert torch.equal(widened, linear(x.float(), weight.float(), bias.float()).bfloat16())
    one_rounding = lambda a, b: (a.float() - b.float()).abs().max() <= 2 ** -7 * b.float().abs().max()
    assert one_rounding(widened, torch.nn.functional.linear(x, weight, bias))
    assert torch.equal(PackedLinears(enabled=True).linear(x, weight, bias), widened)
    grads = []
    for product in (lambda a, w: OneDNNLinear.apply(a, w, None), lambda a, w: torch.nn.functional.linear(a, w)):
        a, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        product(a, w).float().square().sum().backward()
        grads.append((a.grad, w.grad))
    assert all(g.dtype == torch.bfloat16 for g in grads[0])
    assert one_rounding(grads[0][0], grads[1][0]) and one_rounding(grads[0][1], grads[1][1])
