"""The real rank context of a fresh run, built inside a rank process (tests that drive a mode directly)."""
from pathlib import Path


def fresh_rank_context(rank: int, world: int, cfg_dict: dict, run_dir: str):
    import torch.distributed as dist

    from colorl.config import validate
    from colorl.worker import build_context, prepare_run_dir

    cfg = validate(cfg_dict)
    if rank == 0:
        prepare_run_dir(cfg, Path(run_dir), resume=False)
    dist.barrier()
    return build_context(cfg, rank, world, "cpu", Path(run_dir), resume=False)
