"""A doctor rank whose weight sync delivers one wrong bit, for tests/test_doctor.py (spawned ranks import it)."""
import torch

from colorl.doctor import checked_rank


def rank_with_corrupt_sync(rank, world, *args):
    """In the sync to version 2 the first row block arrives one ulp off: what a broken transfer looks like."""
    from colorl.sync import checkpoint_engine

    copy_rows, sync = checkpoint_engine.copy_rows, checkpoint_engine.CheckpointEngine.sync
    corrupt = []

    def corrupting_copy(target, row, block):
        if corrupt and corrupt.pop():
            block = torch.nextafter(block, torch.full_like(block, float("inf")))
        copy_rows(target, row, block)

    def sync_marked(self, engine, version):
        corrupt[:] = [version == 2]
        return sync(self, engine, version)

    checkpoint_engine.copy_rows = corrupting_copy
    checkpoint_engine.CheckpointEngine.sync = sync_marked
    checked_rank(rank, world, *args)
