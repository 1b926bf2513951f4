"""Does GRPO learn? Runs configs/smollm2-arith.yaml and measures held-out accuracy before and after.

Baseline: the same model before training, evaluated with the same engine, prompts and seeds.
Writes bench/results/convergence.json and bench/results/convergence.png (reward curve).

    python bench/convergence.py [--config configs/smollm2-arith.yaml] [--set key=value ...]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def evaluate_checkpoint(cfg, run_dir: Path | None, step: int | None, eval_problems: int, samples: int) -> dict:
    import torch

    from colorl.engines import build_engine
    from colorl.evaluate import evaluate
    from colorl.models import load_model, load_tokenizer, resolve_model_path
    from colorl.tasks import build_task
    from colorl.train.checkpoint import checkpoint_dir, load_model_weights

    model_dir = resolve_model_path(cfg.model.path)
    tokenizer = load_tokenizer(model_dir)
    task = build_task(cfg.task, cfg.run.seed)
    engine = build_engine(cfg.rollout.engine, model_dir, cfg.engine)
    if run_dir is not None:
        trained = load_model(model_dir)
        load_model_weights(checkpoint_dir(run_dir, step), trained)
        engine.load_weights((name, tensor) for name, tensor in trained.named_parameters()
                            if name in engine.named_weights())
    problems = task.eval_problems(eval_problems)
    stop = (tokenizer.eos_token_id,)
    common = dict(max_new_tokens=cfg.rollout.max_new_tokens, system_prompt=cfg.model.system_prompt, stop_ids=stop)
    with torch.no_grad():
        greedy = evaluate(engine, problems, task.reward, tokenizer, **common)
        sampled = evaluate(engine, problems, task.reward, tokenizer, samples=samples, temperature=1.0, **common)
    return {"greedy_accuracy": greedy.accuracy, "sampled_accuracy": sampled.accuracy, "problems": len(problems),
            "samples": samples}


def plot(metrics: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    reward = [m["reward_mean"] for m in metrics]
    window = 5
    smooth = [sum(reward[max(0, i - window + 1): i + 1]) / len(reward[max(0, i - window + 1): i + 1])
              for i in range(len(reward))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, reward, "o-", alpha=0.4, label="reward per step (32 samples)")
    ax.plot(steps, smooth, "-", linewidth=2, label=f"moving mean ({window} steps)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward (fraction correct)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/smollm2-arith.yaml")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--eval-problems", type=int, default=20)
    parser.add_argument("--samples", type=int, default=4)
    args = parser.parse_args()

    from colorl.config import load_config
    from colorl.metrics.logger import read_metrics
    from colorl.train.checkpoint import latest_step

    cfg = load_config(args.config, args.set)
    run_dir = ROOT / "bench" / "runs" / f"convergence-{time.strftime('%Y%m%d-%H%M%S')}"
    before = evaluate_checkpoint(cfg, None, None, args.eval_problems, args.samples)
    print(f"before: {before}", flush=True)
    started = time.perf_counter()
    command = [sys.executable, "-m", "colorl.cli", "train", args.config, "--run-dir", str(run_dir)]
    for item in args.set:
        command += ["--set", item]
    subprocess.run(command, check=True, env=dict(os.environ))
    train_s = time.perf_counter() - started
    step = latest_step(run_dir)
    after = evaluate_checkpoint(cfg, run_dir, step, args.eval_problems, args.samples)
    metrics = read_metrics(run_dir)
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(metrics, RESULTS / "convergence.png", f"GRPO on {cfg.model.path}: {cfg.task.name}")
    first, last = metrics[:5], metrics[-5:]
    mean = lambda rows: sum(r["reward_mean"] for r in rows) / len(rows)
    result = {
        "date": time.strftime("%Y-%m-%d"), "config": args.config, "overrides": args.set, "steps": step,
        "train_wall_s": train_s, "before": before, "after": after,
        "reward_first5": mean(first), "reward_last5": mean(last),
        "ratio_greedy_after_before": after["greedy_accuracy"] / before["greedy_accuracy"] if before["greedy_accuracy"] else None,
        "ratio_sampled_after_before": after["sampled_accuracy"] / before["sampled_accuracy"] if before["sampled_accuracy"] else None,
        "step_time_s_median": sorted(r["time_step_s"] for r in metrics)[len(metrics) // 2],
        "run_dir": str(run_dir.relative_to(ROOT)),
    }
    (RESULTS / "convergence.json").write_text(json.dumps(result, indent=2))
    print(f"{'':24}{'before':>10}{'after':>10}{'ratio':>8}")
    for key in ("greedy_accuracy", "sampled_accuracy"):
        ratio = after[key] / before[key] if before[key] else float("nan")
        print(f"{key:24}{before[key]:>10.3f}{after[key]:>10.3f}{ratio:>8.2f}")
    print(f"{'reward (first/last 5)':24}{result['reward_first5']:>10.3f}{result['reward_last5']:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
