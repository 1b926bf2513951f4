"""Failures end the whole group quickly with a readable error; Ctrl-C saves and exits cleanly."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

HELPERS = str(Path(__file__).parent / "helpers")
SETS = ["rollout.engine=hf", "task.reward=reward_fns:digit_fraction", "rollout.batch_groups=2",
        "rollout.max_new_tokens=8", "run.steps=200", "run.save_every=0"]


def _start(run_dir: Path, nproc: int) -> subprocess.Popen:
    from colorl_process import start_colorl

    args = ["train", "configs/tiny.yaml", "--nproc", str(nproc), "--run-dir", str(run_dir)]
    for item in SETS:
        args += ["--set", item]
    return start_colorl(args, HELPERS)


def _wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"run ended early: {proc.communicate()}")
        if metrics.exists() and len(metrics.read_text().splitlines()) >= step:
            return
        time.sleep(0.2)
    proc.kill()
    pytest.fail("run made no progress")


def _rank_pids(run_dir: Path) -> dict[int, int]:
    found = re.findall(r"rank (\d+) pid (\d+)", (run_dir / "events.log").read_text())
    return {int(r): int(p) for r, p in found}


def test_killed_rank_stops_the_group_with_a_clear_error(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, nproc=2)
    _wait_for_step(run, proc, 1)
    os.kill(_rank_pids(run)[1], signal.SIGKILL)
    killed_at = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - killed_at < 30
    assert proc.returncode == 1
    assert "rank 1 died (killed by SIGKILL)" in err
    assert "run failed on rank 1" in err
    assert all(json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, nproc=1)
    _wait_for_step(run, proc, 1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err  # the shell's code for Ctrl-C, after a clean save
    saved = [p.name for p in (run / "checkpoints").iterdir()]
    assert len(saved) == 1 and saved[0].startswith("step_") and not saved[0].endswith(".partial")
    assert "stopped by signal" in (run / "events.log").read_text()
    assert f"--resume --run-dir {run}" in err
    assert "stopping after the current step" in err


def test_ranks_exit_when_the_launcher_is_killed(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, nproc=1)
    _wait_for_step(run, proc, 1)
    pid = _rank_pids(run)[0]
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    pytest.fail("rank kept running after its launcher was killed")


def test_the_earliest_report_names_the_cause_not_the_peers_that_failed_after_it(tmp_path):
    """Both ranks can be found dead in one poll: the peer's collective error (rank 0) was written
    after the cause's traceback (rank 1), and the launcher must show the cause."""
    from types import SimpleNamespace

    from colorl.launch import _first_failure

    procs = [SimpleNamespace(exitcode=1), SimpleNamespace(exitcode=1)]
    cause, peer = tmp_path / "rank1.txt", tmp_path / "rank0.txt"
    cause.write_text("RuntimeError: the rollout thread failed")
    peer.write_text("RuntimeError: gloo: Connection closed by peer")
    written = time.time_ns()
    os.utime(cause, ns=(written - 10**9, written - 10**9))
    os.utime(peer, ns=(written, written))
    failure = _first_failure(procs, str(tmp_path))
    assert (failure.rank, failure.error) == (1, "RuntimeError: the rollout thread failed")
    os.utime(peer, ns=(written - 2 * 10**9, written - 2 * 10**9))  # and the other way round
    assert _first_failure(procs, str(tmp_path)).rank == 0
