"""Decode products over weights the last-level cache holds against weights it does not: why the race streams twice it.

The rows race (colorl.engines.native.cpu_decode.race_rows) picks, per row count, the loops' rows kernel, their
panels or oneDNN/MKL. It used to stream 85 MB of weights, more than most last-level caches hold, but not a
Xeon's 300 MB L3: there a decode step streams its weights from memory while the race read them from the cache,
and kernels rank differently in the two. Side by side in one process, interleaved, best of --rounds: each
kernel's read rate (GB/s) at 1-8 rows over the smallest race size (RACE_MIN_BYTES) and over `race_bytes()`
(twice this CPU's last-level cache), and the fastest kernel at each, over the race's own matrices (RACE_LAYER).

    python bench/race_size.py [--threads 2] [--dtype float32] [--out bench/results/race_size.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ROWS = (1, 2, 4, 8)


def main() -> int:
    from colorl.engines.native import cpu_decode
    from colorl.kernels import PackedLinears
    from colorl.machine import cpu_summary, last_level_cache_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "race_size.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    lib = cpu_decode.load()
    if lib is None:
        print(f"the compiled loops are not available here: {cpu_decode.why_not()}")
        return 1
    cache = last_level_cache_bytes()
    cpu = cpu_summary()
    print(f"{cpu}, last-level cache {cache and cache // 2**20} MiB, {args.threads} threads, {args.dtype}")
    rows_out = []
    for size in dict.fromkeys((cpu_decode.RACE_MIN_BYTES, cpu_decode.race_bytes())):
        weights = cpu_decode.race_weights(dtype, size)
        packed = PackedLinears()
        packed.repack(weights)
        panels = [lib.pack_panels(w) for w in weights]
        for rows in ROWS:
            xs = cpu_decode.race_inputs(rows, dtype)
            kernels = {"rows kernel": cpu_decode.race_products(lambda x, w, _: lib.linear(x, w, None), xs, weights),
                       "panels": cpu_decode.race_products(lambda x, p, w: lib.panel_linear(x, p, w.shape[0], None),
                                                          xs, weights, panels),
                       "oneDNN/MKL": cpu_decode.race_products(lambda x, w, _: packed.linear(x, w, None), xs, weights)}
            best = {name: float("inf") for name in kernels}
            for _ in range(args.rounds):
                for name, run in kernels.items():
                    started = time.perf_counter()
                    run()
                    best[name] = min(best[name], time.perf_counter() - started)
            rates = {name: size / seconds / 1e9 for name, seconds in best.items()}
            fastest = max(rates, key=rates.get)
            rows_out.append({"race_mib": size // 2**20, "rows": rows, "gb_s": rates, "fastest": fastest})
            print(f"over {size // 2**20:5d} MiB, {rows} rows: " + ", ".join(f"{k} {v:5.1f}" for k, v in rates.items())
                  + f" GB/s; fastest: {fastest}")
        del weights, packed, panels
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": str(date.today()), "cpu": cpu, "last_level_cache": cache,
                                    "threads": args.threads, "dtype": args.dtype, "rows": rows_out}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
