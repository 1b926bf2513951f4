"""The machine's own limits that the benches hold colorl's figures to: how fast this process reads memory
and how fast it multiplies matrices, per dtype, on its current threads. A ratio against these holds on any
CPU; a ratio against another engine moves with the CPU (issue 31)."""
from __future__ import annotations

import time

import torch


def read_bandwidth(seconds: float = 1.0) -> float:
    """Bytes/s of summing a 512 MiB float32 tensor (pages touched first): what a decode step that reads
    every weight once can reach at best."""
    big = torch.ones(128 * 2**20)
    big.sum()
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        big.sum()
        done += 1
    return done * big.nbytes / (time.perf_counter() - started)


def matmul_rate(seconds: float = 1.0, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of a large `dtype` matmul with the fastest of torch's kernels (MKL's or oneDNN's `aten::mm`,
    oneDNN over a packed weight: AMX or AVX512-BF16 for bf16 where the CPU has them) and colorl's products
    (bf16 on a CPU without bf16 instructions: float32 products over the bf16 values, `kernels.bf16_widened`,
    where torch's generic bf16 kernels are far slower): the compute ceiling."""
    from colorl import kernels

    a, b = torch.randn(2048, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
    products = [lambda: kernels.linear(a, b)]
    if not (dtype == torch.bfloat16 and kernels.bf16_widened()):  # torch's generic bf16 there: minutes a product
        products.append(lambda: a @ b)
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(b, 32)
            torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
            products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
        except RuntimeError:  # oneDNN has no path for this dtype on this CPU
            pass
    best = 0.0
    for product in products:
        product()
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            product()
            done += 1
        best = max(best, done * 2 * 2048**3 / (time.perf_counter() - started))
    return best
