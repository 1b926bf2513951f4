"""One team of threads for a whole decode step against a team forked per loop, side by side in one process on
SmolLM2-135M, each step against the memory floor read beside it (issue 31 item 1).

    python bench/step_team.py                              # bf16, 2 threads, batches 1 and 8, 7 rounds (~3 min)
    python bench/step_team.py --dtype float32 --threads 2

The engine decodes in bursts (its default) with the step's loops on one team of threads that the call keeps
(cpu_decode_team.h), or with each loop forking and joining a team of its own (COLORL_CPU_DECODE_TEAM=0, the loops
as they ran before). The rounds interleave the two, so both see the same neighbours on a shared machine; each
round reads the floor (a sum of 512 MiB, bench/limits.py) before and after its decode run and keeps the faster.
The verdict is the median of the per-round ratios. Results: bench/results/step_team.json; summary in
bench/README.md, "One team for a step".
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine import decode_bench_args, native_on_smollm2, timed_call  # bench/
from limits import MemoryReader  # bench/
from machine import cpu_model  # bench/

ROOT = Path(__file__).resolve().parent


def decode_run(engine, prompt: list[int], batch: int, tag: str) -> float:
    """Median seconds per decode step of `batch` sequences decoding 66 tokens in bursts, after the first burst."""
    from colorl.engines.base import GenerationRequest, SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=66, ignore_eos=True)
    for i in range(batch):
        engine.add(GenerationRequest(f"{tag}-{i}", prompt, params))
    engine.step()  # the prefill
    steps = []
    while engine.has_unfinished():
        seconds, count = timed_call(engine, batch)
        steps += [seconds] * count
    return statistics.median(steps[engine.decode_burst:])


@dataclass
class DecodeBench:
    """A bench of the native engine's decode steps on SmolLM2-135M, one setting switched by turns in one process
    (this file's, bench/few_rows_ask.py's): its arguments, the engine and its loops, and the floor's reader."""
    args: argparse.Namespace
    engine: object
    compiled: object
    prompt: list[int]
    weight_bytes: int
    batches: list[int]
    reader: MemoryReader = field(default_factory=MemoryReader)

    @classmethod
    def start(cls, doc: str, name: str, rounds: int, batches: str, dtype: str) -> "DecodeBench":
        args = decode_bench_args(doc, 2, rounds, batches, dtype, ROOT / "results" / f"{name}.json")
        engine, compiled, prompt = native_on_smollm2(name, getattr(torch, args.dtype))
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        return cls(args, engine, compiled, prompt, weight_bytes, [int(b) for b in args.batches.split(",")])

    def against_floor(self, batch: int, tag: str) -> dict:
        """A decode run's median step (`decode_run`) and the read rate, the faster of the floor's readings before
        and after it: the step in ms, the rate in GB/s, the step over the weights' floor at that rate."""
        before = self.reader.once()
        step = decode_run(self.engine, self.prompt, batch, tag)
        rate = max(before, self.reader.once())
        return {"step_ms": step * 1e3, "read_gb_s": rate / 1e9, "over_floor": step * rate / self.weight_bytes}


def main() -> None:
    bench = DecodeBench.start(__doc__, "step_team", 7, "1,8", "bfloat16")
    args, engine, compiled, batches = bench.args, bench.engine, bench.compiled, bench.batches
    weight_bytes = bench.weight_bytes
    rounds = []
    for index in range(args.rounds):
        record = {}
        for batch in batches:
            for one_team in ((True, False) if index % 2 else (False, True)):
                compiled.use_one_team(one_team)
                record[f"b{batch}_{'one_team' if one_team else 'team_per_loop'}"] = bench.against_floor(
                    batch, f"{index}-{batch}-{one_team}")
        rounds.append(record)
    compiled.use_one_team(True)

    print(f"{cpu_model()}, {args.threads} threads, {args.dtype}, SmolLM2-135M ({weight_bytes / 1e6:.0f} MB of weights), "
          f"bursts of {engine.decode_burst}, {args.rounds} rounds (medians; ratios: median of per-round ratios)")
    print("| batch | read rate | step, a team per loop | / floor | step, one team | / floor | per loop / one team |")
    print("|---|---|---|---|---|---|---|")
    summary = {}
    for batch in batches:
        per_loop = [r[f"b{batch}_team_per_loop"] for r in rounds]
        team = [r[f"b{batch}_one_team"] for r in rounds]
        row = {
            "read_gb_s": statistics.median(r["read_gb_s"] for r in per_loop + team),
            "step_team_per_loop_ms": statistics.median(r["step_ms"] for r in per_loop),
            "team_per_loop_over_floor": statistics.median(r["over_floor"] for r in per_loop),
            "step_one_team_ms": statistics.median(r["step_ms"] for r in team),
            "one_team_over_floor": statistics.median(r["over_floor"] for r in team),
            "speedup": statistics.median(a["step_ms"] / b["step_ms"] for a, b in zip(per_loop, team)),
        }
        summary[batch] = row
        print(f"| {batch} | {row['read_gb_s']:.1f} GB/s | {row['step_team_per_loop_ms']:.2f} ms "
              f"| {row['team_per_loop_over_floor']:.2f}x | {row['step_one_team_ms']:.2f} ms "
              f"| {row['one_team_over_floor']:.2f}x | {row['speedup']:.2f}x |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_model(), "threads": args.threads, "dtype": args.dtype,
                               "weight_bytes": weight_bytes, "summary": summary, "rounds": rounds}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
