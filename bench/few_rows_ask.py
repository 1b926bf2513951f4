"""The ways decode steps of 1-2 rows ask for their weights ahead (into L2, non-temporally, not at all), side by side
in one process on SmolLM2-135M, each step against the memory floor read beside it (issue 31 item 1).

    python bench/few_rows_ask.py                              # float32, 2 threads, batches 1 and 2, 5 rounds (~2 min)
    python bench/few_rows_ask.py --dtype bfloat16 --threads 1

The engine runs its raced loops (which of the panels and the rows kernel each row count takes); only the way
of asking changes, by turns within each round, so every way sees the same neighbours on a shared machine. The
CPUs disagree on the way: the race that picks it per machine (cpu_decode.race_few_rows_ask) runs with the rows.
Each round reads the floor (a sum of 512 MiB, bench/limits.py) before and after its decode run and keeps the
faster. Results: bench/results/few_rows_ask.json; summary in bench/README.md, "1-2 rows ask as the machine's race
says".
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from machine import cpu_model  # bench/
from step_team import DecodeBench  # bench/

ROOT = Path(__file__).resolve().parent


def main() -> None:
    from colorl.engines.native.cpu_decode import FEW_ROWS_ASKS

    bench = DecodeBench.start(__doc__, "few_rows_ask", 5, "1,2", "float32")
    args, compiled, weight_bytes = bench.args, bench.compiled, bench.weight_bytes
    over: dict[tuple[int, str], list[float]] = {}
    steps: dict[tuple[int, str], list[float]] = {}
    for index in range(args.rounds):
        for batch in bench.batches:
            for ask in FEW_ROWS_ASKS[::1 if index % 2 else -1]:
                with compiled.asking(ask):
                    run = bench.against_floor(batch, f"{index}-{batch}-{ask}")
                steps.setdefault((batch, ask), []).append(run["step_ms"])
                over.setdefault((batch, ask), []).append(run["over_floor"])

    raced = compiled.few_rows_ask_for(getattr(torch, args.dtype))
    print(f"{cpu_model()}, {args.threads} threads, {args.dtype}, SmolLM2-135M ({weight_bytes / 1e6:.0f} MB of "
          f"weights), {args.rounds} rounds (medians; the ratio: the median of per-round ratios); this machine's race "
          f"chose: {raced}")
    print("| batch | way | step | / floor (rounds) | step / not asking |")
    print("|---|---|---|---|---|")
    summary = {}
    for batch, ask in sorted(over):
        ratio = statistics.median(a / b for a, b in zip(steps[batch, ask], steps[batch, "none"]))
        summary[f"{batch} {ask}"] = {"step_ms": statistics.median(steps[batch, ask]), "step_over_none": ratio,
                                     "over_floor": statistics.median(over[batch, ask]),
                                     "over_floor_rounds": over[batch, ask]}
        print(f"| {batch} | {ask} | {summary[f'{batch} {ask}']['step_ms']:.1f} ms "
              f"| {summary[f'{batch} {ask}']['over_floor']:.2f}x ({min(over[batch, ask]):.2f}-"
              f"{max(over[batch, ask]):.2f}) | {ratio:.2f}x |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_model(), "threads": args.threads, "dtype": args.dtype, "raced": raced,
                               "weight_bytes": weight_bytes, "summary": summary}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
