"""`colorl` command line: train, export, plot, predict, simulate, plan, bench, doctor.

Bad input ends with one line on stderr and exit code 2; a failed run with exit code 1.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.panel import Panel

from colorl.bench.command import add_bench_parser
from colorl.doctor import add_doctor_parser
from colorl.exits import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_RUN_FAILED, fail, installed_version
from colorl.plan import add_plan_parser
from colorl.preflight import MachineCheckFailed, check_devices, check_resume, preflight
from colorl.staleness.commands import add_predict_parser, add_simulate_parser

def _quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TQDM_DISABLE", "1")  # library progress bars (GGUF conversion, datasets); colorl says what it does


def cmd_train(args) -> int:
    started = time.perf_counter()
    from colorl.config import ConfigError, load_config
    from colorl.launch import TorchrunRank
    from colorl.tasks import TaskOptionError, build_task

    spot = TorchrunRank.from_env()
    overrides = list(args.set or [])
    if args.nproc is not None:
        overrides.append(f"launch.nproc={args.nproc}")
    if spot is not None:  # torchrun decides the world; this process is one of its ranks
        overrides.append(f"launch.nproc={spot.world}")
    if args.device is not None:
        overrides.append(f"launch.device={args.device}")
    try:
        cfg = load_config(args.config, overrides)
        task = build_task(cfg.task, cfg.run.seed)  # task options and dataset files, before any process starts
    except (ConfigError, TaskOptionError, ValueError) as exc:
        return fail(str(exc))
    _warn(getattr(task, "notes", list)())
    run_dir = Path(args.run_dir) if args.run_dir else Path(cfg.run.dir) / cfg.run.name
    args.resume = args.resume or args.resume_from_last_good
    if args.dry_run:
        return _dry_run(cfg, run_dir, args, spot)
    try:
        device = check_devices(cfg.launch.device, spot.local_world if spot else cfg.launch.nproc, cfg.rollout.engine)
    except ValueError as exc:
        return fail(str(exc))
    from colorl.worker import prepare_run_dir, run_rank

    def prepare() -> None:
        """Rank 0's checks before any rank starts (under torchrun, in place); ValueError: one line."""
        _warn(preflight(cfg, device))
        if args.resume:
            _check_resume_point(cfg, run_dir, args)
        prepare_run_dir(cfg, run_dir, args.resume)

    rank_args = (cfg.model_dump(mode="json"), str(run_dir), args.resume, device)
    if spot is not None:
        from colorl.distributed import exit_rank
        from colorl.launch import run_in_place

        code = run_in_place(spot, run_rank, device, rank_args, cfg.launch.collective_timeout_s, prepare)
        if code == 0 and spot.rank == 0:
            code = _finished(cfg, run_dir, args.config, time.perf_counter() - started)
        exit_rank(code)
    try:
        prepare()
    except (ValueError, OSError) as exc:
        return fail(str(exc))
    from colorl.launch import launch

    failure = launch(run_rank, cfg.launch.nproc, device, rank_args, cfg.launch.collective_timeout_s)
    if failure is None:
        return _finished(cfg, run_dir, args.config, time.perf_counter() - started)
    if failure.interrupted:
        return fail(f"interrupted: {failure.error.splitlines()[0]}; run directory kept: {run_dir}", EXIT_INTERRUPTED)
    if "\n" not in failure.error.strip():  # a fault the run explained itself: its message is the report
        return fail(f"run failed on rank {failure.rank}: {failure.error.strip()}; run directory kept: {run_dir}",
                    EXIT_RUN_FAILED)
    Console(stderr=True).print(Panel(_readable(failure.error), title=f"rank {failure.rank} failed", border_style="red"))
    return fail(f"run failed on rank {failure.rank}; run directory kept: {run_dir}", EXIT_RUN_FAILED)


def _dry_run(cfg, run_dir: Path, args, spot) -> int:
    """Every launch check, nothing started or written. A config for another machine (e.g. 8 GPUs)
    validates here: what only its devices can answer is a warning, not an error."""
    from colorl.config import ConfigError, dump_config
    from colorl.plan import engine_check_note

    try:
        device = check_devices(cfg.launch.device, spot.local_world if spot else cfg.launch.nproc, cfg.rollout.engine)
        here = True
    except MachineCheckFailed as exc:
        print(f"colorl: warning: this machine could not launch it: {exc}", file=sys.stderr)
        device, here = cfg.launch.device if cfg.launch.device != "auto" else "cpu", False
    try:
        _warn(preflight(cfg, device, here))
        if args.resume:
            _check_resume_point(cfg, run_dir, args)
    except (ConfigError, ValueError, OSError) as exc:
        return fail(str(exc))
    print(dump_config(cfg), end="")
    chosen = f" (launch.device: {cfg.launch.device})" if cfg.launch.device != device else ""
    print(f"# run directory: {run_dir}\n# launch: {cfg.launch.nproc} x {device}{chosen}")
    note = engine_check_note(cfg)
    if note:
        print(f"# {note}")
    if here:  # what `auto` becomes on this machine, at the ranks' thread count
        from colorl.launch import rank_threads
        from colorl.precision import choose
        from colorl.threads import pinned

        with pinned(rank_threads(cfg.launch.nproc)):
            print(f"# {choose(cfg, device).line(cfg.model.dtype)}")
    if cfg.train.max_tokens_per_micro_batch is None:
        from colorl.config import micro_batch_tokens

        print(f"# micro-batches: {micro_batch_tokens(cfg.train, device)} tokens (train.max_tokens_per_micro_batch: "
              f"null, {device.split(':')[0]}'s default)")
    return 0


def _check_resume_point(cfg, run_dir: Path, args) -> None:
    from colorl.train.checkpoint import resume_step

    step, notes = resume_step(run_dir, fall_back=args.resume_from_last_good)
    for note in notes:
        print(f"colorl: {note}", file=sys.stderr)
    check_resume(cfg, run_dir, step, args.force)


def _warn(notes: list[str]) -> None:
    for note in notes:
        print(f"colorl: warning: {note}", file=sys.stderr)


def _finished(cfg, run_dir: Path, config: str, wall_s: float) -> int:
    from colorl.metrics.summary import next_commands, summary_lines
    from colorl.train.checkpoint import latest_step

    done = latest_step(run_dir) or 0
    for line in summary_lines(run_dir, wall_s, cfg.run.eval_prompts) + next_commands(run_dir):
        print(line)
    if done < cfg.run.steps:  # the ranks stopped at a step boundary on Ctrl-C / SIGTERM and saved
        print(f"stopped after step {done} of {cfg.run.steps} (checkpoint saved); continue with: "
              f"colorl train {config} --resume --run-dir {run_dir}", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"run finished: {run_dir}")
    return 0


def _readable(error: str, frames: int = 20) -> str:
    """The error line first, then only the innermost part of the traceback."""
    head, _, trace = error.partition("\n\n")
    lines = trace.rstrip().splitlines()
    if len(lines) > frames:
        lines = ["  ..."] + lines[-frames:]
    return "\n".join([head, ""] + lines) if lines else head


def cmd_export(args) -> int:
    from colorl.export import ExportError, export_run

    try:
        out = export_run(Path(args.run_dir), Path(args.out), args.step)
    except ExportError as exc:
        return fail(str(exc))
    print(f"exported: {out}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors as one line like every other bad input (subcommands' parsers too)."""

    def parse_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)

    def error(self, message: str):
        args = getattr(self, "_argv", sys.argv[1:])
        loose = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--set" and "=" not in args[i + 1]]
        if loose:  # `--set run.steps 3`: argparse only sees a stray "3"
            message = f"--set {loose[0]}: --set takes KEY=VALUE in one word, e.g. --set {loose[0]}=..."
        fail(f"{message} (see {self.prog} --help)")
        raise SystemExit(EXIT_BAD_INPUT)



def cmd_plot(args) -> int:
    from colorl.plot import PlotError, plot_run

    try:
        files = plot_run(Path(args.run_dir), Path(args.out) if args.out else None)
    except PlotError as exc:
        return fail(str(exc))
    for path in files:
        print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="colorl", description="single-node GRPO trainer")
    parser.add_argument("--version", action="version", version=f"colorl {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run GRPO training from a YAML config")
    train.add_argument("config")
    train.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    train.add_argument("--nproc", type=int, help="ranks to launch (default: launch.nproc)")
    train.add_argument("--device", choices=["auto", "cpu", "cuda"])
    train.add_argument("--run-dir", help="default: run.dir/run.name")
    train.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    train.add_argument("--resume-from-last-good", action="store_true",
                       help="like --resume, but set damaged newer checkpoints aside and use the newest usable one")
    train.add_argument("--force", action="store_true",
                       help="with --resume: accept changed keys that alter the data or shapes (model, task, ...)")
    train.add_argument("--dry-run", action="store_true", help="validate and print the resolved config")
    train.set_defaults(func=cmd_train)

    export = sub.add_parser("export", help="write a Hugging Face folder from a run's checkpoint")
    export.add_argument("run_dir")
    export.add_argument("out")
    export.add_argument("--step", type=int, help="default: the latest checkpoint")
    export.set_defaults(func=cmd_export)

    plot = sub.add_parser("plot", help="draw PNG charts of a run from its metrics.jsonl")
    plot.add_argument("run_dir")
    plot.add_argument("--out", help="folder for the PNGs (default: RUN_DIR/plots)")
    plot.set_defaults(func=cmd_plot)

    add_predict_parser(sub)
    add_simulate_parser(sub)
    add_plan_parser(sub)
    add_bench_parser(sub)
    add_doctor_parser(sub)
    return parser



def main(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse printed its one-line usage error, or --help
        return int(exc.code or 0) and EXIT_BAD_INPUT
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return fail("interrupted", EXIT_INTERRUPTED)
    except BrokenPipeError:  # output piped into e.g. `head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
