"""Environment faults end their own episode with reward 0 and a fault kind; the caller never sees an exception."""
from __future__ import annotations

import sys
import threading
import time

import pytest

from colorl.envs import FAULT_KINDS, Environment, EnvRunner, EnvStep, Message
from colorl.tasks.base import Problem

PROBLEM = Problem("2+2?", "4")
RELEASE = threading.Event()  # lets the hung steps' threads finish when the module's tests are done


@pytest.fixture(scope="module", autouse=True)
def _release_hung_threads():
    yield
    RELEASE.set()


class Scripted(Environment):
    """Answers with whatever `behaviour(text)` gives; reset opens with the problem."""

    def __init__(self, problem, behaviour=lambda text: EnvStep([], done=True, reward=1.0), opening=None):
        super().__init__(problem)
        self.behaviour, self.opening = behaviour, opening

    def reset(self):
        return self.opening if self.opening is not None else [Message("user", self.problem.prompt)]

    def step(self, assistant_text):
        return self.behaviour(assistant_text)


def env(behaviour=None, opening=None) -> Scripted:
    return Scripted(PROBLEM, *([behaviour] if behaviour else []), opening=opening)


def raises(text):
    raise RuntimeError("tool\nexploded")


def hangs(text):
    RELEASE.wait(10)
    return EnvStep([], done=True, reward=1.0)


def slow(text):
    time.sleep(0.15)
    return EnvStep([Message("tool", "slow result")], done=False)


def mutated_after_building(text):
    step = EnvStep([Message("tool", "ok")], done=False)
    step.messages.append({"role": "tool", "content": "sneaked in"})
    return step


@pytest.fixture
def runner():
    with EnvRunner(workers=2) as pool:
        yield pool


def assert_fault(guarded, kind: str, why: str) -> None:
    assert kind in FAULT_KINDS and guarded.fault == kind
    assert guarded.step == EnvStep([], done=True, reward=0.0)
    assert why in guarded.error and "\n" not in guarded.error


def test_a_good_step_passes_through_with_its_tool_time(runner):
    guarded = runner.run_step(env(slow), "go", timeout_s=5)
    assert guarded.fault is None and guarded.error == ""
    assert guarded.step.messages == [Message("tool", "slow result")] and 0.15 <= guarded.seconds < 1
    opened = runner.run_reset(env(), timeout_s=5)
    assert opened.fault is None and opened.step.messages == [Message("user", "2+2?")] and not opened.step.done


@pytest.mark.parametrize("behaviour, why", [(raises, "RuntimeError: tool exploded"),
                                            (lambda text: sys.exit(3), "SystemExit: 3")])
def test_an_environment_that_raises_ends_its_episode(runner, behaviour, why):
    assert_fault(runner.run_step(env(behaviour), "go", timeout_s=5), "raised", why)


@pytest.mark.parametrize("behaviour, why", [
    (lambda text: {"done": True, "reward": 1.0}, "returned dict, not EnvStep"),
    (lambda text: None, "returned NoneType"),
    (lambda text: EnvStep([], done=True, reward=float("inf")), "not finite"),
    (lambda text: EnvStep([], done=True), "done needs a numeric reward"),
    (lambda text: EnvStep([Message("tool", "x")], done=False, reward=1.0), "only when done"),
    (lambda text: EnvStep(["plain text"], done=False), "list of Message"),
    (lambda text: EnvStep([Message("assistant", "I said")], done=False), "as the assistant"),
    (mutated_after_building, "list of Message"),
])
def test_an_environment_that_returns_garbage_ends_its_episode(runner, behaviour, why):
    assert_fault(runner.run_step(env(behaviour), "go", timeout_s=5), "invalid", why)


@pytest.mark.parametrize("opening, why", [("hello", "reset(): expected a list of Message"),
                                          ([], "no new messages")])
def test_a_bad_reset_ends_its_episode(runner, opening, why):
    assert_fault(runner.run_reset(env(opening=opening), timeout_s=5), "invalid", why)


def test_a_hung_step_times_out_and_later_steps_still_run():
    with EnvRunner(workers=1) as runner:  # one worker: the hung thread would starve a pool that kept it
        start = time.perf_counter()
        hung = runner.run_step(env(hangs), "go", timeout_s=0.2)
        assert 0.2 <= time.perf_counter() - start < 9  # waited for the deadline, not for the hung step (10 s)
        assert_fault(hung, "timeout", "no answer within 0.2 s")
        assert hung.seconds == 0.2
        after = [runner.run_step(env(), "go", timeout_s=2) for _ in range(3)]
        assert [g.step.reward for g in after] == [1.0, 1.0, 1.0] and {g.fault for g in after} == {None}


def test_steps_do_not_block_the_caller_and_run_side_by_side(runner):
    went_on, both_running = threading.Event(), threading.Barrier(2)

    def waits(text):  # returns only once the caller has gone on and the other step runs too
        went_on.wait(2)
        both_running.wait(2)
        return EnvStep([], done=True, reward=1.0)

    pending = [runner.submit_step(env(waits), "go", timeout_s=5) for _ in range(2)]
    assert not any(p.done() for p in pending)
    went_on.set()
    assert [p.result().fault for p in pending] == [None, None] and all(p.done() for p in pending)


def test_faults_in_one_episode_leave_the_others_alone(runner):
    behaviours = [raises, lambda text: "garbage", hangs, None]
    pending = [runner.submit_step(env(b), "go", timeout_s=0.2) for b in behaviours]
    assert [p.result().fault for p in pending] == ["raised", "invalid", "timeout", None]
    assert pending[-1].result().step.reward == 1.0


def test_a_timeout_must_be_positive(runner):
    with pytest.raises(ValueError, match="must be > 0"):
        runner.submit_step(env(), "go", timeout_s=0)
