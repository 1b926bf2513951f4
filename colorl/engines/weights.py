"""Writing into an engine's live weight tensors in place, fast whatever their memory layout."""
from __future__ import annotations

import torch

TILE_BYTES = 512 * 1024


def copy_rows(target: torch.Tensor, row: int, block: torch.Tensor) -> None:
    """Write a row block into rows [row, row + len(block)) of a full-shape tensor, in place.

    An engine may keep a weight transposed ([in, out]): one strided copy then walks the whole
    block column by column, several times slower than slices of TILE_BYTES, which stay in cache.
    """
    if target.dim() == 0:
        target.copy_(block.view(()))
        return
    dst = target.narrow(0, row, block.shape[0])
    if dst.dim() < 2 or dst.stride(0) >= max(dst.stride()[1:]):
        dst.copy_(block)
        return
    step = max(1, TILE_BYTES // max(1, block[:1].nbytes))
    for start in range(0, block.shape[0], step):
        dst[start : start + step].copy_(block[start : start + step])
