"""Bucket layout and packing, with the all-gather simulated by concatenating every rank's segment."""
from __future__ import annotations

import pytest
import torch

from colorl.engines import weights
from colorl.sync.buckets import (
    Assembler, BucketTooSmall, ShardedParam, local_blocks, pack, plan_buckets, row_blocks,
)

SHAPES = [(259, 45), (45,), (16, 45), (7, 3, 5), (1, 9), (2,), (37, 45)]  # rows < world, odd sizes, 3-D


def make_tensors(world, dtypes=(torch.float32,)):
    gen = torch.Generator().manual_seed(world)
    tensors = []
    for i, shape in enumerate(SHAPES):
        dtype = dtypes[i % len(dtypes)]
        tensors.append(torch.randn(shape, generator=gen).to(dtype))
    params = [ShardedParam(f"p{i}", tuple(t.shape), t.dtype, world) for i, t in enumerate(tensors)]
    return params, tensors


def local_shard(param: ShardedParam, full: torch.Tensor, rank: int) -> torch.Tensor:
    """What FSDP2 keeps on `rank`: torch.chunk's piece of dim 0 (possibly empty)."""
    start = min(rank * param.chunk_rows, param.rows)
    return full[start : start + param.local_rows(rank)]


def gather(bucket, params, tensors, world) -> torch.Tensor:
    """Every rank packs its segment; the all-gather is their concatenation in rank order."""
    segments = []
    for rank in range(world):
        segment = torch.full((bucket.segment_numel,), float("nan")).to(bucket.dtype)  # padding stays NaN
        pack(bucket, params, [local_shard(p, t, rank) for p, t in zip(params, tensors)], rank, segment)
        segments.append(segment)
    return torch.cat(segments)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("bucket_bytes", [2_000, 40_000, 10**9])
def test_every_row_of_every_rank_lands_once(world, bucket_bytes):
    params, tensors = make_tensors(world, dtypes=(torch.float32, torch.bfloat16))
    buckets = plan_buckets(params, bucket_bytes)
    targets = [torch.full_like(t, float("nan")) for t in tensors]
    written = [torch.zeros(p.rows, dtype=torch.int64) for p in params]
    for bucket in buckets:
        for index, row, block in row_blocks(bucket, params, gather(bucket, params, tensors, world)):
            weights.copy_rows(targets[index], row, block)
            written[index][row : row + block.shape[0]] += 1
    for target, full, count in zip(targets, tensors, written):
        assert torch.equal(target.view(torch.int16 if full.dtype == torch.bfloat16 else torch.int32),
                           full.view(torch.int16 if full.dtype == torch.bfloat16 else torch.int32))
        assert torch.all(count == 1)


def test_buckets_hold_one_dtype_in_fixed_order_within_the_size():
    params, _ = make_tensors(2, dtypes=(torch.float32, torch.bfloat16))
    buckets = plan_buckets(params, 3_000)
    assert all(b.nbytes <= 3_000 for b in buckets)
    dtypes = [b.dtype for b in buckets]
    assert dtypes == sorted(dtypes, key=[torch.float32, torch.bfloat16].index)  # fp32 first: seen first
    for bucket in buckets:
        assert {params[p.param].dtype for p in bucket.pieces} == {bucket.dtype}
    assert plan_buckets(params, 3_000) == buckets  # deterministic: every rank computes the same


def test_a_tensor_larger_than_the_bucket_is_split_by_rows():
    param = ShardedParam("big", (100, 7), torch.float32, 2)
    buckets = plan_buckets([param], 10 * 7 * 4 * 2)  # ten rows from each of two ranks
    assert len(buckets) == 5
    assert [p.row_start for b in buckets for p in b.pieces] == [0, 10, 20, 30, 40]
    full = torch.randn(100, 7)
    assembler = Assembler([param])
    done = [t for b in buckets for i, row, blk in row_blocks(b, [param], gather(b, [param], [full], 2))
            if (t := assembler.add(i, row, blk)) is not None]
    assert len(done) == 1 and torch.equal(done[0], full)


def test_bucket_too_small_for_one_row_names_the_tensor():
    with pytest.raises(BucketTooSmall, match="wide"):
        plan_buckets([ShardedParam("wide", (4, 1000), torch.float32, 2)], 4_000)


def test_assembler_hands_out_whole_blocks_without_copying():
    param = ShardedParam("w", (6, 4), torch.float32, 1)
    bucket, = plan_buckets([param], 10**6)
    flat = torch.arange(24, dtype=torch.float32)
    (index, row, block), = row_blocks(bucket, [param], flat)
    whole = Assembler([param]).add(index, row, block)
    assert whole.data_ptr() == flat.data_ptr() and whole.shape == (6, 4)


def test_world_one_blocks_are_the_tensors_themselves():
    params, tensors = make_tensors(1)
    for bucket in plan_buckets(params, 2_000):
        for index, row, block in local_blocks(bucket, params, tensors):
            assert block.data_ptr() == tensors[index][row:].data_ptr()


def test_rows_land_in_a_transposed_engine_weight_tile_by_tile(monkeypatch):
    """The native engine keeps [in, out] storage; copies into it go in cache-sized row slices."""
    monkeypatch.setattr(weights, "TILE_BYTES", 3 * 7 * 4)  # three rows of 7 floats per slice
    full = torch.randn(20, 7)
    target = torch.zeros(7, 20).t()  # [20, 7] with strides (1, 20)
    weights.copy_rows(target, 0, full[:11])
    weights.copy_rows(target, 11, full[11:])
    assert torch.equal(target, full)
