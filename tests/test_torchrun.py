"""Multi-node through torchrun, on CPU: each process runs its own rank, no spawning.

- `torchrun --standalone --nproc-per-node 2 -m colorl train configs/tiny.yaml`: the CLI's
  torchrun path; both ranks on one node gather weights through /dev/shm; an existing run
  directory is refused in one line; `--resume` continues the run.
- two torchrun "nodes" on 127.0.0.1 (c10d rendezvous, one process each): the checkpoint engine
  must take the process-group path between nodes, and after three steps every rank's engine
  holds the trainer's full weights bit for bit.

Every torchrun here gets `--local-addr 127.0.0.1`: torchrun otherwise serves its store on the
machine's FQDN, and where the hostname does not resolve (a CI container) the rendezvous waits
forever for a store that never started.
"""
from __future__ import annotations

import pytest

import json
import os
import subprocess
import sys
from pathlib import Path

from colorl.distributed import free_port

pytestmark = pytest.mark.matrix  # whole runs under torchrun: make test-matrix

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--local-addr", "127.0.0.1"]
HELPER = ROOT / "tests" / "helpers" / "torchrun_sync_check.py"


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    return env


def _start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(nodes: list[subprocess.Popen], timeout_s: float = 180) -> list[tuple[str, str]]:
    """Each process's (stdout, stderr); on a hang, kill them all and fail with what they printed."""
    try:
        return [node.communicate(timeout=timeout_s) for node in nodes]
    except subprocess.TimeoutExpired:
        for node in nodes:
            node.kill()
        printed = [node.communicate()[1][-2000:] for node in nodes]
        raise AssertionError(f"torchrun still running after {timeout_s:.0f} s:\n" + "\n---\n".join(printed))


def _standalone(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    command = TORCHRUN + ["--standalone", "--nproc-per-node", "2", "-m", "colorl", "train", "configs/tiny.yaml",
                          "--run-dir", str(run_dir), *args]
    node = _start(command)
    [(stdout, stderr)] = _finish([node])
    return subprocess.CompletedProcess(command, node.returncode, stdout, stderr)


def test_standalone_torchrun_runs_the_ranks_in_place_refuses_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    done = _standalone(run_dir, "--set", "run.steps=2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"run finished: {run_dir}" in done.stdout
    starts = [line for line in (run_dir / "events.log").read_text().splitlines() if " start " in line]
    assert len(starts) == 2 and all("world=2" in line and "sync=shared_memory" in line for line in starts)

    again = _standalone(run_dir)  # rank 0's check stops both ranks, with colorl's one line
    assert again.returncode != 0
    assert [line for line in again.stderr.splitlines() if line.startswith("colorl: error:")] == [
        f"colorl: error: run directory {run_dir} already holds a run; pass --resume or choose another run.name"]

    resumed = _standalone(run_dir, "--resume", "--set", "run.steps=3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "step_3").is_dir()


def test_two_nodes_sync_through_the_process_group_and_engines_match_trainers(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    command = TORCHRUN + ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "colorl-test",
                          str(HELPER), str(ROOT / "configs" / "tiny.yaml"), str(tmp_path / "run"), str(out)]
    nodes = [_start(command) for _ in range(2)]
    outputs = _finish(nodes)
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert sorted(rank["node"] for rank in ranks) == [0, 1]
    for rank in ranks:
        assert rank["transport"] == "process_group"
        assert rank["steps"] == 3 and rank["engine_version"] == 3
        assert rank["differing"] == []
