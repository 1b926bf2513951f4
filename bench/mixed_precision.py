"""Training compute in bf16 (FSDP2 mixed precision) vs fp32, on the quickstart workload.

Baseline: `train.mixed_precision: null` (fp32 compute). Both runs use configs/quickstart.yaml
with the same seed, one after the other in this script; weights, optimizer and engine stay
fp32 in both. Writes bench/results/mixed_precision.json.

    python bench/mixed_precision.py [--steps 6]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"fp32 (baseline)": "null", "bf16 compute": "bfloat16"}


def run(steps: int, precision: str, run_dir: Path) -> list[dict]:
    command = [sys.executable, "-m", "colorl.cli", "train", "configs/quickstart.yaml", "--run-dir", str(run_dir),
               "--set", f"run.steps={steps}", "--set", "run.save_every=0", "--set", "run.eval_every=0",
               "--set", f"train.mixed_precision={precision}"]
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, precision in VARIANTS.items():
            metrics = run(args.steps, precision, Path(tmp) / precision)
            timed = metrics[1:]  # step 1 includes warm-up
            rows[name] = {
                "train_s_median": statistics.median(r["time_train_s"] for r in timed),
                "step_s_median": statistics.median(r["time_step_s"] for r in timed),
                "rewards": [round(r["reward_mean"], 3) for r in metrics],
                "is_weight_mean": statistics.mean(r["is_weight_mean"] for r in metrics),
                "kl_mu_theta": statistics.mean(r["kl_mu_theta"] for r in metrics),
            }
    base = rows["fp32 (baseline)"]
    print(f"{'':18}{'train s':>9}{'step s':>9}{'train ×':>9}{'w mean':>8}{'KL(μ‖θ)':>10}  rewards")
    for name, row in rows.items():
        row["train_speedup"] = base["train_s_median"] / row["train_s_median"]
        row["step_speedup"] = base["step_s_median"] / row["step_s_median"]
        print(f"{name:18}{row['train_s_median']:>9.2f}{row['step_s_median']:>9.2f}{row['train_speedup']:>9.2f}"
              f"{row['is_weight_mean']:>8.3f}{row['kl_mu_theta']:>10.5f}  {row['rewards']}")
    out = ROOT / "bench" / "results" / "mixed_precision.json"
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "steps": args.steps, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
