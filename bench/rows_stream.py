"""How fast the native engine's rows kernel and its panels read their weights, against a plain sum of the same
memory (issue 31 item 1: why a batch-8 decode step sat further from its memory floor than a batch-1 step, and
why a few rows now run over the panels where this machine's race says so).

    python bench/rows_stream.py

bench/rows_stream.c includes the engine's own cpu_decode.c and times, on one thread over 85 MB of [3072, 576]
float32 matrices on huge pages (15 interleaved rounds, medians): a sum of the memory; the rows kernel and the
panels at 1, 2, 4 and 8 rows, from DRAM and from L2 (a 96-row matrix read again and again); a probe doing the 8-row
step's 16 FMAs per cache line with x in registers, no loads of x; and the bf16 rows kernel at 1, 2, 4 and 8 rows
and the bf16 panels (k-pair panels where the CPU has AVX512-BF16) at the same rows, from DRAM and from L2,
over the same matrices in bf16 (42 MB), against a sum of those bytes. Built with the engine's compiler and
-march (engines/native/cpu_build.py). Results: bench/results/rows_stream.json; summary in bench/README.md.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from machine import cpu_model  # bench/

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "results" / "rows_stream.json"))
    args = parser.parse_args()
    from colorl.engines.native.cpu_build import LoopsUnavailable, compiler, march

    try:
        cc = compiler()
    except LoopsUnavailable as exc:
        raise SystemExit(f"rows_stream: {exc}")
    with tempfile.TemporaryDirectory() as folder:
        binary = Path(folder) / "rows_stream"
        subprocess.run([*cc, "-O3", "-ffp-contract=fast", "-std=gnu11", f"-march={march()}", "-fopenmp",
                        str(HERE / "rows_stream.c"), "-o", str(binary), "-lm"], check=True)
        figures = json.loads(subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout)
    total = figures["sum_gb_s"]
    print(f"{cpu_model()}, 1 thread, float32, 85 MB of [3072, 576] matrices on huge pages: sum {total:.1f} GB/s; "
          f"the 8-row step's FMAs without loads of x {figures['fmas_without_x_loads_gb_s']:.1f} GB/s "
          f"({figures['fmas_without_x_loads_gb_s'] / total:.2f}x the sum)")
    print("| rows | rows kernel from DRAM | / sum | from L2 | panels from DRAM | / sum | from L2 | panels / rows kernel |")
    print("|---|---|---|---|---|---|---|---|")
    for rows, row in figures["rows"].items():
        print(f"| {rows} | {row['dram_gb_s']:.1f} GB/s | {row['dram_gb_s'] / total:.2f}x | {row['l2_gb_s']:.1f} GB/s "
              f"| {row['panels_dram_gb_s']:.1f} GB/s | {row['panels_dram_gb_s'] / total:.2f}x "
              f"| {row['panels_l2_gb_s']:.1f} GB/s | {row['panels_dram_gb_s'] / row['dram_gb_s']:.2f}x |")
    bf16_total = figures["bf16_sum_gb_s"]
    print(f"bf16, the same matrices (42 MB): sum {bf16_total:.1f} GB/s")
    print("| rows | bf16 rows kernel from DRAM | / sum | bf16 panels from DRAM | / sum | from L2 |")
    print("|---|---|---|---|---|---|")
    for rows, rate in figures["bf16_rows"].items():
        panel = figures["bf16_panels"][rows]
        print(f"| {rows} | {rate:.1f} GB/s | {rate / bf16_total:.2f}x | {panel['dram_gb_s']:.1f} GB/s "
              f"| {panel['dram_gb_s'] / bf16_total:.2f}x | {panel['l2_gb_s']:.1f} GB/s |")
    out = Path(args.out)
    out.write_text(json.dumps({"machine": cpu_model(), **figures}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
