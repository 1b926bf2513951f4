"""The shipped example environment: arithmetic problems with a `calculator` tool.

The model may call `calculator` on an expression as often as it likes within `max_turns`
messages; its first message without a tool call ends the episode, scored 1.0 when that
message's last number equals `Problem.answer` (exactly, as fractions), else 0.0. A message that
still calls a tool at the turn limit ends the episode with 0.0.

With `examples: true` in `task.env_options`, the user turn shows two example calls before the
question (EXAMPLES); by default it is the problem's text. A small model ignores tools declared only
in the system turn: on two-digit sums SmolLM2-135M-Instruct called the tool in 0 of 64 sampled
episodes, and with a worked example added to the system turn made no well-formed call in 64;
with these examples just before the question, 16 of 64 episodes on two-digit products made a
well-formed call (temperature 0.5), enough for GRPO to build on (configs/tool-calc.yaml).

Expressions are evaluated by walking their `ast`: numbers, + - * / // % **, unary minus and
parentheses, nothing else (no names, calls, attributes or subscripts), with bounded length,
size and exponents, so model-written text never runs as code.
"""
from __future__ import annotations

import ast
import math
import operator
import re
import time
from typing import Callable

from colorl.envs.base import Environment, EnvStep, Message, ToolSpec, register
from colorl.envs.tools import ToolCall, ToolCallError, has_tool_call, parse_tool_calls
from colorl.tasks.base import Problem
from colorl.tasks.rewards import to_number

MAX_CHARS = 200
MAX_NODES = 100
MAX_EXPONENT = 64
MAX_BITS = 1024  # |value| < 2**1024: about the float range; larger results are refused
SYSTEM = ("Solve the problem. You can use the calculator tool. When you are done, reply with the final "
          "answer as a number, without a tool call.")
EXAMPLES = """Use the calculator tool. Examples:
Question: What is 31 * 4?
<tool_call>
{"name": "calculator", "arguments": {"expression": "31 * 4"}}
</tool_call>
Question: What is 52 + 17?
<tool_call>
{"name": "calculator", "arguments": {"expression": "52 + 17"}}
</tool_call>

Question: """
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

Number = int | float


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; reported to the model."""


def _power(base: Number, exponent: Number) -> Number:
    """`**` with the exponent and the result's size checked before anything big is computed."""
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent} is larger than {MAX_EXPONENT}")
    if base != 0 and exponent * math.log2(abs(base)) > MAX_BITS:
        raise CalculatorError("result too large")
    result = base**exponent
    if isinstance(result, complex):
        raise CalculatorError("result is not a real number")
    return result


_BINARY: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: _power,
}


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression; CalculatorError for anything else."""
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError("not an arithmetic expression") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError("expression too long")
    return _value(tree.body)


def _value(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _checked(-_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
    raise CalculatorError(f"{type(node).__name__} not allowed: only numbers, + - * / // % ** and parentheses")


def _checked(value: Number) -> Number:
    too_big = not math.isfinite(value) if isinstance(value, float) else value.bit_length() > MAX_BITS
    if too_big:
        raise CalculatorError("result too large")
    return value


def format_number(value: Number) -> str:
    return str(value) if isinstance(value, int) else format(value, ".12g")


def score(text: str, answer: str) -> float:
    numbers = _NUMBER.findall(text)
    got, want = to_number(numbers[-1] if numbers else None), to_number(answer)
    return 1.0 if got is not None and got == want else 0.0


@register("calculator")
class CalculatorEnv(Environment):
    tools = (ToolSpec("calculator", "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
                      {"type": "object",
                       "properties": {"expression": {"type": "string", "description": "e.g. (12 + 7) * 3"}},
                       "required": ["expression"], "additionalProperties": False}),)
    max_turns = 4  # model messages per episode, the last one included

    def __init__(self, problem: Problem, latency_s: float = 0.0, examples: bool = False) -> None:
        """latency_s: seconds every step takes (`task.env_options`), a stand-in for a remote tool or
        grader when benchmarking how the modes overlap tool time. examples: open the user turn
        with EXAMPLES (see the module doc)."""
        if not 0 <= latency_s <= 60:
            raise ValueError(f"latency_s={latency_s}: allowed 0..60")
        super().__init__(problem)
        self.turns, self.latency_s, self.examples = 0, latency_s, examples

    def reset(self) -> list[Message]:
        question = f"{EXAMPLES}{self.problem.prompt}" if self.examples else self.problem.prompt
        return [Message("system", SYSTEM), Message("user", question)]

    def step(self, assistant_text: str) -> EnvStep:
        time.sleep(self.latency_s)
        self.turns += 1
        if not has_tool_call(assistant_text):
            return EnvStep([], done=True, reward=score(assistant_text, self.problem.answer))
        if self.turns >= self.max_turns:
            return EnvStep([], done=True, reward=0.0)
        results = [_run(call) for call in parse_tool_calls(assistant_text, self.tools)]
        replies = [result.reply() if isinstance(result, ToolCallError) else result for result in results]
        return EnvStep(replies, done=False, tool_errors=sum(isinstance(r, ToolCallError) for r in results))


def _run(call: ToolCall | ToolCallError) -> Message | ToolCallError:
    """The calculator's answer to one call, or the error the model is told about."""
    if isinstance(call, ToolCallError):
        return call
    try:
        return call.reply(format_number(evaluate(call.arguments["expression"])))
    except CalculatorError as exc:
        return ToolCallError(str(exc), call.name)
