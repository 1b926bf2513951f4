"""Fault table: every fault at every phase of a real run, how fast it stops and what it loses.

Runs `configs/tiny.yaml` at world size 2 (gloo, CPU) for 4 steps with a checkpoint every step
and a held-out eval every step. Each row injects one fault at step 3 (tests/faults/drill.py):
- kill: kill -9 of a rank (rank 0 when writing the checkpoint, whose rank renames it; else rank 1);
- term-launcher: SIGTERM to the launcher (ranks save at the step boundary and exit);
- disk-full: the run directory on a 3 MiB tmpfs (needs root to mount; the row says if skipped);
- non-finite: train.lr=1e30 makes every loss after step 1 NaN (train.max_nonfinite_in_a_row=2);
- bounded-lag mode: kill / SIGTERM while the rollout thread applies new weights (its resumed
  numbers are not expected to equal an uninterrupted run's: thread timing decides the batches).
Then `--resume` (for disk-full: after moving the run to a disk with room) and compare per-step
metrics and final weights with an uninterrupted run of the same config.

    flock /tmp/colorl-cpu.lock python bench/faults.py        # JSON to bench/results/faults.json
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "faults"))

import drill  # noqa: E402
from colorl.metrics.logger import read_metrics  # noqa: E402
from colorl.train.checkpoint import latest_step  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "faults.json"
PHASES = ("rollout", "train", "sync", "eval", "checkpoint")


def _detected(fault: str, phase: str, run_dir: Path, sets: list[str], resume_in: Path | None,
              reference: Path, nproc: int = 2) -> dict:
    """A fault the run detects itself; it fires right after a metrics line, whose mtime times it."""
    code, out, err, ended = drill.finish(drill.train(run_dir, sets, nproc=nproc))
    message = next((l for l in err.splitlines() if l.startswith("colorl: error:")), err.strip()[-200:])
    done = max((r["step"] for r in read_metrics(run_dir)), default=0)
    checkpoint = latest_step(run_dir)
    equal = None
    if resume_in is not None:
        shutil.copytree(run_dir, resume_in)
        drill.run_clean(resume_in, resume=True)
        equal = drill.same_run(resume_in, reference)
    return {"fault": fault, "phase": phase, "exit_code": code, "message": message,
            "time_to_stop_s": round(ended - (run_dir / "metrics.jsonl").stat().st_mtime, 2), "steps_done": done,
            "checkpoint": checkpoint, "steps_lost": done - (checkpoint or 0), "resume_equal": equal}


def _disk_full(work: Path, reference: Path) -> dict:
    disk = work / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        return {"fault": "disk-full", "phase": "checkpoint", "message": f"skipped: {mounted.stderr.strip()}"}
    try:
        return _detected("disk-full", "checkpoint", disk / "run", [], work / "disk-full-resumed", reference)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def main() -> None:
    started = time.time()
    rows = []
    with tempfile.TemporaryDirectory(prefix="colorl-faults-") as tmp:
        work = Path(tmp)
        reference = work / "reference"
        drill.run_clean(reference)
        for fault in ("kill", "term-launcher"):
            for phase in PHASES:
                rows.append(drill.drill(fault, phase, work / f"{fault}-{phase}", reference).row())
                print(rows[-1], flush=True)
        reference_lag = work / "reference-bounded-lag"
        drill.run_clean(reference_lag, ["mode=bounded_lag"])
        for fault in ("kill", "term-launcher"):
            rows.append(drill.drill(fault, "apply_weights", work / f"lag-{fault}", reference_lag, "bounded_lag").row())
            print(rows[-1], flush=True)
        rows.append(_disk_full(work, reference))
        rows.append(_detected("non-finite", "train", work / "non-finite",
                              ["train.lr=1e30", "train.max_nonfinite_in_a_row=2"], None, reference))
    print(f"\n{'fault':<14} {'phase':<14} {'mode':<12} {'exit':>4} {'time to stop s':>14} {'steps lost':>10} "
          f"{'resume equal':>12}")
    for r in rows:
        equal = {True: "yes", False: "no", None: "n/a"}[r.get("resume_equal")]
        print(f"{r['fault']:<14} {r['phase']:<14} {r.get('mode', 'colocated'):<12} {r.get('exit_code', '-')!s:>4} "
              f"{r.get('time_to_stop_s', '-')!s:>14} {r.get('steps_lost', '-')!s:>10} {equal:>12}")
    for r in rows:
        print(f"  {r['fault']}/{r['phase']}: {r['message']}")
    print(f"\n{len(rows)} drills in {time.time() - started:.0f} s")
    drill.write_json(rows, RESULTS)


if __name__ == "__main__":
    main()
