"""Bucket layout: how FSDP2 shards are packed into flat buckets and read back as full tensors.

A parameter of shape [rows, *rest] is sharded by FSDP2 on dim 0 like `torch.chunk`: every rank
owns `chunk_rows = ceil(rows / world)` rows (the last ranks fewer, possibly none). A bucket holds,
for each rank, one contiguous *segment*; all ranks use the same segment layout, so gathering the
segments of every rank (rank-major) gives every rank the same flat bucket:

    gathered bucket  [world * segment_numel]
    = segment of rank 0 | segment of rank 1 | ...
    segment          = piece 0 | piece 1 | ...   (piece = rows [row_start, row_start + row_count)
                                                   of one parameter's rank-local shard, padded)

A rank whose shard has fewer rows leaves the padding rows of its pieces unwritten; unpacking
drops them. A parameter larger than a bucket is split by rows over several buckets, so the
extra memory is bounded by the bucket size, not by the largest tensor.

The layout is computed once at start-up (`plan_buckets`) and is plain data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from colorl.engines.weights import copy_rows


@dataclass(frozen=True)
class ShardedParam:
    """One parameter as FSDP2 shards it: dim 0 split in `world` chunks of `chunk_rows` rows."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    world: int

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def chunk_rows(self) -> int:
        return -(-self.rows // self.world)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_numel * self.dtype.itemsize

    def local_rows(self, rank: int) -> int:
        """Rows of the full tensor held by `rank` (rank r holds [r * chunk_rows, ... + local_rows(r)))."""
        return max(0, min(self.chunk_rows, self.rows - rank * self.chunk_rows))


@dataclass(frozen=True)
class Piece:
    """Rows [row_start, row_start + row_count) of every rank's local shard of one parameter."""

    param: int  # index into the plan's parameter list
    row_start: int
    row_count: int
    offset: int  # element offset inside each rank's segment


@dataclass(frozen=True)
class Bucket:
    dtype: torch.dtype
    world: int
    segment_numel: int  # elements each rank contributes; the gathered bucket has world times as many
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return self.world * self.segment_numel

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class BucketTooSmall(ValueError):
    """`sync.bucket_mb` cannot hold even one row of a parameter from every rank."""


def plan_buckets(params: Sequence[ShardedParam], bucket_bytes: int) -> list[Bucket]:
    """Pack parameters into buckets of at most `bucket_bytes` (gathered size), one dtype per bucket.

    Order is fixed: dtypes in order of first appearance, parameters in the given order. Every rank
    computes the same plan from the same parameter list.
    """
    buckets: list[Bucket] = []
    for dtype in dict.fromkeys(p.dtype for p in params):
        world = params[0].world
        capacity = bucket_bytes // (world * dtype.itemsize)  # elements per rank segment
        pieces: list[Piece] = []
        used = 0
        for index, param in enumerate(params):
            if param.dtype != dtype:
                continue
            if param.row_numel > capacity:
                need_mb = world * param.row_numel * dtype.itemsize / 2**20
                raise BucketTooSmall(
                    f"sync.bucket_mb={bucket_bytes / 2**20:g} cannot hold one row of {param.name} "
                    f"{list(param.shape)} from each of {world} ranks; use at least {need_mb:.3f}"
                )
            row = 0
            while row < param.chunk_rows:
                fit = min((capacity - used) // param.row_numel, param.chunk_rows - row)
                if fit == 0:
                    buckets.append(Bucket(dtype, world, used, tuple(pieces)))
                    pieces, used = [], 0
                    continue
                pieces.append(Piece(index, row, fit, used))
                used += fit * param.row_numel
                row += fit
        if pieces:
            buckets.append(Bucket(dtype, world, used, tuple(pieces)))
    return buckets


def valid_rows(param: ShardedParam, piece: Piece, rank: int) -> int:
    """Rows of `piece` that rank `rank` really holds (the rest is padding)."""
    return max(0, min(piece.row_count, param.local_rows(rank) - piece.row_start))


def pack(bucket: Bucket, params: Sequence[ShardedParam], local: Sequence[torch.Tensor], rank: int,
         segment: torch.Tensor) -> None:
    """Copy this rank's rows of every piece into its segment (`segment`: [segment_numel])."""
    for piece in bucket.pieces:
        param = params[piece.param]
        n = valid_rows(param, piece, rank)
        if n == 0:
            continue
        shard = local[piece.param]
        shard = shard.reshape(1) if shard.dim() == 0 else shard
        dst = segment[piece.offset : piece.offset + n * param.row_numel]
        dst.view(n, *param.shape[1:]).copy_(shard[piece.row_start : piece.row_start + n])


def row_blocks(bucket: Bucket, params: Sequence[ShardedParam],
               gathered: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(param index, first full-tensor row, view [n, *rest] into `gathered`) for every rank's rows."""
    for piece in bucket.pieces:
        param = params[piece.param]
        for rank in range(bucket.world):
            n = valid_rows(param, piece, rank)
            if n == 0:
                continue
            start = rank * bucket.segment_numel + piece.offset
            view = gathered[start : start + n * param.row_numel].view(n, *param.shape[1:])
            yield piece.param, rank * param.chunk_rows + piece.row_start, view


def local_blocks(bucket: Bucket, params: Sequence[ShardedParam],
                 local: Sequence[torch.Tensor]) -> Iterator[tuple[int, int, torch.Tensor]]:
    """World size 1, where gathering is the identity: the pieces' rows straight from the tensors."""
    for piece in bucket.pieces:
        shard = local[piece.param]
        shard = shard.reshape(1) if shard.dim() == 0 else shard
        yield piece.param, piece.row_start, shard[piece.row_start : piece.row_start + piece.row_count]


class Assembler:
    """Turns row blocks into whole tensors for engines that take (name, full tensor) pairs.

    A parameter that arrives whole in one block (world size 1, not split) is handed out as a
    view into the bucket, without a copy; otherwise its rows are copied into a fresh tensor that
    is handed out once its last row has arrived.
    """

    def __init__(self, params: Sequence[ShardedParam]):
        self._params = params
        self._partial: dict[int, tuple[torch.Tensor, int]] = {}  # param -> (tensor, rows received)

    def add(self, index: int, row: int, block: torch.Tensor) -> torch.Tensor | None:
        """Feed one row block of parameter `index`; return the whole tensor once it is complete."""
        param = self._params[index]
        if index not in self._partial and block.shape[0] == param.rows:
            return block.view(param.shape)
        if index in self._partial:
            full, received = self._partial.pop(index)
        else:
            full = block.new_empty(param.rows, *param.shape[1:])
            received = 0
        copy_rows(full, row, block)
        received += block.shape[0]
        if received == param.rows:
            return full.view(param.shape)
        self._partial[index] = (full, received)
        return None
