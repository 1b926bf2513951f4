"""Bounded-lag on CPU: how to split a rank's cores between the rollout and the train loop.

Each loop runs torch on its own thread with its own OpenMP team. The obvious choices are both
teams as wide as the machine (oversubscribed: barriers stall for whole scheduler slices), the
whole machine for one loop and one core for the other, or half each. This runs the same
bounded-lag workload (SmolLM2-135M, long-tailed lengths) under each split, interleaved over
rounds, and reports trained tokens per second of wall-clock step time (median after the first
step) with the ratio to colorl's default split.

    python bench/threads.py [--rounds 2] [--steps 4] [--model smollm2-135m-instruct]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "threads.json"
CORES = os.cpu_count() or 1
SPLITS = {  # name -> (rollout threads, train threads); "default" is colorl's own choice
    "default (half each)": (None, None),
    f"both {CORES} (oversubscribed)": (CORES, CORES),
    f"rollout {CORES}, train 1": (CORES, 1),
    f"rollout 1, train {CORES}": (1, CORES),
}


def workload(model: str, steps: int) -> list[str]:
    return [
        f"model.path={model}", "mode=bounded_lag", "staleness.max=2", f"run.steps={steps}", "run.save_every=0",
        "run.eval_every=0", "task.options={digits: 1}", "rollout.batch_groups=4", "rollout.group_size=4",
        "rollout.concurrency=16", "rollout.length_override={mean: 24, tailness: 90, cap: 96}",
        "train.max_tokens_per_micro_batch=4096", "train.lr=1e-5", "engine.max_num_seqs=16",
    ]


def run_split(split: tuple[int | None, int | None], sets: list[str], workdir: Path) -> dict:
    rollout, train = split
    extra = [f"launch.rollout_threads={rollout}"] if rollout else []
    extra += [f"launch.train_threads={train}"] if train else []
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    args = [sys.executable, "-m", "colorl", "train", str(ROOT / "configs" / "quickstart.yaml"),
            "--run-dir", str(run_dir / "run")]
    for item in sets + extra:
        args += ["--set", item]
    started = time.perf_counter()
    subprocess.run(args, check=True, capture_output=True, text=True, cwd=ROOT)
    lines = [json.loads(x) for x in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    measured = lines[1:]  # the first step fills the pipeline
    return {
        "trained_tok_per_s": statistics.median(r["trained_tokens"] / r["time_step_s"] for r in measured),
        "generated_tok_per_s": statistics.median(r["generated_tokens"] / r["time_step_s"] for r in measured),
        "step_s": statistics.median(r["time_step_s"] for r in measured),
        "staleness_max": max(r["staleness_max"] for r in lines),
        "wall_s": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    sets = workload(args.model, args.steps)
    runs: dict[str, list[dict]] = {name: [] for name in SPLITS}
    with tempfile.TemporaryDirectory() as workdir:
        for round_index in range(args.rounds):  # interleaved: machine noise hits every split alike
            for name, split in SPLITS.items():
                runs[name].append(run_split(split, sets, Path(workdir)))
                print(f"round {round_index + 1}: {name}: {runs[name][-1]['trained_tok_per_s']:.1f} trained tok/s",
                      flush=True)
    base = statistics.median(r["trained_tok_per_s"] for r in runs["default (half each)"])
    print(f"\n{'split':34} {'trained tok/s':>14} {'range':>16} {'step s':>8} {'vs default':>11}")
    table = {}
    for name, results in runs.items():
        rates = [r["trained_tok_per_s"] for r in results]
        median = statistics.median(rates)
        table[name] = {"runs": results, "trained_tok_per_s_median": median, "ratio_vs_default": median / base}
        print(f"{name:34} {median:14.1f} {min(rates):7.1f}-{max(rates):<8.1f} "
              f"{statistics.median(r['step_s'] for r in results):8.1f} {median / base:10.2f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "cores": CORES, "workload": sets,
                                   "rounds": args.rounds, "splits": table}, indent=1))
    print(f"\nwritten {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
