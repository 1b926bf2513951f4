from __future__ import annotations

import time

import pytest

from colorl.tasks.countdown import countdown_reward
from colorl.tasks.rewards import RewardCounters, SandboxedReward, extract_answer, math_equal


@pytest.mark.parametrize("text, expected", [
    ("3 + 4 = 7", "7"),
    ("The answer is \\boxed{42}.", "42"),
    ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
    ("nested \\boxed{a_{1} + 2}", "a_{1} + 2"),
    ("work...\n#### 1,234\nextra", "1,234"),
    ("first 3 then -5.5", "-5.5"),
    ("no numbers here", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("completion, reference, equal", [
    ("It is 1,234.", "#### 1234", True),
    ("\\boxed{0.5}", "1/2", True),
    ("7", "8", False),
    ("seven", "7", False),
    ("x = 12", "12", True),
])
def test_math_equal(completion, reference, equal):
    assert math_equal(completion, reference) is equal


def test_countdown_reward():
    assert countdown_reward("", "(3 + 4) * 2", "14|2,3,4") == 1.0
    assert countdown_reward("", "3 * 4 + 2 = 14", "14|2,3,4") == 1.0
    assert countdown_reward("", "3 + 4", "14|2,3,4") == 0.0  # not every number used
    assert countdown_reward("", "(3 + 4) * 2 * 2", "14|2,3,4") == 0.0  # a number used twice
    assert countdown_reward("", "2 / (4 - 4)", "14|2,4,4") == 0.0  # division by zero is just wrong


USER_REWARDS = '''
import time
def good(prompt, completion, answer):
    return 0.5
def broken(prompt, completion, answer):
    raise RuntimeError("user bug")
def not_finite(prompt, completion, answer):
    return float("nan")
def slow(prompt, completion, answer):
    time.sleep(30)
    return 1.0
'''


def test_user_reward_errors_and_timeouts_give_zero_and_are_counted(tmp_path, monkeypatch):
    (tmp_path / "user_rewards_mod.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    counters = RewardCounters()
    good = SandboxedReward("user_rewards_mod:good", 5.0, counters)
    broken = SandboxedReward("user_rewards_mod:broken", 5.0, counters)
    slow = SandboxedReward("user_rewards_mod:slow", 0.5, counters)
    nan = SandboxedReward("user_rewards_mod:not_finite", 5.0, counters)
    try:
        assert nan("p", "c", "a") == 0.0 and "not finite" in counters.last_error
        assert counters.take() == (1, 0) and counters.take() == (0, 0)  # per-step counts
        assert good("p", "c", "a") == 0.5
        assert broken("p", "c", "a") == 0.0
        assert counters.errors == 1 and "user bug" in counters.last_error
        started = time.monotonic()
        assert slow("p", "c", "a") == 0.0
        assert time.monotonic() - started < 15  # 0.5 s limit + worker start-up
        assert counters.timeouts >= 1
        assert good("p", "c", "a") == 0.5  # the run goes on
    finally:
        for reward in (good, broken, slow, nan):
            reward.close()
