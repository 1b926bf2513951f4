"""The machine's own limits that the benches hold colorl's figures to: how fast this process reads memory
and how fast it multiplies matrices, per dtype, on its current threads. A ratio against these holds on any
CPU; a ratio against another engine moves with the CPU (issue 31)."""
from __future__ import annotations

import time

import torch


class MemoryReader:
    """Sums of a 512 MiB float32 tensor (pages touched first): what a decode step that reads every weight
    once can reach at best. Kept on the heap's pages and on huge pages (the native engine keeps its weights
    on huge pages where the kernel gives them: host_memory.py); each reading is the faster of the two, so
    that a page size alone can never beat the floor."""

    def __init__(self) -> None:
        from colorl.engines.native.host_memory import mapped_empty

        count = 128 * 2**20
        self.buffers = (torch.ones(count), mapped_empty((count,), torch.float32, huge=True).fill_(1.0))
        for big in self.buffers:
            big.sum()

    def each(self) -> tuple[float, ...]:
        """Bytes/s of one sum of each buffer: heap pages, huge pages."""
        rates = []
        for big in self.buffers:
            started = time.perf_counter()
            big.sum()
            rates.append(big.nbytes / (time.perf_counter() - started))
        return tuple(rates)

    def once(self) -> float:
        """Bytes/s of one sum of each buffer, the faster: a reading short enough (about a decode step's time)
        to take between two steps, so a step and its floor see the same neighbours on a shared machine."""
        return max(self.each())

    def over(self, seconds: float) -> float:
        """Bytes/s over `seconds` of alternating sums, per buffer, the faster."""
        done, spent = [0] * len(self.buffers), [0.0] * len(self.buffers)
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or not all(done):
            for i, big in enumerate(self.buffers):
                started = time.perf_counter()
                big.sum()
                done[i] += 1
                spent[i] += time.perf_counter() - started
        return max(n * self.buffers[0].nbytes / t for n, t in zip(done, spent))


def read_bandwidth(seconds: float = 1.0) -> float:
    """Bytes/s of summing 512 MiB over `seconds` (MemoryReader): the memory floor's rate."""
    return MemoryReader().over(seconds)


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
