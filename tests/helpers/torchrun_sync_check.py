"""One torchrun rank of a short colocated run, then a check that its engine holds the trainer's weights.

Run by tests/test_torchrun.py as `torchrun ... torchrun_sync_check.py CONFIG RUN_DIR OUT_DIR`: the
rank runs through colorl's own torchrun path (`run_in_place`, `build_context`, the mode's loop)
and writes OUT_DIR/rank{R}.json with its node, the checkpoint engine's transport, the steps
done and how many engine weights differ from the trainer's full weights (0 expected).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from colorl.config import load_config
from colorl.distributed import exit_rank
from colorl.launch import TorchrunRank, run_in_place
from colorl.modes import MODES
from colorl.sync.name_maps import name_map_for
from colorl.worker import StopRequest, build_context, prepare_run_dir


def check(rank: int, world: int, config: str, run_dir: str, out_dir: str, node: int) -> None:
    cfg = load_config(config, [f"launch.nproc={world}"])
    ctx = build_context(cfg, rank, world, "cpu", Path(run_dir), resume=False)
    MODES[cfg.mode](ctx, StopRequest())
    engine = ctx.engine.named_weights()
    name_map = name_map_for(ctx.trainer.model.config.model_type)
    differing = []
    with torch.no_grad():
        for name, p in ctx.trainer.model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            if not torch.equal(engine[name_map.engine_name(name)], full):
                differing.append(name)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "node": node, "transport": ctx.weight_sync.transport, "steps": ctx.state.step,
        "engine_version": ctx.engine.version, "differing": differing}))


def main() -> int:
    config, run_dir, out_dir = sys.argv[1:4]
    spot = TorchrunRank.from_env()
    cfg = load_config(config, [f"launch.nproc={spot.world}"])
    return run_in_place(spot, check, "cpu", (config, run_dir, out_dir, spot.node), 120,
                        prepare=lambda: prepare_run_dir(cfg, Path(run_dir), False))


if __name__ == "__main__":
    exit_rank(main())  # as `colorl train` under torchrun leaves: never through the interpreter's finalization
