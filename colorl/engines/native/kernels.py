"""The native engine's projections on CPU: oneDNN matmuls over weights packed once per version.

torch's fp32 `aten::mm` on CPU calls MKL's sgemm, which on AMD processors takes its AVX2 code
path: on this project's AMD EPYC (AVX-512) it reaches 85-90 GFLOP/s per core where oneDNN's fp32
kernels reach about 200, and at decode batch sizes (1-32 rows) the gap is wider still because
MKL re-packs the weight matrix on every call (`python bench/kernels.py`). oneDNN
wants its own blocked weight layout; reordering on every call would cost more than the product
at small batch, so each weight is packed once after it changes (`repack`, which the engine runs
whenever its version is set, i.e. after every weight sync; about 0.3 s for SmolLM2-135M on one
core) and the packed copy lives beside the plain tensor the checkpoint engine writes into.

Everything else (CUDA, float16, a torch without oneDNN) runs `F.linear` on the plain weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# oneDNN picks its blocked layout for a typical row count; any row count runs on it.
PACK_ROWS_HINT = 32
_PACKABLE = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinears:
    """Packed copies of a model's weight matrices, keyed by the parameter they were packed from."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = onednn_available() if enabled is None else enabled
        self._packed: dict[int, tuple[int, torch.Tensor]] = {}  # id(weight) -> (data_ptr, packed)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x: [T, in]; weight: [out, in] (HF layout); returns [T, out]."""
        packed = self._lookup(weight) if self._packs(x, weight) else None
        if packed is None:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def repack(self, weights: list[torch.Tensor]) -> None:
        """Drop every packed copy and pack `weights` again (their values changed in place)."""
        self._packed.clear()
        for weight in weights:
            if self._packs(weight, weight):
                self._lookup(weight)

    def _packs(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (self.enabled and x.device.type == "cpu" and weight.device.type == "cpu"
                and x.dtype == weight.dtype and weight.dtype in _PACKABLE)

    def _lookup(self, weight: torch.Tensor) -> torch.Tensor:
        entry = self._packed.get(id(weight))
        if entry is None or entry[0] != weight.data_ptr():  # new, or its storage was replaced
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
            entry = self._packed[id(weight)] = (weight.data_ptr(), packed)
        return entry[1]
