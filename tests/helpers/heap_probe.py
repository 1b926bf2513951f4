"""Run with a CPU rank's allocator settings (launch.CPU_RANK_ENV) as a trainer's loop would use the heap, and
print JSON of resident sizes and whether `HeapKeeper(slack)` trimmed.

- `heap`: a micro-batch touches 256 MiB and frees it (the keeper's reference); the next touches 240 MiB (it fits
  the hole); then one touches 512 MiB while a small block pinned above the first hole keeps it apart (it cannot
  fit: the heap grows).
- `mapped`: the same 256 MiB from `host_memory.mapped_empty`, freed.
- `large`: a keeper that maps large blocks apart; a micro-batch touches 256 MiB in one block, then 16 MiB.
"""
import json
import sys

import torch

from colorl.engines.native.host_memory import mapped_empty
from colorl.heap import HeapKeeper, resident_bytes

MiB = 2**20
kind, slack = sys.argv[1], int(sys.argv[2]) * MiB
keeper = HeapKeeper(slack, large_blocks_apart=kind == "large")
before = resident_bytes()


def micro_batch(mib: int, pin: bool = False):
    """Touch `mib` MiB of heap and free it; with `pin`, a small block allocated after it stays."""
    block = torch.empty(mib * MiB // 4, dtype=torch.float32)
    block.fill_(1.0)
    pinned = torch.ones(1024) if pin else None
    del block
    return pinned


if kind == "mapped":
    block = mapped_empty((64 * MiB,), torch.float32)
    block.fill_(1.0)
    del block
    freed = resident_bytes()
    print(json.dumps({"before": before, "freed": freed, "trimmed": keeper.settle()}))
    sys.exit()
if kind == "large":
    pinned = micro_batch(256, pin=True)
    large_freed = resident_bytes()
    small = micro_batch(16, pin=True)
    print(json.dumps({"apart": keeper.large_blocks_apart, "before": before, "large_freed": large_freed,
                      "small_freed": resident_bytes(), "trimmed": keeper.settle()}))
    sys.exit()
pinned = micro_batch(256, pin=True)
first = resident_bytes()
trims = [keeper.settle()]  # the reference: the heap refilled by one micro-batch
micro_batch(240)
reused = resident_bytes()
trims.append(keeper.settle())
micro_batch(512)
grown = resident_bytes()
trims.append(keeper.settle())
print(json.dumps({"before": before, "first": first, "reused": reused, "grown": grown, "settled": resident_bytes(),
                  "trims": trims}))
