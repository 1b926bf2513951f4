"""Matrix products on CPU through oneDNN: the engine's (weights packed once per version) and the
trainer's (every nn.Linear and the LM head, forward and backward).

torch's fp32 `aten::mm` on CPU calls MKL's sgemm, which on AMD processors takes its AVX2 code
path: on this project's AMD EPYC (AVX-512) it reaches 72-90 GFLOP/s per core where oneDNN's fp32
kernels reach about 200, and at decode batch sizes (1-32 rows) the gap is wider still because
MKL re-packs the weight matrix on every call (`python bench/kernels.py`). Both libraries ship
inside torch; oneDNN is reached through `torch.ops.mkldnn._linear_pointwise` (x @ W.T, any
strides), the op torch's own CPU inductor uses for linears.

- Engine: oneDNN wants its own blocked weight layout; reordering on every call would cost more
  than the product at small batch, so each weight is packed once after it changes
  (`PackedLinears.repack`, which the engine runs whenever its version is set, i.e. after every
  weight sync; about 0.3 s for SmolLM2-135M on one core) and the packed copy lives beside the
  plain tensor the checkpoint engine writes into.
- Trainer: `use_onednn_linears` routes a model's nn.Linear modules through `OneDNNLinear`, whose
  backward is two more products of the same op (dX = dY W, dW = dY^T X); at training sizes the
  unpacked weight costs nothing measurable.

The two uses race apart (`SERVING`, `TRAINING`): the engine's products over packed weights at decode
and prefill sizes, and a training layer's forward and backward over plain weights. One verdict does not
decide the other: on a 2-core Zen 3 oneDNN won the serving race by 16 % and lost a training layer by
12-20 % at 256-2048 rows, and its per-shape primitives (a micro-batch's row count changes every call)
left the trainer's kept heap fragmented, growing 0.3-0.5 GB a step where MKL's products held it flat
(bench/README.md, issue 31 item 3).

Which dtypes oneDNN takes is asked of this machine, not assumed: one tiny product of each dtype
(packed and plain) runs once per process (`onednn_dtypes`). Whether it is also the faster library
here is measured, not read from the vendor's name: the first product of a dtype at a thread count
races oneDNN against torch's default (MKL's sgemm) at a training-size and a decode-size product
(colorl/verdicts.py: best of alternating rounds, oneDNN only when clearly faster in every pass, a
verdict taken on a busy machine raced again when it is quiet), kept per machine and thread count in
`~/.cache/colorl/kernels.json` (`COLORL_CACHE`) and in the run directory, so every rank of a run and
its resume compute with the same library: bit-exact resumes stay bit-exact. `COLORL_ONEDNN=1`
skips the race and takes oneDNN, `COLORL_ONEDNN=0` never uses it (the CI lanes force each, so that
both paths are tested on every CPU); deleting the file races again.
torch's own bf16 checks read the CPU's flags, but oneDNN can refuse more (an AVX2-only CPU has no bf16
path; `ONEDNN_MAX_CPU_ISA=AVX2` holds an AVX-512 machine to the same), so a dtype that fails the probe
takes torch's kernels. Everything else (CUDA, float16, a torch without oneDNN, a non-x86 CPU — on Apple
silicon torch's own kernels use the matrix units — or `COLORL_ONEDNN=0`) runs `F.linear` / torch's matmuls.
"""
from __future__ import annotations

import functools
import os
import platform
import types
from typing import Callable

import torch
import torch.nn.functional as F

# oneDNN picks its blocked layout for a typical row count; any row count runs on it.
PACK_ROWS_HINT = 32
_CANDIDATE_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    """oneDNN's linear ops are in this torch and this is an x86 CPU (where MKL is the alternative)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and platform.machine().lower() in ("x86_64", "amd64"))


_AVAILABLE = onednn_available() and os.environ.get("COLORL_ONEDNN", "1") != "0"


def onednn_enabled() -> bool:
    """oneDNN runs at least one dtype here (whether colorl sends it products is `onednn_chosen`)."""
    return bool(onednn_dtypes())


def _product_runs(dtype: torch.dtype) -> bool:
    """One tiny product of `dtype` through both oneDNN ops colorl uses, checked against F.linear."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=gen).to(dtype)
    weight = torch.randn(8, 16, generator=gen).to(dtype)
    try:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
            results = [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in (weight, packed)]
    except RuntimeError:  # "could not create a primitive descriptor", "bf16 path needs ..."
        return False
    expected = F.linear(x.float(), weight.float())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    return all(torch.allclose(r.float(), expected, rtol=tol, atol=tol * expected.abs().max().item()) for r in results)


@functools.cache
def onednn_dtypes() -> frozenset[torch.dtype]:
    """The dtypes whose products colorl sends to oneDNN in this process (probed once)."""
    if not _AVAILABLE:
        return frozenset()
    return frozenset(dtype for dtype in _CANDIDATE_DTYPES if _product_runs(dtype))


SERVING, TRAINING = "serving", "training"  # what a product is for: each use races for itself
RACED = None  # `use` of a race's oneDNN contender: oneDNN whatever the verdicts say
RACE_SHAPES = ((256, 576, 1536), (16, 576, 1536))  # (rows, in, out): a prefill slice, a decode step
TRAIN_RACE_SHAPE = (512, 576, 1536)  # (rows, hidden, intermediate): a training micro-batch slice of SmolLM2's MLP


def race_onednn(dtype: torch.dtype) -> dict:
    """oneDNN (over a packed weight at decode size, as the engine runs it) against torch's default at
    RACE_SHAPES, through colorl.verdicts.stable_race: oneDNN wins only by a margin, in every pass."""
    from colorl.verdicts import stable_race

    gen = torch.Generator().manual_seed(0)
    operands = []
    for rows, n_in, n_out in RACE_SHAPES:
        x = torch.randn(rows, n_in, generator=gen).to(dtype)
        weight = torch.randn(n_out, n_in, generator=gen).to(dtype)
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT) if rows < 64 else weight
        operands.append((x, weight, packed))

    def onednn():
        with torch.no_grad():
            for x, _, packed in operands:
                torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def default():
        with torch.no_grad():
            for x, weight, _ in operands:
                F.linear(x, weight)

    return stable_race({"onednn": (onednn, default)})


def training_layer(dtype: torch.dtype, product: Callable) -> Callable[[], None]:
    """One training layer's forward and backward (x -> up -> SiLU -> down, the weights with gradients) through
    `product(x, weight)`: what a race of the trainer's products times."""
    rows, hidden, intermediate = TRAIN_RACE_SHAPE
    gen = torch.Generator().manual_seed(0)
    shapes = {"x": (rows, hidden), "up": (intermediate, hidden), "down": (hidden, intermediate)}
    tensors = {name: (torch.randn(*shape, generator=gen) * 0.05).to(dtype).requires_grad_(name != "x")
               for name, shape in shapes.items()}

    def run() -> None:
        product(F.silu(product(tensors["x"], tensors["up"])), tensors["down"]).sum().backward()
        for name in ("up", "down"):
            tensors[name].grad = None
    return run


def race_onednn_training(dtype: torch.dtype) -> dict:
    """oneDNN against torch's default over a training layer's forward and backward (`training_layer`), plain
    weights as the trainer's change every step, through colorl.verdicts.stable_race."""
    from colorl.verdicts import stable_race

    # the race runs where a product first asks for its verdict: in bounded-lag mode that can be under the engine's
    # no_grad or inference_mode, where a backward has nothing to run through (a crash at the first step)
    with torch.inference_mode(False), torch.enable_grad():
        onednn = training_layer(dtype, lambda x, weight: OneDNNLinear.apply(x, weight, None, RACED))
        default = training_layer(dtype, F.linear)
        return stable_race({"onednn": (onednn, default)})


def forced_onednn() -> bool | None:
    """COLORL_ONEDNN=1 takes oneDNN for every dtype it runs, =0 never uses it; unset: the race decides."""
    value = os.environ.get("COLORL_ONEDNN", "")
    return {"1": True, "0": False}.get(value)


def onednn_verdict_name(dtype: torch.dtype, threads: int, use: str = SERVING) -> str:
    # serving keeps the name the single verdict had, so the verdicts machines already keep stay valid
    return f"onednn {dtype} at {threads} threads" if use == SERVING else f"onednn {use} {dtype} at {threads} threads"


@functools.cache
def _chosen(dtype: torch.dtype, threads: int, use: str) -> bool:
    from colorl.verdicts import measured_verdict

    race = race_onednn if use == SERVING else race_onednn_training
    verdict = measured_verdict(onednn_verdict_name(dtype, threads, use), lambda: race(dtype), keys=("won",))
    return "onednn" in verdict["won"]


def onednn_chosen(dtype: torch.dtype, use: str = SERVING) -> bool:
    """colorl sends `dtype`'s CPU products for `use` to oneDNN at this thread count: oneDNN runs them here and,
    unless forced (COLORL_ONEDNN), it beat torch's default clearly in this machine's race for that use (kept in
    kernels.json)."""
    if use not in (SERVING, TRAINING):
        raise ValueError(f"use must be {SERVING!r} or {TRAINING!r}, not {use!r}")
    if dtype not in onednn_dtypes():
        return False
    forced = forced_onednn()
    if forced is not None:
        return forced
    return _chosen(dtype, torch.get_num_threads(), use)


def _runs_on_onednn(x: torch.Tensor, weight: torch.Tensor, use: str | None = SERVING) -> bool:
    """Directly, in its dtype (a widened bf16 product reaches oneDNN as a float32 one, if at all)."""
    if not (_AVAILABLE and x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == weight.dtype):
        return False
    chosen = weight.dtype in onednn_dtypes() if use is RACED else onednn_chosen(weight.dtype, use)
    return chosen and not _widens(x, weight)


@functools.cache
def bf16_widened() -> bool:
    """bf16 products run here as float32 products over the same bf16 values, rounded back to bf16 once: an x86
    CPU without bf16 instructions (AVX2-only) has only torch's generic bf16 kernels, 7x slower than its float32
    ones on a Zen 3 (bench/README.md), and a bf16 matrix unit computes the same thing (bf16 inputs, float32
    sums, one rounding of the result): the same numbers, at the float32 rate."""
    return onednn_available() and not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _widens(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dtype == weight.dtype == torch.bfloat16 and x.device.type == "cpu" and bf16_widened()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           use: str | None = SERVING) -> torch.Tensor:
    """x [..., in] @ weight [out, in].T (+ bias), no autograd: oneDNN on CPU where chosen for `use`, F.linear
    elsewhere; bf16 on a CPU without bf16 instructions as float32 products (`bf16_widened`)."""
    if _widens(x, weight):
        wide_bias = None if bias is None else bias.float()
        return linear(x.float(), weight.float(), wide_bias, use).to(torch.bfloat16)
    if not _runs_on_onednn(x, weight, use):
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    return torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "").view(*x.shape[:-1], weight.shape[0])


def training_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` for the trainer's own autograd functions (LM head, lean layers): its products race as training's."""
    return linear(x, weight, bias, TRAINING)


class OneDNNLinear(torch.autograd.Function):
    """F.linear with oneDNN products in forward and backward (same maths, fp32 accumulation)."""

    @staticmethod
    def forward(ctx, x, weight, bias, use=SERVING):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.use = bias is not None, use
        return linear(x, weight, bias, use)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])  # [N, out]
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = linear(grad_out, weight.t(), use=ctx.use)  # dY W: [..., in]
        if ctx.needs_input_grad[1]:
            grad_weight = linear(grad_flat.t(), x.reshape(-1, x.shape[-1]).t(), use=ctx.use)  # dY^T X: [out, in]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_flat.sum(0)
        return grad_x, grad_weight, grad_bias, None


def differentiable_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                          use: str = SERVING) -> torch.Tensor:
    """F.linear with autograd, through `OneDNNLinear` where oneDNN is chosen for `use` or bf16 is widened."""
    if _runs_on_onednn(x, weight, use) or _widens(x, weight):
        return OneDNNLinear.apply(x, weight, bias, use)
    return F.linear(x, weight, bias)


def _linear_forward(use: str):
    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return differentiable_linear(x, self.weight, self.bias, use)
    return forward


def use_onednn_linears(model: torch.nn.Module, device: str | torch.device, use: str = SERVING) -> int:
    """Route every plain nn.Linear of `model` through `differentiable_linear` for `use` (the trainer's modules:
    TRAINING) when it will run on a CPU `device` (inputs of other dtypes still take F.linear).

    Per instance, before FSDP wraps the model: its hooks run around `forward` as before. Returns
    how many modules were switched (0 off the CPU, or without oneDNN where bf16 is not widened).
    """
    if not (onednn_enabled() or bf16_widened()) or torch.device(device).type != "cpu":
        return 0
    switched, forward = 0, _linear_forward(use)
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = types.MethodType(forward, module)
            switched += 1
    return switched


class PackedLinears:
    """The engine's packed copies of its weight matrices, keyed by the parameter they came from."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = _AVAILABLE if enabled is None else enabled
        self._packed: dict[int, tuple[int, torch.Tensor]] = {}  # id(weight) -> (data_ptr, packed)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x: [T, in]; weight: [out, in] (HF layout); returns [T, out]."""
        if not (self.enabled and _runs_on_onednn(x, weight)):
            return linear(x, weight, bias)
        return linear(x, self._lookup(weight), bias)

    def clear(self) -> None:
        """Forget every packed copy (the weights changed); each is packed again when next used."""
        self._packed.clear()

    def repack(self, weights: list[torch.Tensor]) -> None:
        """Pack `weights` again now (their values changed in place)."""
        self.clear()
        for weight in weights:
            if self.enabled and _runs_on_onednn(weight, weight):
                self._lookup(weight)

    def _lookup(self, weight: torch.Tensor) -> torch.Tensor:
        entry = self._packed.get(id(weight))
        if entry is None or entry[0] != weight.data_ptr():  # new, or its storage was replaced
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
            entry = self._packed[id(weight)] = (weight.data_ptr(), packed)
        return entry[1]
