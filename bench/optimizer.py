"""AdamW's step over SmolLM2-135M's parameters on a CPU: torch's default (a Python loop over the parameters on a
CPU), foreach and fused (what colorl/train/policy.py builds), side by side in one process, interleaved over rounds.

The trainer's optimizer step runs once per GRPO step over float32 master weights (bf16 compute or not), so this is
a fixed cost of every step. Prints each implementation's best time per thread count and its ratio against the
default; writes bench/results/optimizer.json.

    python bench/optimizer.py [--rounds 5] [--threads 1,2]
"""
from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch
from machine import cpu_model  # bench/

RESULTS = Path(__file__).resolve().parent / "results" / "optimizer.json"
HIDDEN, INTER, VOCAB, LAYERS, KV = 576, 1536, 49152, 30, 192
LAYER_SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTER, HIDDEN), (INTER, HIDDEN),
                (HIDDEN, INTER), (HIDDEN,), (HIDDEN,)]  # q, k, v, o, gate, up, down, two norms
IMPLEMENTATIONS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def optimizers() -> dict[str, torch.optim.Optimizer]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(VOCAB, HIDDEN), (HIDDEN,)] + LAYER_SHAPES * LAYERS
    built = {}
    for name, options in IMPLEMENTATIONS.items():
        params = [torch.nn.Parameter(torch.randn(*shape, generator=gen) * 0.02) for shape in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        built[name] = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8, **options)
        built[name].step()  # the states exist from here on, as after a run's first step
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", default="1,2")
    args = parser.parse_args()
    built = optimizers()
    count = sum(p.numel() for p in built["default"].param_groups[0]["params"])
    cpu = cpu_model()
    print(f"{cpu}; AdamW over {count / 1e6:.0f}M float32 parameters, best of {args.rounds} interleaved rounds")
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        best = {name: float("inf") for name in built}
        for _ in range(args.rounds):
            for name, optimizer in built.items():
                started = time.perf_counter()
                optimizer.step()
                best[name] = min(best[name], time.perf_counter() - started)
        for name, seconds in best.items():
            rows.append({"threads": threads, "implementation": name, "ms": seconds * 1e3,
                         "speedup_over_default": best["default"] / seconds})
            print(f"{threads} threads  {name:8s} {seconds * 1e3:7.1f} ms  {best['default'] / seconds:5.2f}x the default")
    RESULTS.write_text(json.dumps({"date": datetime.date.today().isoformat(), "torch": torch.__version__, "cpu": cpu,
                                   "parameters": count, "rounds": args.rounds, "results": rows}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
