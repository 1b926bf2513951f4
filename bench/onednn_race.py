"""The matmul kernels behind the native engine, side by side: MKL (torch's fp32 `aten::mm` on CPU)
against oneDNN over a packed weight (colorl/kernels.py), on SmolLM2-135M's shapes; and oneDNN over the
plain weight, which costs no second copy of the weights (`plain / packed`: what the packed copy buys).

For each row count M (decode batch sizes, and a training-sized 2048) and thread count, both
kernels run every projection of the 30 layers (distinct weights, as in the model, so they do not
sit in cache) plus the LM head, interleaved over rounds; the table gives GFLOP/s and the speed-up,
and the physical floor of those products: the larger of reading every weight once at the measured
read bandwidth and their FLOPs at the best rate either kernel reaches on a 2048² product
(bench/limits.py's `matmul_rate` and `read_bandwidth`: the physical floor it holds the rollout to). `oneDNN / floor` is how far the fastest
kernel alone, with no attention, sampling or Python around it, stays above that floor.

    python bench/onednn_race.py [--rounds 3] [--rows 1,4,8,32,2048] [--threads 1,2]
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from limits import matmul_rate, read_bandwidth  # the floor bench/step.py holds the rollout to
from machine import cpu_model  # bench/

RESULTS = Path(__file__).resolve().parent / "results" / "kernels.json"
HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
SHAPES = [(HIDDEN + 2 * 192, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # [out, in]


def timed(fn, min_s: float = 0.5) -> float:
    fn()
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < min_s:
        fn()
        done += 1
    return (time.perf_counter() - started) / done


def main() -> None:
    from colorl.kernels import PACK_ROWS_HINT, onednn_available

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default="1,4,8,16,24,32,2048")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if not onednn_available():
        raise SystemExit("this torch has no oneDNN")
    weights = [torch.randn(out, inp) for _ in range(LAYERS) for out, inp in SHAPES] + [torch.randn(VOCAB, HIDDEN)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT) for w in weights]
    weight_bytes = sum(w.nbytes for w in weights)
    rows_out, floors = [], []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        bandwidth, rate = read_bandwidth(), matmul_rate()
        floors.append({"threads": threads, "read_gb_s": bandwidth / 1e9, "matmul_gflops": rate / 1e9})
        for m in [int(r) for r in args.rows.split(",")]:
            inputs = {inp: torch.randn(m, inp) for _, inp in SHAPES + [(VOCAB, HIDDEN)]}
            flops = sum(2 * m * w.shape[0] * w.shape[1] for w in weights)
            mkl = lambda: [F.linear(inputs[w.shape[1]], w) for w in weights]  # noqa: E731
            dnnl = lambda: [torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")  # noqa: E731
                            for w, p in zip(weights, packed)]
            plain = lambda: [torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], w, None, "none", [], "")  # noqa: E731
                             for w in weights]
            times = {"mkl": [], "onednn": [], "plain": []}
            for _ in range(args.rounds):
                times["mkl"].append(timed(mkl))
                times["onednn"].append(timed(dnnl))
                times["plain"].append(timed(plain))
            med = {k: statistics.median(v) for k, v in times.items()}
            rows_out.append({"threads": threads, "rows": m, "mkl_ms": med["mkl"] * 1e3, "onednn_ms": med["onednn"] * 1e3,
                             "mkl_gflops": flops / med["mkl"] / 1e9, "onednn_gflops": flops / med["onednn"] / 1e9,
                             "speedup": med["mkl"] / med["onednn"], "plain_ms": med["plain"] * 1e3,
                             "plain_over_packed": med["plain"] / med["onednn"]})
            r = rows_out[-1]
            r["floor_ms"] = max(flops / rate, weight_bytes / bandwidth) * 1e3
            r["onednn_over_floor"] = r["onednn_ms"] / r["floor_ms"]
            print(f"threads {threads} rows {m:5d}: MKL {r['mkl_ms']:8.1f} ms ({r['mkl_gflops']:5.0f} GFLOP/s)   "
                  f"oneDNN packed {r['onednn_ms']:8.1f} ms ({r['onednn_gflops']:5.0f} GFLOP/s)   {r['speedup']:.2f}x   "
                  f"oneDNN plain {r['plain_ms']:8.1f} ms ({r['plain_over_packed']:.2f}x packed)", flush=True)
        print(f"threads {threads}: read bandwidth {bandwidth / 1e9:.1f} GB/s, matmul rate {rate / 1e9:.0f} GFLOP/s; " + ", ".join(
            f"rows {row['rows']}: oneDNN {row['onednn_over_floor']:.2f}x its floor ({row['floor_ms']:.1f} ms)"
            for row in rows_out if row["threads"] == threads and "floor_ms" in row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    cpu = cpu_model()
    Path(args.out).write_text(json.dumps({"date": datetime.date.today().isoformat(), "torch": torch.__version__, "cpu": cpu,
                                          "rounds": args.rounds, "floors": floors, "results": rows_out}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
