"""`colorl` command line: train, export, predict, simulate, plan.

Bad input ends with one line on stderr and exit code 2; a failed run with exit code 1.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.panel import Panel

from colorl.plan import add_plan_parser
from colorl.staleness.commands import add_predict_parser, add_simulate_parser

EXIT_BAD_INPUT = 2
EXIT_RUN_FAILED = 1


def _quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def fail(message: str, code: int = EXIT_BAD_INPUT) -> int:
    print(f"colorl: error: {message}", file=sys.stderr)
    return code


def _check_devices(requested: str, nproc: int, engine: str = "native") -> str:
    """The device the ranks use; `nproc`: ranks on this host. SGLang needs CUDA and its package."""
    import torch

    if engine == "sglang":
        from colorl.engines.sglang import unavailable_reason

        reason = unavailable_reason()
        if reason:
            raise ValueError(reason)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if requested == "auto" else requested
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("launch.device=cuda: no CUDA device is available here; use --device cpu")
    if device == "cuda" and nproc > torch.cuda.device_count():
        raise ValueError(f"launch.nproc={nproc}: only {torch.cuda.device_count()} CUDA devices here")
    return device


def cmd_train(args) -> int:
    from colorl.config import ConfigError, dump_config, load_config
    from colorl.launch import TorchrunRank
    from colorl.plan import engine_check_note
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
        build_task(cfg.task, cfg.run.seed)  # task options and dataset files, before any process starts
    except (ConfigError, TaskOptionError, ValueError) as exc:
        return fail(str(exc))
    run_dir = Path(args.run_dir) if args.run_dir else Path(cfg.run.dir) / cfg.run.name
    if args.dry_run:  # a config for another machine (e.g. 8 GPUs) validates here without its devices
        print(dump_config(cfg), end="")
        print(f"# run directory: {run_dir}\n# launch: {cfg.launch.nproc} x {cfg.launch.device}")
        note = engine_check_note(cfg)
        if note:
            print(f"# {note}")
        return 0
    try:
        device = _check_devices(cfg.launch.device, spot.local_world if spot else cfg.launch.nproc, cfg.rollout.engine)
    except ValueError as exc:
        return fail(str(exc))
    from colorl.train.checkpoint import latest_step
    from colorl.worker import prepare_run_dir, run_rank

    def prepare() -> None:
        if args.resume and latest_step(run_dir) is None:
            raise ValueError(f"--resume: no complete checkpoint in {run_dir / 'checkpoints'}")
        preflight(cfg, device)
        prepare_run_dir(cfg, run_dir, args.resume)

    rank_args = (cfg.model_dump(mode="json"), str(run_dir), args.resume, device)
    if spot is not None:
        from colorl.launch import run_in_place

        code = run_in_place(spot, run_rank, device, rank_args, cfg.launch.collective_timeout_s, prepare)
        if code == 0 and spot.rank == 0:
            _report_done(cfg, run_dir)
        return code
    try:
        prepare()
    except (ValueError, OSError) as exc:
        return fail(str(exc))
    from colorl.launch import launch

    failure = launch(run_rank, cfg.launch.nproc, device, rank_args, cfg.launch.collective_timeout_s)
    if failure is None:
        _report_done(cfg, run_dir)
        return 0
    if failure.interrupted:
        return fail(f"interrupted: {failure.error.splitlines()[0]}; run directory kept: {run_dir}", 130)
    Console(stderr=True).print(Panel(_readable(failure.error), title=f"rank {failure.rank} failed", border_style="red"))
    return fail(f"run failed on rank {failure.rank}; run directory kept: {run_dir}", EXIT_RUN_FAILED)


def _report_done(cfg, run_dir: Path) -> None:
    from colorl.train.checkpoint import latest_step

    done = latest_step(run_dir) or 0
    if done < cfg.run.steps:
        print(f"run stopped after step {done} (checkpoint saved): continue with --resume --run-dir {run_dir}")
    else:
        print(f"run finished: {run_dir}")


def _readable(error: str, frames: int = 20) -> str:
    """The error line first, then only the innermost part of the traceback."""
    head, _, trace = error.partition("\n\n")
    lines = trace.rstrip().splitlines()
    if len(lines) > frames:
        lines = ["  ..."] + lines[-frames:]
    return "\n".join([head, ""] + lines) if lines else head


def preflight(cfg, device: str = "cpu") -> None:
    """What would otherwise fail inside the ranks: build the model folder once (a cached alias),
    load its tokenizer, apply the chat template, draw a problem; on CUDA, the memory plan."""
    from colorl.config import ConfigError
    from colorl.models import ModelNotFound, encode_chat, load_tokenizer, resolve_model_path
    from colorl.tasks import build_task

    try:
        model_dir = resolve_model_path(cfg.model.path)
    except ModelNotFound as exc:
        raise ConfigError(str(exc)) from None
    task = build_task(cfg.task, cfg.run.seed)
    problem = task.train_problem(0)
    try:
        encode_chat(load_tokenizer(model_dir), problem.prompt, cfg.model.system_prompt)
    except Exception as exc:  # tokenizer / template errors come in many types
        raise ConfigError(f"model.path={cfg.model.path!r}: cannot build a chat prompt "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    if device == "cuda":
        import torch

        from colorl.plan import plan_for_run

        plan = plan_for_run(cfg, model_dir, torch.cuda.get_device_properties(0).total_memory)
        if not plan.fits:
            print(plan.render(), file=sys.stderr)
            raise ConfigError(f"{plan.verdict()} (`colorl plan` shows this table before launch)")


def cmd_export(args) -> int:
    from colorl.export import ExportError, export_run

    try:
        out = export_run(Path(args.run_dir), Path(args.out), args.step)
    except ExportError as exc:
        return fail(str(exc))
    print(f"exported: {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="colorl", description="single-node GRPO trainer")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run GRPO training from a YAML config")
    train.add_argument("config")
    train.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    train.add_argument("--nproc", type=int, help="ranks to launch (default: launch.nproc)")
    train.add_argument("--device", choices=["auto", "cpu", "cuda"])
    train.add_argument("--run-dir", help="default: run.dir/run.name")
    train.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    train.add_argument("--dry-run", action="store_true", help="validate and print the resolved config")
    train.set_defaults(func=cmd_train)

    export = sub.add_parser("export", help="write a Hugging Face folder from a run's checkpoint")
    export.add_argument("run_dir")
    export.add_argument("out")
    export.add_argument("--step", type=int, help="default: the latest checkpoint")
    export.set_defaults(func=cmd_export)

    add_predict_parser(sub)
    add_simulate_parser(sub)
    add_plan_parser(sub)
    return parser



def main(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed its one-line usage error
        return int(exc.code or 0) and EXIT_BAD_INPUT
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except BrokenPipeError:  # output piped into e.g. `head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
