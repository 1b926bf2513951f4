"""The shipped calculator environment: a safe evaluator, tool turns, the final-answer reward, the turn limit."""
from __future__ import annotations

import json

import pytest

from colorl.envs import Conversation, EnvRunner, Message, parse_tool_calls, resolve_env
from colorl.envs.calculator import EXAMPLES, MAX_CHARS, CalculatorEnv, CalculatorError, _run, evaluate, format_number
from colorl.tasks.base import Problem

PROBLEM = Problem("What is 12 * 7 + 5? Reply with only the number.", "89")


def call(expression) -> str:
    return f'<tool_call>\n{json.dumps({"name": "calculator", "arguments": {"expression": expression}})}\n</tool_call>'


@pytest.mark.parametrize("expression, value", [
    ("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("-(4 - 10)", 6), ("7 / 2", 3.5), ("7 // 2", 3), ("-7 % 3", 2),
    ("2 ** 10", 1024), ("2 ** -1", 0.5), ("1.5 * 4", 6.0), (" 12*7+5 ", 89), ("((((3))))", 3),
])
def test_arithmetic_is_evaluated(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("x + 1", "Name not allowed"),
    ("__import__('os').system('true')", "Call not allowed"),
    ("abs(-3)", "Call not allowed"),
    ("(1).real", "Attribute not allowed"),
    ("[1, 2][0]", "Subscript not allowed"),
    ("'a' * 3", "Constant not allowed"),
    ("True + 1", "Constant not allowed"),
    ("1j * 1j", "Constant not allowed"),
    ("1 < 2", "Compare not allowed"),
    ("1 << 2", "BinOp not allowed"),
    ("+3", "UnaryOp not allowed"),
    ("lambda: 1", "Lambda not allowed"),
    ("x = 1", "not an arithmetic expression"),
    ("1 +", "not an arithmetic expression"),
    ("2 ** 65", "exponent 65 is larger than 64"),
    ("9 ** 9 ** 9", "exponent 387420489"),
    ("(10 ** 64) ** 64", "result too large"),
    ("99999999999999999999 ** 15 * 99999999999999999999", "result too large"),  # each step allowed, not the product
    ("1e308 * 10", "result too large"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("1" + "+1" * 60, "too long"),
    ("1" * (MAX_CHARS + 1), "longer than"),
])
def test_anything_but_bounded_arithmetic_is_refused(expression, why):
    with pytest.raises(CalculatorError, match=why):
        evaluate(expression)


def test_results_are_written_plainly():
    assert [format_number(v) for v in (84, 3.5, 0.1 + 0.2, 1 / 3, 6.0)] == ["84", "3.5", "0.3", "0.333333333333", "6"]


def test_it_is_registered_and_opens_with_its_system_turn_and_the_problem():
    assert resolve_env("calculator") is CalculatorEnv
    opening = CalculatorEnv(PROBLEM).reset()
    assert [m.role for m in opening] == ["system", "user"] and opening[1].content == PROBLEM.prompt
    shown = CalculatorEnv(PROBLEM, examples=True).reset()[1].content
    assert shown == EXAMPLES + PROBLEM.prompt


def test_the_example_calls_it_shows_are_calls_it_runs():
    calls = parse_tool_calls(EXAMPLES, CalculatorEnv.tools)
    assert [c.arguments["expression"] for c in calls] == ["31 * 4", "52 + 17"]
    assert [_run(c).content for c in calls] == ["124", "69"]


def test_tool_calls_get_results_and_the_final_answer_is_scored():
    env = CalculatorEnv(PROBLEM)
    step = env.step(f"First the product. {call('12 * 7')} {call('84 + 5')}")
    assert not step.done and step.tool_errors == 0
    assert step.messages == [Message("tool", "84", name="calculator"), Message("tool", "89", name="calculator")]
    assert env.step("12 * 7 + 5 = 89").reward == 1.0


@pytest.mark.parametrize("final, reward", [("89", 1.0), ("The answer is 89.0", 1.0), ("89, no: 90", 0.0),
                                           ("I do not know", 0.0), ("-89", 0.0)])
def test_the_last_number_of_the_message_without_a_tool_call_is_the_answer(final, reward):
    step = CalculatorEnv(PROBLEM).step(final)
    assert step.done and step.reward == reward and step.messages == []


def test_bad_calls_are_reported_to_the_model_and_counted():
    env = CalculatorEnv(PROBLEM)
    text = call("12 * 7") + "<tool_call>{not json}</tool_call>" + call("os.getcwd()") + \
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>'
    step = env.step(text)
    assert not step.done and step.tool_errors == 3
    assert [m.content.split(" (")[0].split(":")[0] for m in step.messages] == ["84", "error", "error", "error"]
    assert "Call not allowed" in step.messages[2].content and "expression" in step.messages[3].content


def test_the_turn_limit_ends_an_episode_that_keeps_calling_tools():
    env = CalculatorEnv(PROBLEM)
    steps = [env.step(call("1 + 1")) for _ in range(CalculatorEnv.max_turns)]
    assert [s.done for s in steps] == [False] * (CalculatorEnv.max_turns - 1) + [True]
    assert steps[-1].reward == 0.0


def test_a_scripted_episode_through_the_runner_and_the_conversation(chatml_tokenizer):
    """The pieces the rollout will join: reset and steps on the runner, the tokens in a Conversation."""
    tokenizer = chatml_tokenizer
    env = CalculatorEnv(PROBLEM)
    replies = iter([call("12 * 7 + 5"), "89"])
    with EnvRunner(workers=2) as runner:
        opened = runner.run_reset(env, timeout_s=5)
        conv = Conversation.start(tokenizer, opened.step.messages, env.tools)
        while True:
            sampled = tokenizer.encode(next(replies), add_special_tokens=False) + [tokenizer.eos_token_id]
            guarded = runner.run_step(env, conv.add_model_turn(sampled), timeout_s=5)
            if guarded.step.done:
                break
            conv.add_env_messages(guarded.step.messages)
    assert guarded.fault is None and guarded.step.reward == 1.0
    assert "<tool_response>\n89\n</tool_response>" in tokenizer.decode(conv.token_ids)
    assert tokenizer.decode([t for t, m in zip(conv.token_ids, conv.loss_mask) if m]) == (
        call("12 * 7 + 5") + "<|im_end|>89<|im_end|>")
