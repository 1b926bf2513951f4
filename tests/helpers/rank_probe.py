"""Rank functions that report what a launched rank runs with (spawned ranks import this by name)."""
from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

MKL_CBWR_STRICT = 0x10000  # mkl_cbwr.h
MKL_CBWR_ALL = -1


def mkl_reproducibility(rank: int, world: int, out: str) -> None:
    """Writes this rank's MKL conditional-numerical-reproducibility mode, read after a first product."""
    import torch

    torch.randn(64, 64) @ torch.randn(64, 64)
    library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    get = library.mkl_serv_cbwr_get
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    Path(out, f"rank{rank}.json").write_text(json.dumps({"cbwr": get(MKL_CBWR_ALL)}))


def collective_then_atexit(rank: int, world: int, out: str) -> None:
    """An all-reduce over a tensor Python made, then an atexit handler that writes a file: a rank leaves
    without the interpreter's finalization (colorl.distributed.exit_rank) and must still run it."""
    import atexit

    import torch
    import torch.distributed as dist

    total = torch.ones(4) * (rank + 1)
    dist.all_reduce(total)
    atexit.register(lambda: Path(out, f"rank{rank}.atexit").write_text(str(total.sum().item())))
