"""Decode steps with the two cores near (one L3) and far apart (two CCDs, or two sockets), told apart by a cache
line's round trip between them, each step against the memory floor read beside it; one or more checkouts side by
side (issue 31 item 1).

    python bench/two_ccds.py                                   # this checkout, fp32 and bf16, batches 1, 8, 32
    python bench/two_ccds.py --trees /path/to/before,.         # two checkouts, chunks of rounds by turns

A machine whose two cores are vCPUs can be moved by its host between cores that share an L3 and cores that do
not, minute to minute (a Zen 5 here: a line's round trip 80-140 ns near, 370-430 ns far, and the read rate of two
threads 1.5x as high far). Far apart, each line one thread writes and the other reads costs a trip: a step's
barriers and the x its products share. Each round measures the trip (colorl_core_trip, cpu_decode_team.h) and the
read rate (bench/limits.py) before and after its decode run; a round whose two trips are both above twice the
run's usual near trip (the median of its lowest quarter) is far, both below near, else mixed (left out). Each
checkout runs in a process of its own (its colorl first on the path), in chunks of rounds by turns, so both see
both states; the trip is this checkout's probe in every process. Results: bench/results/two_ccds.json; summary in
bench/README.md, "Two CCDs".
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
TRIP_LIBRARY = "COLORL_BENCH_TRIP_LIBRARY"  # the parent's loops library, for its colorl_core_trip


def trip_probe():
    """ns of a line's round trip between two threads, the median of five runs (this checkout's probe, also in a
    child running another checkout's colorl)."""
    library = ctypes.CDLL(os.environ[TRIP_LIBRARY])
    trip = library.colorl_core_trip
    trip.argtypes, trip.restype = [ctypes.c_int64], ctypes.c_double
    return lambda: statistics.median(trip(20000) for _ in range(5))


def child(args: argparse.Namespace) -> None:
    """`args.rounds` rounds of every batch in one dtype, one JSON line per round and batch."""
    import torch

    from engine import native_on_smollm2  # bench/
    from limits import MemoryReader  # bench/
    from step_team import decode_run  # bench/

    torch.set_num_threads(args.threads)
    engine, _, prompt = native_on_smollm2("two_ccds", getattr(torch, args.dtype))
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    trip, reader = trip_probe(), MemoryReader()
    for index in range(args.rounds):
        for batch in (int(b) for b in args.batches.split(",")):
            before, read_before = trip(), reader.once()
            step = decode_run(engine, prompt, batch, f"{index}-{batch}")
            after, rate = trip(), max(read_before, reader.once())
            print(json.dumps({"batch": batch, "trips_ns": [before, after], "step_ms": step * 1e3,
                              "read_gb_s": rate / 1e9, "over_floor": step * rate / weight_bytes}), flush=True)


def run_chunk(tree: Path, args: argparse.Namespace, dtype: str, library: str) -> list[dict]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--dtype", dtype, "--batches", args.batches,
               "--rounds", str(args.chunk), "--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]),
           TRIP_LIBRARY: library}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"two_ccds: the run on {tree} failed: {done.stderr.strip().splitlines()[-1:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def states(rounds: list[dict]) -> None:
    """Tags each round near, far or mixed against the run's usual near trip."""
    trips = sorted(t for r in rounds for t in r["trips_ns"])
    near = statistics.median(trips[: max(1, len(trips) // 4)])
    for r in rounds:
        far = [t > 2 * near for t in r["trips_ns"]]
        r["state"] = "far" if all(far) else "near" if not any(far) else "mixed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", default=str(ROOT.parent), help="checkouts to compare, comma-separated")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--chunks", type=int, default=4, help="chunks of rounds per checkout and dtype")
    parser.add_argument("--chunk", type=int, default=4, help="rounds per chunk")
    parser.add_argument("--rounds", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "results" / "two_ccds.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    import torch

    from colorl.engines.native import cpu_decode
    from machine import cpu_model  # bench/

    torch.set_num_threads(args.threads)
    loops = cpu_decode.load()
    if loops is None:
        sys.exit(f"two_ccds: the native engine's compiled loops are not used here: {cpu_decode.why_not()}")
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    for tree in trees:  # else the child would import whichever colorl is installed, and say nothing
        if not (tree / "colorl" / "__init__.py").is_file():
            sys.exit(f"two_ccds: {tree} is not a colorl checkout (no colorl/__init__.py there)")
    rounds = []
    for chunk in range(args.chunks):
        for dtype in args.dtypes.split(","):
            for tree in trees if chunk % 2 == 0 else trees[::-1]:
                for r in run_chunk(tree, args, dtype, loops._lib._name):
                    rounds.append({"tree": str(tree), "dtype": dtype, **r})
    states(rounds)

    print(f"{cpu_model()}, {args.threads} threads, SmolLM2-135M, decode steps in bursts; medians over rounds "
          f"(near: one L3, far: two)")
    print("| state | trip between the cores | read rate, 2 threads | rounds |")
    print("|---|---|---|---|")
    summary: dict = {"states": {}, "steps": []}
    for state in ("near", "far"):
        mine = [r for r in rounds if r["state"] == state]
        if mine:
            row = {"trip_ns": statistics.median(t for r in mine for t in r["trips_ns"]),
                   "read_gb_s": statistics.median(r["read_gb_s"] for r in mine), "rounds": len(mine)}
            summary["states"][state] = row
            print(f"| {state} | {row['trip_ns']:.0f} ns | {row['read_gb_s']:.1f} GB/s | {row['rounds']} |")
    print("\n| dtype | batch | checkout | near: step | / floor | far: step | / floor | far / near |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for tree in trees:
                mine = [r for r in rounds if (r["dtype"], r["batch"], r["tree"]) == (dtype, batch, str(tree))]
                row = {"dtype": dtype, "batch": batch, "tree": str(tree)}
                for state in ("near", "far"):
                    these = [r for r in mine if r["state"] == state]
                    if these:
                        row[state] = {"step_ms": statistics.median(r["step_ms"] for r in these),
                                      "over_floor": statistics.median(r["over_floor"] for r in these),
                                      "rounds": len(these)}
                summary["steps"].append(row)
                cell = lambda s, k, f: f.format(row[s][k]) if s in row else "-"  # noqa: E731
                ratio = f"{row['far']['step_ms'] / row['near']['step_ms']:.2f}x" if "near" in row and "far" in row else "-"
                print(f"| {dtype} | {batch} | {tree.name} | {cell('near', 'step_ms', '{:.2f} ms')} "
                      f"| {cell('near', 'over_floor', '{:.2f}x')} | {cell('far', 'step_ms', '{:.2f} ms')} "
                      f"| {cell('far', 'over_floor', '{:.2f}x')} | {ratio} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_model(), "threads": args.threads, "trees": [str(t) for t in trees],
                               "summary": summary, "rounds": rounds}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
