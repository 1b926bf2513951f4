"""Decode attention against its memory floor: the compiled loops' paged attention over a whole model's layers.

A decode step's attention reads each sequence's keys and values once per layer; the fastest it can be is those
bytes at the machine's read rate (bench/limits.py, MemoryReader: a sum of 512 MiB, read beside each timing).
Side by side in one process, interleaved, for SmolLM2-135M's shape (30 layers, 9 query heads over 3 KV heads of
64), its KV cache on huge pages as the engine keeps it: the compiled loops (`CpuDecode.paged_decode`, the engine's
path) and, as the baseline, torch's scaled_dot_product_attention over the same keys and values already gathered
into one padded batch (what it needs, its gather not timed). Caches are emptied before each timing by a 256 MiB
read, as the weights' stream empties them between two layers' attention. Median of --rounds; each figure is also
given as a multiple of its floor.

    python bench/attention.py [--threads 2] [--out bench/results/attention.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
SHAPES = ((1, 600), (8, 60), (8, 600), (32, 60), (32, 200))  # (sequences, context tokens)


def main() -> int:
    from colorl.engines.native import cpu_decode
    from colorl.engines.native.host_memory import mapped_empty
    from colorl.machine import cpu_summary
    from limits import MemoryReader  # bench/

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "attention.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lib = cpu_decode.load()
    if lib is None:
        print(f"the compiled loops are not available here: {cpu_decode.why_not()}")
        return 1
    cpu = cpu_summary()
    print(f"{cpu}, {args.threads} threads; {LAYERS} layers of {HEADS} heads over {KV_HEADS} KV heads of {HEAD_DIM}")
    print(f"{'dtype':>8} {'seqs':>4} {'context':>7} {'KV MB':>6} {'floor ms':>8} {'loops ms':>8} {'x floor':>7}"
          f" {'SDPA ms':>8} {'x floor':>7} {'SDPA / loops':>12}")
    reader, evict = MemoryReader(), torch.ones(64 * 2**20)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for seqs, context in SHAPES:
            blocks = (context + BLOCK - 1) // BLOCK
            slots = seqs * blocks * BLOCK
            cache = mapped_empty((LAYERS, slots, 2, KV_HEADS, HEAD_DIM), dtype)
            cache.copy_(torch.randn(LAYERS, slots, 2, KV_HEADS, HEAD_DIM))
            tables = torch.arange(seqs * blocks).view(seqs, blocks)
            lengths = torch.full((seqs,), context, dtype=torch.long)
            q = torch.randn(seqs, HEADS, HEAD_DIM).to(dtype)
            gathered = cache.view(LAYERS, seqs, blocks * BLOCK, 2, KV_HEADS, HEAD_DIM)[:, :, :context]
            keys = gathered[:, :, :, 0].transpose(2, 3).contiguous()  # [layers, seqs, kv heads, context, dim]
            values = gathered[:, :, :, 1].transpose(2, 3).contiguous()
            scale = HEAD_DIM ** -0.5

            def loops():
                for layer in range(LAYERS):
                    lib.paged_decode(q, cache[layer], tables, lengths, BLOCK, scale)

            def sdpa():
                for layer in range(LAYERS):
                    F.scaled_dot_product_attention(q[:, :, None], keys[layer], values[layer], scale=scale,
                                                   enable_gqa=True)

            kv_bytes = LAYERS * seqs * context * 2 * KV_HEADS * HEAD_DIM * dtype.itemsize
            times: dict[str, list[float]] = {"loops": [], "sdpa": [], "floor": []}
            for _ in range(args.rounds):
                for name, run in (("loops", loops), ("sdpa", sdpa)):
                    evict.sum()
                    started = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - started)
                times["floor"].append(kv_bytes / reader.once())
            row = {"dtype": str(dtype).removeprefix("torch."), "sequences": seqs, "context": context,
                   "kv_mb": kv_bytes / 1e6, **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()}}
            row["loops_x_floor"], row["sdpa_x_floor"] = row["loops_ms"] / row["floor_ms"], row["sdpa_ms"] / row["floor_ms"]
            rows.append(row)
            print(f"{row['dtype']:>8} {seqs:4d} {context:7d} {row['kv_mb']:6.1f} {row['floor_ms']:8.2f}"
                  f" {row['loops_ms']:8.2f} {row['loops_x_floor']:6.1f}x {row['sdpa_ms']:8.2f} {row['sdpa_x_floor']:6.1f}x"
                  f" {row['sdpa_ms'] / row['loops_ms']:11.2f}x")
            del cache, keys, values, gathered
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": str(date.today()), "cpu": cpu, "threads": args.threads,
                                    "command": " ".join(["python bench/attention.py", *sys.argv[1:]]), "rows": rows},
                                   indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
