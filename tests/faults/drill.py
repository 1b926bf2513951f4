"""Fault drills on real runs, shared by tests/faults and bench/faults.py.

A drill starts `colorl train configs/tiny.yaml` at world size 2 (real processes, gloo), injects
one fault through `COLORL_FAULT` (colorl/faults.py) at a named point of a chosen step, times the
stop, then `--resume`s and compares metrics and final weights with an uninterrupted run.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from colorl.metrics.logger import read_metrics
from colorl.train.checkpoint import latest_step

ROOT = Path(__file__).resolve().parents[2]
HELPERS = ROOT / "tests" / "helpers"
STEPS = 4
FAULT_STEP = 3  # a checkpoint exists (save_every=1) and a step follows
SETS = ["task.reward=reward_fns:digit_fraction", "rollout.batch_groups=4", "rollout.max_new_tokens=8",
        f"run.steps={STEPS}", "run.save_every=1", "run.eval_every=1", "run.eval_prompts=4"]
COMPARED = ("loss", "reward_mean", "response_len_mean", "grad_norm", "version", "eval_accuracy")
# which rank acts: rank 0 writes the manifest and renames checkpoints, so it is the one killed there
ACTING_RANK = {"kill": {"checkpoint": 0}, "term-launcher": {}}


@dataclass
class DrillResult:
    fault: str  # kill (kill -9 of a rank) or term-launcher (SIGTERM to the launcher)
    phase: str
    mode: str
    exit_code: int  # 1: a rank failed; 130: stopped at a step boundary with a checkpoint; 0: finished
    message: str  # the run's last line on stderr (on stdout when it finished every step)
    time_to_stop_s: float  # from the fault to the launcher's exit
    steps_done: int  # steps logged before the stop
    checkpoint: int | None  # newest complete checkpoint after the stop
    steps_lost: int  # logged steps that the resume redoes
    resume_equal: bool  # metrics and final weights equal the uninterrupted run's (colocated: required)
    resumed_to_the_end: bool  # the resumed run reached its last step

    def row(self) -> dict:
        return asdict(self)


def train(run_dir: Path, sets=(), resume: bool = False, fault: str | None = None, nproc: int = 2,
          extra_args=()) -> subprocess.Popen:
    argv = [sys.executable, "-m", "colorl", "train", "configs/tiny.yaml", "--nproc", str(nproc),
            "--run-dir", str(run_dir), *extra_args]
    for item in [*SETS, *sets]:
        argv += ["--set", item]
    if resume:
        argv.append("--resume")
    env = {k: v for k, v in os.environ.items() if k != "COLORL_FAULT"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HELPERS), env.get("PYTHONPATH", "")])
    if fault:
        env["COLORL_FAULT"] = fault
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str, float]:
    """Exit code, stdout, stderr and the wall-clock time the launcher exited."""
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err, time.time()


def run_clean(run_dir: Path, sets=(), resume: bool = False) -> None:
    code, out, err, _ = finish(train(run_dir, sets, resume))
    if code != 0:
        raise RuntimeError(f"run {run_dir} failed ({code}): {err[-2000:]}")


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in (run_dir / "checkpoints" / f"step_{step}" / "model").glob("*.safetensors"):
        tensors.update(load_file(file))
    return tensors


def same_run(a: Path, b: Path) -> bool:
    """Per-step metrics (the last line for a step wins, as every reader sees it) and final weights."""
    pick = lambda d: [{k: r.get(k) for k in ("step",) + COMPARED} for r in read_metrics(d)]
    wa, wb = weights(a, STEPS), weights(b, STEPS)
    return pick(a) == pick(b) and bool(wa) and wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def drill(fault: str, phase: str, run_dir: Path, reference: Path, mode: str = "colocated") -> DrillResult:
    """One fault at `phase` of step FAULT_STEP, then --resume; `reference` is an uninterrupted run
    of the same mode. In bounded-lag mode the rollout thread's timing differs from run to run, so
    only colocated mode is expected to resume to the same numbers."""
    rank = ACTING_RANK[fault].get(phase, 1 if fault == "kill" else 0)
    sets = [f"mode={mode}"]
    code, out, err, ended = finish(train(run_dir, sets, fault=f"{fault}@{phase}:{FAULT_STEP}:{rank}"))
    marks = re.findall(r"colorl-fault: \S+ pid \d+ at ([\d.]+)", err)
    if not marks:
        raise RuntimeError(f"the fault never fired ({code}): {err[-2000:]}")
    lines = out.strip().splitlines()[-1:] if code == 0 else [l for l in err.splitlines()
                                                             if l.strip() and not l.startswith("colorl-fault")]
    done = max((r["step"] for r in read_metrics(run_dir)), default=0)
    checkpoint = latest_step(run_dir)
    if (checkpoint or 0) < STEPS:
        run_clean(run_dir, sets, resume=True)
    return DrillResult(fault, phase, mode, code, lines[-1] if lines else "", round(ended - float(marks[0]), 2), done,
                       checkpoint, done - (checkpoint or 0), same_run(run_dir, reference), latest_step(run_dir) == STEPS)


def write_json(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")
