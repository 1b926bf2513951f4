"""`colorl bench CONFIG --modes colocated,bounded_lag:eta=1,...`: the same workload under each
variant, one after another, each in its own process group, then one table and four charts.

    for each variant:
        resolve its config (a bad value makes this variant "invalid"; the others still run)
        python -m colorl train CONFIG --set ... --run-dir OUT/<variant>   (progress from metrics.jsonl)
        figures from its metrics.jsonl; bench.json rewritten (partial results survive a crash)
    bench.md, PNGs, terminal tables

Exit 0 when every variant ran, 1 when one failed (its error is in the table), 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from colorl.bench.variants import SHORT_KEYS, Variant, VariantError, parse_modes
from colorl.exits import EXIT_RUN_FAILED, fail
from colorl.files import write_atomic

MODES_HELP = ("variants, comma-separated: MODE[:key=value,...], e.g. "
              "colocated,bounded_lag:eta=1,bounded_lag:eta=2,buffer=queue_drop; keys: "
              + ", ".join(f"{k} ({v})" for k, v in SHORT_KEYS.items()) + " or any dotted config key")


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("bench", help="run variants (colocated, bounded-lag at several η) side by side")
    parser.add_argument("config")
    parser.add_argument("--modes", action="append", required=True, help=MODES_HELP)
    parser.add_argument("--steps", type=int, help="steps per variant (default: run.steps)")
    parser.add_argument("--warmup", type=int, help="steps left out of the medians (default: steps/5, 1..3)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key for every variant (repeatable)")
    parser.add_argument("--out", help="output directory (default: runs/bench-CONFIG-DATE)")
    parser.set_defaults(func=cmd_bench)
    return parser


def default_warmup(steps: int) -> int:
    return max(1, min(3, steps // 5)) if steps > 1 else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from colorl.bench import report
    from colorl.bench.progress import BenchProgress
    from colorl.config import ConfigError, load_config

    try:
        variants = parse_modes(",".join(args.modes))
    except VariantError as exc:
        return fail(str(exc))
    if args.steps is not None and args.steps < 1:
        return fail(f"--steps {args.steps}: must be >= 1")
    common = list(args.set) + ([f"run.steps={args.steps}"] if args.steps is not None else [])
    try:
        base = load_config(args.config, common)
    except ConfigError as exc:
        return fail(str(exc))
    steps = base.run.steps
    warmup = default_warmup(steps) if args.warmup is None else args.warmup
    if not 0 <= warmup < steps:
        return fail(f"--warmup {warmup}: must be >= 0 and below the {steps} steps")
    if warmup == 0 and args.warmup is None:
        print(f"colorl: warning: --steps {steps} leaves no step after warm-up: the medians include the first "
              f"step's start-up; use --steps 3 or more for steady figures", file=sys.stderr)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else Path(base.run.dir) / f"bench-{Path(args.config).stem}-{stamp}"
    if out.exists() and any(out.iterdir()):
        return fail(f"--out {out}: directory is not empty; choose another")
    out.mkdir(parents=True, exist_ok=True)

    console = Console()
    bench = {
        "config": args.config, "command": _command_line(args), "date": datetime.datetime.now(datetime.timezone.utc)
        .isoformat(timespec="seconds"), "machine": machine(), "warmup": warmup,
        "workload": {"steps": steps, "rollouts_per_step": base.rollouts_per_step, "model": base.model.path,
                     "engine": base.rollout.engine, "seed": base.run.seed,
                     "length_override": base.rollout.length_override and base.rollout.length_override.model_dump()},
        "variants": [],
    }
    with BenchProgress(len(variants), console) as progress:
        for index, variant in enumerate(variants, 1):
            entry = _run_one(args.config, common, variant, out, warmup, index, progress)
            bench["variants"].append(entry)
            report.write_json(bench, out)
            if entry["status"] == "interrupted":
                break
    _finish(bench, out, console)
    if bench["variants"][-1]["status"] == "interrupted":
        return fail(f"interrupted; partial results in {out}", 130)
    console.print(f"bench written: {out}")
    return EXIT_RUN_FAILED if any(v["status"] != "ok" for v in bench["variants"]) else 0


def _run_one(config: str, common: list[str], variant: Variant, out: Path, warmup: int, index: int, progress) -> dict:
    from colorl.bench import figures
    from colorl.bench.runner import Outcome, run_variant, train_command
    from colorl.config import ConfigError, load_config
    from colorl.metrics.logger import read_metrics
    from colorl.staleness.live import predicted_staleness_for

    overrides = common + variant.overrides
    entry = {"spec": variant.spec, "mode": variant.mode, "overrides": overrides, "run_dir": variant.dirname,
             "status": "invalid", "error": None, "returncode": None, "elapsed_s": None, "figures": None, "series": None}
    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        progress.start(index, variant.spec, 0)
        progress.finish(f"invalid: {exc}")
        return {**entry, "error": str(exc)}
    run_dir = out / variant.dirname
    progress.start(index, variant.spec, cfg.run.steps)
    command = train_command(config, run_dir, overrides)
    try:
        outcome = run_variant(command, run_dir, out / f"{variant.dirname}.log", progress.step)
        status = "ok" if outcome.returncode == 0 else "failed"
    except KeyboardInterrupt:  # the child has been stopped and has saved; report what it measured
        outcome, status = Outcome(None, "interrupted by the user", 0.0), "interrupted"
    records = read_metrics(run_dir)
    workload = figures.Workload(cfg.mode, cfg.rollouts_per_step, cfg.rollout.batch_groups, cfg.filter.zero_variance)
    summary = figures.summarize(records, workload, warmup)
    if summary["rho"] and summary["m_tail"]:  # the closed form at the run's median ρ and M_tail
        summary["staleness_formula"] = predicted_staleness_for(cfg, summary["rho"], summary["m_tail"])
    rate = summary["trained_tokens_per_s"]
    progress.finish(f"done in {outcome.elapsed_s:.0f}s, {rate or 0:.1f} trained tok/s" if status == "ok"
                    else f"{status.upper()}: {outcome.error}")
    return {**entry, "status": status, "error": outcome.error, "returncode": outcome.returncode,
            "elapsed_s": outcome.elapsed_s, "figures": summary, "series": figures.series(records),
            "predicted_from": {"concurrency": cfg.rollout.concurrency, "queue_factor": cfg.staleness.queue_factor,
                               "eta": cfg.staleness.max, "buffer": cfg.staleness.buffer}}


def _finish(bench: dict, out: Path, console) -> None:
    from colorl.bench import figures, plots, report

    summaries = [v["figures"] for v in bench["variants"]]
    for variant, speedup in zip(bench["variants"], figures.speedups(summaries)):
        if variant["figures"] is not None:
            variant["figures"]["speedup"] = speedup
    report.write_json(bench, out)
    charts = plots.draw_all(bench, out)
    write_atomic(out / "bench.md", report.markdown(bench, charts))
    report.print_tables(bench, console)


def _command_line(args: argparse.Namespace) -> str:
    parts = ["colorl", "bench", args.config, "--modes", ",".join(args.modes)]
    for flag in ("steps", "warmup", "out"):
        if getattr(args, flag) is not None:
            parts += [f"--{flag}", str(getattr(args, flag))]
    for item in args.set:
        parts += ["--set", item]
    return shlex.join(parts)


def machine() -> dict:
    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": version("torch"),
            "transformers": version("transformers"), "colorl_commit": commit}
