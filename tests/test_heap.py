"""A CPU rank's kept heap, bounded: freed memory stays resident up to a slack, past it goes back to the OS;
the engine's per-step storage never enters the heap. Real processes with `colorl train`'s allocator
settings, real resident sizes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from colorl.heap import _malloc_trim
from colorl.launch import CPU_RANK_ENV

PROBE = str(Path(__file__).parent / "helpers" / "heap_probe.py")
MiB = 2**20

pytestmark = pytest.mark.skipif(_malloc_trim() is None, reason="no glibc malloc_trim here")


def probe(kind: str, slack_mib: int) -> dict:
    env = {**os.environ, **CPU_RANK_ENV}
    out = subprocess.run([sys.executable, PROBE, kind, str(slack_mib)], env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_heap_whose_holes_are_reused_is_kept_and_growth_past_the_slack_goes_back():
    sizes = probe("heap", 128)
    assert sizes["first"] - sizes["before"] > 200 * MiB  # the kept heap holds the first micro-batch's 256 MiB
    assert sizes["reused"] - sizes["first"] < 32 * MiB  # the second fits the hole: no growth, no trim
    assert sizes["trims"][:2] == [False, False]
    assert sizes["grown"] - sizes["first"] > 400 * MiB  # the third did not fit: the heap grew by its 512 MiB
    assert sizes["trims"][2] and sizes["settled"] - sizes["before"] < 64 * MiB  # ... and every free page went back


def test_growth_within_the_slack_stays_for_the_next_allocation():
    sizes = probe("heap", 1024)
    assert sizes["grown"] - sizes["first"] > 400 * MiB
    assert sizes["trims"] == [False, False, False] and sizes["settled"] - sizes["before"] > 600 * MiB


def test_the_engines_mapped_storage_goes_back_when_freed_without_a_trim():
    sizes = probe("mapped", 1024)
    assert not sizes["trimmed"] and sizes["freed"] - sizes["before"] < 32 * MiB


def test_where_memory_comes_first_a_large_block_goes_back_when_freed_and_a_small_one_is_kept():
    """colorl/heap.py: `map_large_blocks`, as a trainer with activation checkpointing asks for it."""
    sizes = probe("large", 1024)
    assert sizes["apart"] and not sizes["trimmed"]
    assert sizes["large_freed"] - sizes["before"] < 32 * MiB  # 256 MiB in one block, mapped apart: given back
    assert sizes["small_freed"] - sizes["large_freed"] > 12 * MiB  # 16 MiB stays in the kept heap, resident
