"""The trainer's step with each GRPO group's prompt run once against every sample running its own.

    flock /tmp/colorl-cpu.lock python bench/shared_prompts.py            # ~8 min on 2 cores

SmolLM2-135M-Instruct, one process, the rank's thread count, fp32, the CPU's default micro-batch budget.
A step's batch is 8 groups x 4 samples: the two-digit sums' chat-templated prompts (bench/step.py's
frontier workload) with responses of 20-64 tokens, and the quickstart's one-digit sums with responses
of 4-24. Response token values do not change the arithmetic; their lengths are drawn once (seeded) and
both ways train the same batch. Each round runs both ways back to back, alternating which goes first,
so a busy minute falls on both; the first round is a warm-up. Prints medians and the ratio, writes
bench/results/shared_prompts.json.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from machine import cpu_model  # bench/
from step import ROOT, SUFFIX  # bench/: the frontier's prompts

WORKLOADS = {"two_digit": ((10, 99), (20, 64)), "quickstart": ((0, 9), (4, 24))}  # operands, response tokens


def batch_for(tokenizer, workload: str, seed: int = 0):
    from colorl.models import encode_chat
    from colorl.train.packing import TrainBatch

    (low, high), (short, long) = WORKLOADS[workload]
    rng = random.Random(seed)
    sequences = []
    for _ in range(8):
        prompt = encode_chat(tokenizer, f"What is {rng.randint(low, high)} + {rng.randint(low, high)}? {SUFFIX}")
        for _ in range(4):
            response = [rng.randrange(100, 40000) for _ in range(rng.randint(short, long))]
            sequences.append((prompt + response, [0.0] * len(prompt) + [1.0] * len(response),
                              [0.0] * len(prompt) + [-2.0] * len(response)))
    return TrainBatch.from_sequences(sequences, torch.randn(32, generator=torch.Generator().manual_seed(seed)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds per setting, after one warm-up")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "shared_prompts.json"))
    args = parser.parse_args()

    from colorl.config import load_config, micro_batch_tokens
    from colorl.launch import rank_threads
    from colorl.models import load_tokenizer, resolve_model_path
    from colorl.train.policy import PolicyTrainer

    threads = rank_threads(1)
    torch.set_num_threads(threads)
    model_dir = resolve_model_path("smollm2-135m-instruct")
    tokenizer = load_tokenizer(model_dir)
    rows = []
    for checkpointing in (False, True):
        cfg = load_config(None, ["model.path=smollm2-135m-instruct", "model.dtype=float32", "launch.device=cpu",
                                 "train.mixed_precision=null", "train.lr=1e-6",
                                 f"train.activation_checkpointing={str(checkpointing).lower()}"], check_paths=False)
        trainer = PolicyTrainer(model_dir, cfg, "cpu")
        if not trainer.share_prompts:
            raise SystemExit(f"the trainer's attention here ({trainer.attention}) does not share prompts")
        for workload in WORKLOADS:
            batch = batch_for(tokenizer, workload)
            lengths, prompts = batch.seq_lens, batch.prompt_lens()
            times: dict[bool, list[float]] = {True: [], False: []}
            for round_ in range(args.rounds + 1):
                for share in ((True, False) if round_ % 2 else (False, True)):
                    trainer.share_prompts = share
                    started = time.perf_counter()
                    trainer.train_step(batch)
                    if round_:
                        times[share].append(time.perf_counter() - started)
            tokens_whole = int(lengths.sum())
            tokens_shared = tokens_whole - int(prompts.view(8, 4)[:, 1:].sum())
            row = {"workload": workload, "checkpointing": checkpointing, "tokens_whole": tokens_whole,
                   "tokens_shared": tokens_shared, "whole_s": times[False], "shared_s": times[True],
                   "whole_median_s": statistics.median(times[False]), "shared_median_s": statistics.median(times[True])}
            row["speedup"] = row["whole_median_s"] / row["shared_median_s"]
            rows.append(row)
            print(f"{workload:10s} ckpt {'on ' if checkpointing else 'off'}: {tokens_whole} -> {tokens_shared} tokens, "
                  f"whole {row['whole_median_s']:.2f} s, shared {row['shared_median_s']:.2f} s: {row['speedup']:.2f}x",
                  flush=True)
    cpu = cpu_model()
    print(f"\n{cpu}, {threads} threads, fp32, budget {micro_batch_tokens(cfg.train, 'cpu')} tokens, "
          f"medians of {args.rounds} rounds")
    print(f"{'workload':12}{'ckpt':6}{'tokens whole -> shared':>24}{'whole s':>9}{'shared s':>10}{'speed-up':>10}")
    for row in rows:
        print(f"{row['workload']:12}{'on' if row['checkpointing'] else 'off':6}"
              f"{row['tokens_whole']:>12} -> {row['tokens_shared']:<8}{row['whole_median_s']:>9.2f}"
              f"{row['shared_median_s']:>10.2f}{row['speedup']:>9.2f}x")
    out = Path(args.out)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu,
                               "threads": threads, "rounds": args.rounds, "rows": rows}, indent=2))
    tmp.rename(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
