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

Which dtypes oneDNN takes is asked of this machine, not assumed: one tiny product of each dtype
(packed and plain) runs once per process (`onednn_dtypes`). Whether it is also the faster library
here is measured, not read from the vendor's name: the first product of a dtype times oneDNN
against torch's default (MKL's sgemm) at a training-size and a decode-size product, alternating,
and keeps oneDNN only when it takes no longer over the two (`onednn_chosen`; about 0.1 s). The
verdict is kept per machine (CPU model and flags, torch version, oneDNN's ISA cap, dtype) in
`~/.cache/colorl/kernels.json` (`COLORL_CACHE`), measured by one process at a time under a lock, so
every process on the machine (the ranks of one run too), and a run and its resume, compute with the
same library: bit-exact resumes stay bit-exact. `COLORL_ONEDNN=1`
skips the race and takes oneDNN, `COLORL_ONEDNN=0` never uses it; deleting the file races again.
torch's own bf16 checks read the CPU's flags, but oneDNN can refuse more (an AVX2-only CPU has no bf16 path; `ONEDNN_MAX_CPU_ISA=AVX2`
holds an AVX-512 machine to the same), so a dtype that fails the probe takes torch's kernels.
Everything else (CUDA, float16, a torch without oneDNN, a non-x86 CPU — on Apple silicon torch's
own kernels use the matrix units — or `COLORL_ONEDNN=0`) runs `F.linear` / torch's matmuls.
"""
from __future__ import annotations

import contextlib
import functools
import os
import platform
import time
import types

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


RACE_SHAPES = ((256, 576, 1536), (16, 576, 1536))  # (rows, in, out): a training micro-batch slice, a decode step
RACE_ROUNDS = 5


def median_seconds(products, rounds: int) -> list[float]:
    """Each product's median time over `rounds` alternating runs after one warm-up each: the machine
    is shared, so the contenders take turns and an interruption hits one round, not a verdict."""
    for product in products:
        product()
    times: list[list[float]] = [[] for _ in products]
    for _ in range(rounds):
        for i, product in enumerate(products):
            started = time.perf_counter()
            product()
            times[i].append(time.perf_counter() - started)
    return [sorted(t)[rounds // 2] for t in times]


def race_onednn(dtype: torch.dtype) -> tuple[float, float]:
    """(oneDNN seconds, torch default seconds) over RACE_SHAPES: the median of RACE_ROUNDS alternating
    runs per shape, oneDNN over a packed weight at decode size as the engine runs it."""
    gen = torch.Generator().manual_seed(0)
    totals = [0.0, 0.0]
    for rows, n_in, n_out in RACE_SHAPES:
        x = torch.randn(rows, n_in, generator=gen).to(dtype)
        weight = torch.randn(n_out, n_in, generator=gen).to(dtype)
        with torch.no_grad():
            operand = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT) if rows < 64 else weight
            medians = median_seconds((lambda: torch.ops.mkldnn._linear_pointwise(x, operand, None, "none", [], ""),
                                      lambda: F.linear(x, weight)), RACE_ROUNDS)
        totals = [total + median for total, median in zip(totals, medians)]
    return totals[0], totals[1]


@functools.cache
def onednn_chosen(dtype: torch.dtype) -> bool:
    """colorl sends `dtype`'s CPU products to oneDNN: it runs them here and, unless COLORL_ONEDNN=1,
    was not slower than torch's default in this machine's race (raced once, kept in kernels.json)."""
    if dtype not in onednn_dtypes():
        return False
    if os.environ.get("COLORL_ONEDNN") == "1":
        return True

    def measure() -> dict:
        onednn_s, default_s = race_onednn(dtype)
        return {"onednn": onednn_s <= default_s, "onednn_s": onednn_s, "default_s": default_s}

    return bool(measured_verdict(str(dtype), measure)["onednn"])


def measured_verdict(name: str, measure) -> dict:
    """What `measure()` found on this machine (CPU model and flags, torch), measured once and kept in
    kernels.json: every process here, and a run and its resume, decide the same way."""
    key = f"{machine_key()} {name}"
    verdict = _read_verdicts().get(key)
    if verdict is None:
        with _verdicts_lock():  # the ranks of a run start together: one measures, the others wait and read
            verdicts = _read_verdicts()
            if key not in verdicts:
                verdicts[key] = measure()
                _write_verdicts(verdicts)
            verdict = verdicts[key]
    return verdict


@contextlib.contextmanager
def _verdicts_lock():
    """An exclusive lock on kernels.json's neighbour, held while measuring: two processes that measured
    at once would disturb each other's timings and could decide differently (a two-rank run whose ranks
    round differently). Without a writable cache there is nothing to share, and no lock."""
    import fcntl

    path = _verdicts_path().with_suffix(".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _verdicts_path():
    from colorl.models import cache_root

    return cache_root() / "kernels.json"


def machine_key() -> str:
    """This CPU (model and flags) and torch: what a measured or compiled kernel holds for."""
    import hashlib

    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        info = platform.processor()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2]
    caps = "".join(f" {name}={os.environ[name]}" for name in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
                   if os.environ.get(name))
    return f"{hashlib.sha1(chr(10).join(lines).encode()).hexdigest()[:12]} torch {torch.__version__}{caps}"


def _read_verdicts() -> dict:
    import json

    try:
        return json.loads(_verdicts_path().read_text())
    except (OSError, ValueError):
        return {}


def _write_verdicts(verdicts: dict) -> None:
    """Atomically, so concurrent ranks never read half a file; a cache that cannot be written is skipped."""
    import json

    from colorl.files import write_atomic

    path = _verdicts_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(verdicts, indent=1))
    except OSError:
        pass


def _runs_on_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_AVAILABLE and x.device.type == "cpu" and weight.device.type == "cpu"
            and x.dtype == weight.dtype and onednn_chosen(weight.dtype))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight [out, in].T (+ bias), no autograd: oneDNN on CPU, F.linear elsewhere."""
    if not _runs_on_onednn(x, weight):
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    return torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "").view(*x.shape[:-1], weight.shape[0])


class OneDNNLinear(torch.autograd.Function):
    """F.linear with oneDNN products in forward and backward (same maths, fp32 accumulation)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])  # [N, out]
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = linear(grad_out, weight.t())  # dY W: [..., in]
        if ctx.needs_input_grad[1]:
            grad_weight = linear(grad_flat.t(), x.reshape(-1, x.shape[-1]).t())  # dY^T X: [out, in]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_flat.sum(0)
        return grad_x, grad_weight, grad_bias


def _onednn_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if _runs_on_onednn(x, self.weight):
        return OneDNNLinear.apply(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


def use_onednn_linears(model: torch.nn.Module, device: str | torch.device) -> int:
    """Route every plain nn.Linear of `model` through `OneDNNLinear` when it will run on a CPU
    `device` (inputs of other dtypes still take F.linear).

    Per instance, before FSDP wraps the model: its hooks run around `forward` as before. Returns
    how many modules were switched (0 without oneDNN or off the CPU).
    """
    if not onednn_enabled() or torch.device(device).type != "cpu":
        return 0
    switched = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = types.MethodType(_onednn_forward, module)
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
            return F.linear(x, weight, bias)
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
