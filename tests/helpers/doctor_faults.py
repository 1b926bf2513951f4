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


def _one_ulp_up(tensor) -> None:
    with torch.no_grad():
        tensor.view(-1)[:1] = torch.nextafter(tensor.view(-1)[:1], torch.tensor(float("inf"), dtype=tensor.dtype))


def corrupt_served(engine, name: str) -> None:
    """One value of the engine's own weight `name` one ulp up: vLLM's model in its worker (vLLM names),
    the SGLang stand-in's scheduler model; never the copy a sync writes into."""
    if hasattr(engine, "_llm"):
        engine._llm.apply_model(lambda model: _one_ulp_up(dict(model.named_parameters())[name]))
    else:
        _one_ulp_up(dict(engine._engine.model.named_parameters())[name])


def rank_with_corrupt_engine(rank, world, *args, name: str = "model.norm.weight", standin: bool = False):
    """After the sync to version 2 the engine's own weight `name` is one ulp off, its sync copy intact:
    what an engine that did not take the weights (or a stale kernel) looks like. `standin`: the
    rank's `import sglang` finds the CPU stand-in."""
    from colorl.sync.verify import SyncVerifier

    if standin:
        import pytest
        from standin_rank import load_standin

        load_standin().install(pytest.MonkeyPatch())

    check = SyncVerifier.check

    def check_corrupted(self, engine, expected, version):
        if version == 2:
            corrupt_served(engine, name)
        check(self, engine, expected, version)

    SyncVerifier.check = check_corrupted
    checked_rank(rank, world, *args)
