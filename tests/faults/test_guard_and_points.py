"""The non-finite streak guard and the fault-injection spec, without processes."""
from __future__ import annotations

import math

import pytest

from colorl.faults import Fault, NonFiniteGuard
from colorl.train.checkpoint import TrainerState

NAN, INF = math.nan, math.inf


def _run(limit: int, losses_and_norms: list[tuple[float, float]]):
    state = TrainerState()
    guard = NonFiniteGuard(limit, last_good=state)
    for loss, norm in losses_and_norms:
        state.step += 1
        state.data_position += 4
        stop = guard.observe(loss, norm, state)
        if stop is not None:
            return state.step, stop
    return state.step, None


def test_one_non_finite_step_is_skipped_the_run_goes_on():
    assert _run(2, [(0.1, 1.0), (NAN, NAN), (0.2, 1.0), (0.1, INF), (0.3, 1.0)]) == (5, None)


def test_n_in_a_row_stop_at_the_last_good_step():
    step, last_good = _run(3, [(0.1, 1.0), (0.2, 1.0), (NAN, 1.0), (0.1, INF), (-INF, NAN), (0.1, 1.0)])
    assert step == 5 and last_good == TrainerState(step=2, version=0, data_position=8)


def test_a_streak_from_the_start_falls_back_to_the_starting_state():
    _, last_good = _run(1, [(NAN, NAN)])
    assert last_good == TrainerState()


def test_fault_spec_round_trips_and_bad_specs_say_the_format():
    fault = Fault.parse("kill@checkpoint:3:1")
    assert (fault.action, fault.point, fault.step, fault.rank) == ("kill", "checkpoint", 3, 1)
    assert str(fault) == "kill@checkpoint:3:1"
    for bad in ["kill", "kill@train:x:0", "explode@train:1:0", "kill@lunch:1:0"]:
        with pytest.raises(ValueError, match="COLORL_FAULT"):
            Fault.parse(bad)
