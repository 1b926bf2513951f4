"""bf16 compute and serving against float32, on the quickstart task: the step's speed and the learning curve.

Baseline: float32 everywhere (`train.mixed_precision: null`, `engine.dtype: null`). Against it: bf16 forward and
backward (FSDP2 mixed precision over float32 master weights and optimizer state) with the engine serving the
weights cast to bf16 — what `auto` picks where this machine's race says bf16 is faster (colorl/precision.py).
Both run the same config and seed one after the other in this script, every step, with the held-out greedy
accuracy before step 1 and every `run.eval_every` steps. Prints the CPU, whether it has bf16 matrix products,
what `auto` picks here, the step ratio against issue 31's 1.5x bar, and whether the final held-out accuracies
differ by more than their sampling noise. Writes bench/results/mixed_precision.json (or --out).

    python bench/mixed_precision.py [--config configs/quickstart.yaml] [--steps 12] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"fp32 (baseline)": "null", "bf16 compute + serving": "bfloat16"}
STEP_BAR = 1.5  # issue 31: bf16 at >= 1.5x the float32 step where the CPU has bf16 units


def run(config: str, steps: int, dtype: str, run_dir: Path) -> tuple[list[dict], float | None]:
    """One whole run; its metrics and the held-out accuracy before step 1."""
    from colorl.metrics.summary import baseline_accuracy

    command = [sys.executable, "-m", "colorl.cli", "train", config, "--run-dir", str(run_dir),
               "--set", f"run.steps={steps}", "--set", "run.save_every=0",
               "--set", f"train.mixed_precision={dtype}", "--set", f"engine.dtype={dtype}"]
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return metrics, baseline_accuracy(run_dir)


def noise(accuracy: float, prompts: int) -> float:
    """Two standard errors of the difference of two accuracies over `prompts` held-out prompts each."""
    p = min(max(accuracy, 1 / prompts), 1 - 1 / prompts)
    return 2 * math.sqrt(2 * p * (1 - p) / prompts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "mixed_precision.json")
    args = parser.parse_args()

    import torch

    from colorl.config import load_config
    from colorl.kernels import onednn_dtypes
    from colorl.launch import rank_threads
    from colorl.machine import cpu_summary
    from colorl.precision import auto_bf16
    from colorl.threads import pinned

    cfg = load_config(args.config, [f"run.steps={args.steps}"])
    with pinned(rank_threads(cfg.launch.nproc)):
        auto, why = auto_bf16()
    native = torch.bfloat16 in onednn_dtypes()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, dtype in VARIANTS.items():
            metrics, before = run(args.config, args.steps, dtype, Path(tmp) / dtype)
            timed = metrics[1:] or metrics  # step 1 includes warm-up
            evals = {0: before, **{r["step"]: r["eval_accuracy"] for r in metrics if r.get("eval_accuracy") is not None}}
            rows[name] = {
                "step_s_median": statistics.median(r["time_step_s"] for r in timed),
                "train_s_median": statistics.median(r["time_train_s"] for r in timed),
                "rollout_s_median": statistics.median(r["time_rollout_s"] for r in timed),
                "held_out": evals, "rewards": [round(r["reward_mean"], 3) for r in metrics],
                "is_weight_mean": statistics.mean(r["is_weight_mean"] for r in metrics),
                "kl_mu_theta": statistics.mean(r["kl_mu_theta"] for r in metrics),
            }
    base, bf16 = rows.values()
    for row in rows.values():
        row["step_speedup"] = base["step_s_median"] / row["step_s_median"]
        row["train_speedup"] = base["train_s_median"] / row["train_s_median"]
    last = max(base["held_out"])
    gap = abs(bf16["held_out"][last] - base["held_out"][last])
    prompts = cfg.run.eval_prompts
    allowed = noise((bf16["held_out"][last] + base["held_out"][last]) / 2, prompts)
    print(f"CPU: {cpu_summary()}; bf16 matrix products: {'yes' if native else 'no'}; "
          f"auto picks {'bf16' if auto else 'fp32'} here ({why})")
    print(f"{'':24}{'step s':>8}{'train s':>9}{'roll s':>8}{'step ×':>8}{'train ×':>9}{'KL(μ‖θ)':>10}  held-out by step"
          "  ·  reward per step")
    for name, row in rows.items():
        held = " ".join(f"{step}:{acc:.0%}" for step, acc in sorted(row["held_out"].items()))
        print(f"{name:24}{row['step_s_median']:>8.2f}{row['train_s_median']:>9.2f}{row['rollout_s_median']:>8.2f}"
              f"{row['step_speedup']:>8.2f}{row['train_speedup']:>9.2f}{row['kl_mu_theta']:>10.5f}  {held}"
              f"  ·  {' '.join(f'{r:.2f}' for r in row['rewards'])}")
    step_met = bf16["step_speedup"] >= STEP_BAR
    curve_met = gap <= allowed
    print(f"bf16 step {bf16['step_speedup']:.2f}x fp32 (bar {STEP_BAR}x): {'met' if step_met else 'not met'}"
          + ("" if native else " — this CPU has no bf16 units: the bar is for CPUs that have them"))
    print(f"held-out at step {last}: {bf16['held_out'][last]:.0%} against {base['held_out'][last]:.0%}, "
          f"{'within' if curve_met else 'beyond'} the noise of {prompts} prompts (±{allowed:.0%})")
    out = args.out
    out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "cpu": cpu_summary(), "bf16_products": native, "auto_picks_bf16": auto,
        "auto_why": why, "config": args.config, "steps": args.steps, "rows": rows, "step_bar": STEP_BAR,
        "step_met": step_met, "held_out_gap": gap, "held_out_noise": allowed, "curve_met": curve_met,
        "command": " ".join(["python", "bench/mixed_precision.py", *sys.argv[1:]])}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
