"""Kill anywhere, lose nothing: kill -9 of a rank, or SIGTERM to the launcher, at each phase of a
real world-size-2 run; the run stops within 30 s saying why, the newest complete checkpoint loads,
and `--resume` ends with the metrics and weights of an uninterrupted run.

Bounded-lag mode gets the same drills plus the rollout thread applying weights (`slow`).

The default suite drills the trickiest point (a rank killed half-way through writing a
checkpoint) and a short SIGTERM run; the full table is `slow` (and `bench/faults.py`).
"""
from __future__ import annotations

import time

import pytest

import drill

pytestmark = pytest.mark.matrix  # fault drills: whole runs killed and resumed: make test-matrix

PHASES = ("rollout", "train", "sync", "eval", "checkpoint")
DEFAULT = {("kill", "checkpoint")}
CASES = [pytest.param(f, p, marks=() if (f, p) in DEFAULT else pytest.mark.slow, id=f"{f}-{p}")
         for f in ("kill", "term-launcher") for p in PHASES]


@pytest.mark.parametrize("fault, phase", CASES)
def test_fault_at_each_phase_loses_nothing(tmp_path, reference_run, fault, phase):
    result = drill.drill(fault, phase, tmp_path / "run", reference_run)
    assert result.time_to_stop_s < 30, result
    if fault == "kill":
        rank = drill.ACTING_RANK["kill"].get(phase, 1)
        assert result.exit_code == 1, result
        assert f"run failed on rank {rank}: rank {rank} died (killed by SIGKILL)" in result.message, result
    elif result.exit_code == 130:  # stopped at the step boundary after the fault, with a checkpoint
        assert f"stopped after step {result.checkpoint} of {drill.STEPS} (checkpoint saved)" in result.message, result
    else:  # SIGTERM while saving the last-but-one step: the flag is read after the last step
        assert result.exit_code == 0 and "run finished" in result.message, result
    assert result.checkpoint is not None and result.checkpoint >= drill.FAULT_STEP - 1, result
    assert not list((tmp_path / "run" / "checkpoints").glob("*.partial")), "resume left a partial folder"
    assert result.resume_equal and result.resumed_to_the_end, result


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "term-launcher"])
@pytest.mark.parametrize("phase", PHASES + ("apply_weights",))
def test_bounded_lag_fault_at_each_phase_stops_and_resumes(tmp_path, reference_bounded_lag, fault, phase):
    """Bounded-lag mode, including the rollout thread applying new weights: the same stop and
    resume; the numbers may differ from an uninterrupted run (thread timing decides the batches)."""
    result = drill.drill(fault, phase, tmp_path / "run", reference_bounded_lag, mode="bounded_lag")
    assert result.time_to_stop_s < 30, result
    assert result.exit_code in ((1,) if fault == "kill" else (0, 130)), result
    assert result.checkpoint is not None and result.checkpoint >= drill.FAULT_STEP - 1, result
    assert result.resumed_to_the_end, result


def test_sigterm_to_the_launcher_saves_and_stops_at_the_step_boundary(tmp_path):
    run = tmp_path / "run"
    proc = drill.train(run, ["run.steps=50", "run.save_every=0", "run.eval_every=0"], nproc=1)
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.terminate()
    sent = time.time()
    code, out, err, ended = drill.finish(proc)
    assert code == 130 and ended - sent < 30, err
    assert "colorl: SIGTERM: stopping after the current step" in err
    step = drill.latest_step(run)
    assert step is not None and step < 50 and f"stopped after step {step} of 50 (checkpoint saved)" in err
