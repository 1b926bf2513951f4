"""Variants of one `colorl train` workload, run interleaved and repeated, so that a claim holds.

A shared or throttled machine drifts by tens of percent within minutes; one run of A then one
run of B measures the drift as much as the difference. Here every repeat runs every variant once
(A B A B ...), each run reports the median step time over steps 2..N (step 1 carries warm-up),
and the table gives, per variant, the median and the range (min–max) over repeats and the ratio
to the baseline (the first variant) within each repeat.

    python bench/interleaved.py --name bf16 --repeats 3 --steps 4 \
        --variant 'fp32=' --variant 'bf16=--set train.mixed_precision=bfloat16'
    python bench/interleaved.py --name ranks --variant '1 rank=--nproc 1' --variant '2 ranks=--nproc 2'

A variant is `label=extra train arguments` (and `ENV=value` words, set for that run only).
Writes bench/results/interleaved_<name>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(config: str, steps: int, extra: list[str], run_dir: Path) -> dict:
    env = dict(os.environ)
    args = []
    for word in extra:
        if "=" in word and word.split("=", 1)[0].isupper():
            key, value = word.split("=", 1)
            env[key] = value
        else:
            args.append(word)
    command = [sys.executable, "-m", "colorl", "train", config, "--run-dir", str(run_dir),
               "--set", f"run.steps={steps}", "--set", "run.save_every=0", "--set", "run.eval_every=0", *args]
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(proc.pid, 0)  # rusage covers the ranks the launcher waited for
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(command)} exited with {proc.returncode}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = records[1:] or records
    return {
        "wall_s": wall,
        "step_s": statistics.median(r["time_step_s"] for r in timed),
        "train_s": statistics.median(r["time_train_s"] for r in timed),
        "rollout_s": statistics.median(r["time_rollout_s"] for r in timed),
        "first_step_s": records[0]["time_step_s"],
        "peak_rss_gb": usage.ru_maxrss / 1e6,  # largest process of the run (kB -> GB)
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant", action="append", required=True, metavar="LABEL=ARGS")
    args = parser.parse_args()
    variants = [(label, shlex.split(rest)) for label, _, rest in (v.partition("=") for v in args.variant)]
    runs: dict[str, list[dict]] = {label: [] for label, _ in variants}
    load = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for index, (label, extra) in enumerate(variants):
                load.append(os.getloadavg()[0])
                runs[label].append(run_once(args.config, args.steps, extra, Path(tmp) / f"r{repeat}-{index}"))
                print(f"repeat {repeat + 1}/{args.repeats} {label}: {runs[label][-1]}", flush=True)
    base = variants[0][0]
    rows = {}
    print(f"\n{'variant':22}{'step s median':>14}{'range':>16}{'train s':>9}{'rollout s':>10}{'step ratio':>18}"
          f"{'peak GB':>9}")
    for label, _ in variants:
        steps = [r["step_s"] for r in runs[label]]
        ratios = [b["step_s"] / r["step_s"] for b, r in zip(runs[base], runs[label])]
        rows[label] = {"runs": runs[label], "step_s_median": statistics.median(steps),
                       "step_s_range": [min(steps), max(steps)],
                       "train_s_median": statistics.median(r["train_s"] for r in runs[label]),
                       "rollout_s_median": statistics.median(r["rollout_s"] for r in runs[label]),
                       "speedup_vs_baseline": [min(ratios), max(ratios)]}
        print(f"{label:22}{rows[label]['step_s_median']:>14.2f}{min(steps):>8.2f}–{max(steps):<7.2f}"
              f"{rows[label]['train_s_median']:>9.2f}{rows[label]['rollout_s_median']:>10.2f}"
              f"{min(ratios):>11.2f}–{max(ratios):.2f}×{max(r['peak_rss_gb'] for r in runs[label]):>9.1f}")
    out = ROOT / "bench" / "results" / f"interleaved_{args.name}.json"
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "config": args.config, "steps": args.steps,
                               "repeats": args.repeats, "baseline": base, "load_avg_1m": load,
                               "variants": {label: " ".join(extra) for label, extra in variants},
                               "rows": rows}, indent=2))
    print(f"load average (1 min) at each run start: {min(load):.1f}–{max(load):.1f}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
