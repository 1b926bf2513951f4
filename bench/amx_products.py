"""bf16 decode products on AMX tiles against the FMA loops, the rows kernel and torch's F.linear, at the memory floor.

Baseline: a plain `sum` over as many bytes as the weights (the memory floor: no product can read its weights
faster), and torch's bf16 F.linear (oneDNN; on AMX it lays the weights out again on every call). Against them,
over the same 60 bf16 [1536, 576] matrices (106 MB, more than a cache holds), in one process, best of 7:
the compiled loops' panels on AMX tiles (cpu_decode.c, amx_panels_bf16), the same panels on the FMA loops
(`use_amx(False)`), and up to 8 rows the rows kernel. Each as a multiple of the floor, and torch's time over
the tiles'. On a CPU without AMX the tiles' column is absent.

    python bench/amx_products.py [--threads 1 2] [--out bench/results/amx_products.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ROWS = (1, 2, 4, 8, 9, 16, 32, 64, 256)
OUTPUTS, INPUTS, MATRICES = 1536, 576, 60


def best(fn, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "amx_products.json")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from colorl.engines.native import cpu_decode
    from colorl.machine import cpu_summary

    compiled = cpu_decode.load()
    if compiled is None:
        print(f"the decode loops are not built here: {cpu_decode.why_not()}")
        return 1
    cpu = cpu_summary()
    weights = [torch.randn(OUTPUTS, INPUTS).bfloat16() for _ in range(MATRICES)]
    panels = [compiled.pack_panels(w) for w in weights]
    stream = torch.empty(sum(w.numel() for w in weights) // 2, dtype=torch.float32).uniform_()
    print(f"{cpu}; {MATRICES} bf16 [{OUTPUTS}, {INPUTS}] matrices ({stream.numel() * 4 / 1e6:.0f} MB); "
          f"AMX tiles: {'yes' if compiled.amx else 'no'}")
    print(f"{'threads':>7} {'rows':>5} {'floor ms':>9} {'F.linear':>9} {'AMX':>7} {'FMA':>7} {'rows k.':>8}"
          f" {'F.linear / AMX':>15}   (each a multiple of the floor)")
    rows_out = []
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in ROWS:
                x = torch.randn(rows, INPUTS).bfloat16()
                flops = 2 * rows * INPUTS * OUTPUTS * MATRICES
                floor = best(lambda: stream.sum())
                seconds = {"F.linear": best(lambda: [F.linear(x, w) for w in weights])}
                for name, on in (("AMX", True), ("FMA", False)):  # fewer rows than amx_min_rows never take the tiles
                    if compiled.use_amx(on) == on and (rows >= compiled.amx_min_rows or not on):
                        seconds[name] = best(lambda: [compiled.panel_linear(x, p, OUTPUTS, None) for p in panels])
                if rows <= cpu_decode.MAX_ROWS:
                    seconds["rows kernel"] = best(lambda: [compiled.linear(x, w, None) for w in weights])
                compiled.use_amx(True)
                row = {"threads": threads, "rows": rows, "floor_s": floor, "seconds": seconds,
                       "x_floor": {k: v / floor for k, v in seconds.items()},
                       "gflops": {k: flops / v / 1e9 for k, v in seconds.items()}}
                rows_out.append(row)
                cell = lambda k: f"{row['x_floor'][k]:.2f}x" if k in seconds else "-"  # noqa: E731
                versus = f"{seconds['F.linear'] / seconds['AMX']:.2f}x" if "AMX" in seconds else "-"
                print(f"{threads:>7} {rows:>5} {floor * 1e3:>9.2f} {cell('F.linear'):>9} {cell('AMX'):>7} "
                      f"{cell('FMA'):>7} {cell('rows kernel'):>8} {versus:>15}")
    finally:
        compiled.use_amx(True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": str(date.today()), "cpu": cpu, "amx": compiled.amx,
                                    "build": compiled.build, "rows": rows_out,
                                    "command": "python bench/amx_products.py " + " ".join(sys.argv[1:])}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
