"""A decode step's products called one by one against the same bytes in one product, each against the memory floor
read beside it (issue 31 item 1: why two threads fall short of their floor when the host reads fast).

    python bench/product_calls.py --threads 2 [--dtype bfloat16] [--rows 1,8] [--rounds 30]

SmolLM2-135M's 121 matrices (30 layers of q/k/v fused, o, gate/up fused and down, then the LM head) packed into
the engine's panels on huge pages, x of `rows` rows: the step's products in the model's order, one compiled call
each (each its own parallel region, as in the engine's compiled step, plus a ctypes call of about 0.5 us: under
1 % of the floor in all), (a) each matrix's panels in a mapping of its own (starting on a 2 MB boundary, as
`CpuDecode.pack_panels` makes them), (b) back to back in the order of use (`PanelCopies`, the engine's); (c) one
product over a single matrix of the same bytes ([233472, 576]). Each round times one pass of each and then reads
512 MiB (bench/limits.py, MemoryReader.once) for the floor of that moment; medians over the rounds.
Results: bench/results/product_calls.json; summary in bench/README.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LAYERS, VOCAB = 30, 49152  # SmolLM2-135M's; its layer's matrices are the race's (cpu_decode.RACE_LAYER)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "product_calls.json")
    args = parser.parse_args()
    if args.threads < 1 or args.rounds < 2:
        parser.error("--threads must be 1 or more and --rounds 2 or more")
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows takes row counts separated by commas, not {args.rows!r}")
    torch.set_num_threads(args.threads)
    from limits import MemoryReader  # bench/

    from colorl.engines.native import cpu_decode
    from colorl.machine import cpu_summary

    compiled = cpu_decode.load()
    if compiled is None:
        raise SystemExit(f"product_calls: the compiled loops are unavailable: {cpu_decode.why_not()}")
    dtype = getattr(torch, args.dtype)
    hidden = cpu_decode.RACE_MODEL["hidden"]
    step = [*cpu_decode.RACE_LAYER] * LAYERS + [(VOCAB, hidden)]

    def packed(shapes, copies=None):
        out = []
        for n, k in shapes:
            weight = torch.randn(n, k).mul_(k**-0.5).to(dtype)
            out.append((n, k, copies.of(weight, compiled) if copies else compiled.pack_panels(weight), weight))
        return out

    whole = sum(n * k for n, k in step) // hidden  # the same bytes as one [whole, 576] matrix
    layouts = {"121 products, each in a mapping of its own": packed(step),
               "121 products back to back (the engine's)": packed(step, cpu_decode.PanelCopies()),
               "one product": packed([(whole, hidden)])}
    weight_bytes = {name: sum(n * k for n, k, _, _ in mats) * dtype.itemsize for name, mats in layouts.items()}
    product = compiled._functions["colorl_panels", dtype]  # the raw call: no Python wrapper per product
    reader = MemoryReader()
    report = {"cpu": cpu_summary(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "dtype": args.dtype,
              "threads": args.threads, "rounds": args.rounds, "weight_bytes": weight_bytes, "rows": {}}
    print(report["cpu"], f"{args.threads} threads, {args.dtype}")
    for count in rows:
        x = {k: torch.randn(count, k).to(dtype) for k in {k for _, k in step}}
        outs = {name: [torch.empty(count, n, dtype=dtype) for n, _, _, _ in mats] for name, mats in layouts.items()}
        prepared = {name: [(x[k].data_ptr(), panels.data_ptr(), None, out.data_ptr(), count, n, k, args.threads)
                           for (n, k, panels, _), out in zip(mats, outs[name])] for name, mats in layouts.items()}
        ratios = {name: [] for name in layouts}
        rates = []
        for r in range(args.rounds):
            for name, mats in layouts.items():
                calls = prepared[name]
                t0 = time.perf_counter()
                for call in calls:
                    product(*call)
                seconds = time.perf_counter() - t0
                rate = reader.once()
                rates.append(rate)
                if r:  # the first round warms the calls
                    ratios[name].append(seconds * rate / weight_bytes[name])
        cell = {name: {"median_over_floor": statistics.median(v), "min": min(v), "max": max(v)}
                for name, v in ratios.items()}
        cell["read_gb_s"] = statistics.median(rates) / 1e9
        report["rows"][count] = cell
        print(f"{count} rows at {cell['read_gb_s']:.1f} GB/s: " + "; ".join(
            f"{name} {c['median_over_floor']:.2f}x the floor ({c['min']:.2f}-{c['max']:.2f})"
            for name, c in cell.items() if name != "read_gb_s"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
