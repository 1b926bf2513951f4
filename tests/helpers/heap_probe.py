"""Run with a CPU rank's allocator settings (launch.CPU_RANK_ENV): frees 256 MiB of touched heap, then
prints JSON of the resident size after the free, after `HeapKeeper(slack).settle()`, and whether it
trimmed; `mapped` instead frees the same bytes from `host_memory.mapped_empty`."""
import json
import sys

import torch

from colorl.engines.native.host_memory import mapped_empty
from colorl.heap import HeapKeeper, resident_bytes

MiB = 2**20
kind, slack = sys.argv[1], int(sys.argv[2]) * MiB
keeper = HeapKeeper(slack)
keeper.settle()  # the floor: nothing freed yet
before = resident_bytes()
block = mapped_empty((64 * MiB,), torch.float32) if kind == "mapped" else torch.empty(64 * MiB, dtype=torch.float32)
block.fill_(1.0)  # 256 MiB touched
del block
freed = resident_bytes()
trimmed = keeper.settle()
print(json.dumps({"before": before, "freed": freed, "settled": resident_bytes(), "trimmed": trimmed}))
