"""Run one bench variant as `python -m colorl train ...` in its own session (a fresh process group),
watch its metrics.jsonl grow, and turn a failure into one readable line.

A separate process per variant keeps variants from sharing anything (threads, allocator state,
a broken process group), and a variant that crashes or is rejected only ends that variant.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from colorl.metrics.logger import read_metrics

POLL_S = 1.0
STOP_GRACE_S = 120.0  # a stopped run saves a checkpoint before it exits


@dataclass
class Outcome:
    returncode: int | None
    error: str | None
    elapsed_s: float


def train_command(config: str, run_dir: Path, overrides: list[str]) -> list[str]:
    command = [sys.executable, "-m", "colorl", "train", config, "--run-dir", str(run_dir)]
    for item in overrides:
        command += ["--set", item]
    return command


def run_variant(command: list[str], run_dir: Path, log_path: Path,
                on_progress: Callable[[int], None]) -> Outcome:
    """Run to completion, calling `on_progress(steps done)` as lines appear. Ctrl-C stops the
    child (it saves at its next step boundary) and is re-raised."""
    env = {**os.environ, "COLUMNS": "240"}  # the child's error panel keeps its first line whole
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
        try:
            done = -1
            while proc.poll() is None:
                time.sleep(POLL_S)
                steps = len(read_metrics(run_dir))
                if steps != done:
                    done = steps
                    on_progress(steps)
        except KeyboardInterrupt:
            stop_group(proc)
            raise
    on_progress(len(read_metrics(run_dir)))
    error = None if proc.returncode == 0 else error_summary(log_path.read_text(encoding="utf-8"), proc.returncode)
    return Outcome(proc.returncode, error, time.perf_counter() - start)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the whole group (ranks save and exit), SIGKILL if it outstays the grace period."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def error_summary(log: str, returncode: int) -> str:
    """One line: the failing rank's exception when `colorl train` printed its error panel, else
    the CLI's own `colorl: error:` line, else the last output line."""
    lines = [line.rstrip() for line in log.splitlines()]
    for i, line in enumerate(lines[:-1]):
        if line.startswith("╭") and " failed " in line:
            title = line.strip("╭╮─ ")
            return f"{title}: {lines[i + 1].strip('│ ')}"
    cli_errors = [line.removeprefix("colorl: error: ") for line in lines if line.startswith("colorl: error: ")]
    if cli_errors:
        return cli_errors[-1]
    tail = [line for line in lines if line.strip()]
    return tail[-1] if tail else f"exit code {returncode} without output"
