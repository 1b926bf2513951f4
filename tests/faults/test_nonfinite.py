"""Numerical faults in a real run: N non-finite steps in a row stop it, with a checkpoint of the
last good step and one line saying why (train.max_nonfinite_in_a_row)."""
from __future__ import annotations

import math

import drill
from colorl.metrics.logger import read_metrics
from colorl.train.checkpoint import latest_step


def test_a_diverging_run_stops_at_the_last_good_step(tmp_path):
    # lr 1e30: step 1 is finite but throws the weights to ~1e30, so every later loss is NaN
    run = tmp_path / "run"
    sets = ["train.lr=1e30", "run.steps=6", "run.save_every=0", "run.eval_every=0", "train.max_nonfinite_in_a_row=2"]
    code, out, err, _ = drill.finish(drill.train(run, sets, nproc=1))
    lines = [line for line in err.splitlines() if line.startswith("colorl: error:")]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert "2 non-finite losses or gradient norms in a row (steps 2-3, train.max_nonfinite_in_a_row=2)" in lines[0]
    assert "checkpoint step_1 holds the last good step" in lines[0]
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert math.isfinite(records[0]["loss"]) and not math.isfinite(records[1]["grad_norm"])
    assert [r["optimizer_steps_skipped"] for r in records] == [0, 1, 2]  # each one skipped and counted
    assert latest_step(run) == 1
    assert '"step": 1' in (run / "checkpoints" / "step_1" / "state.json").read_text()
