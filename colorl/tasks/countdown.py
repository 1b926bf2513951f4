"""Countdown: reach a target with the given numbers, each used exactly once, and + - * /.

Problems are generated from a seeded stream; eval problems come from a separate stream and any
number set seen in eval is skipped in training.
"""
from __future__ import annotations

import ast
import operator
import random
import re
from fractions import Fraction

from colorl.tasks.base import Problem, check_options, register

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_EXPR = re.compile(r"[\d\s+\-*/()]+")


def evaluate(expr: str) -> tuple[Fraction, list[int]] | None:
    """Exact value of an arithmetic expression and the numbers it uses; None if not one."""
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        return None
    numbers: list[int] = []

    def walk(node) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            numbers.append(node.value)
            return Fraction(node.value)
        raise ValueError("not arithmetic")

    try:
        return walk(tree.body), numbers
    except (ValueError, ZeroDivisionError):
        return None


def countdown_reward(prompt: str, completion: str, answer: str) -> float:
    """1 if the last expression in the completion uses exactly the numbers and hits the target."""
    target_text, numbers_text = answer.split("|")
    target, wanted = int(target_text), sorted(int(n) for n in numbers_text.split(","))
    for candidate in reversed(_EXPR.findall(completion.split("=")[0] if "=" in completion else completion)):
        if not any(op in candidate for op in "+-*/"):
            continue
        result = evaluate(candidate)
        if result is not None:
            value, used = result
            return 1.0 if value == target and sorted(used) == wanted else 0.0
    return 0.0


@register("countdown")
class CountdownTask:
    name = "countdown"

    def __init__(self, seed: int, options: dict) -> None:
        opts = check_options(self.name, options, {"numbers": int, "max_number": int})
        self._count = opts.get("numbers", 3)
        self._max = opts.get("max_number", 20)
        if not 2 <= self._count <= 6:
            raise ValueError(f"task.options.numbers={self._count}: allowed 2..6")
        self._seed = seed

    def _make(self, rng: random.Random) -> Problem:
        numbers = [rng.randint(1, self._max) for _ in range(self._count)]
        value = Fraction(numbers[0])
        for n in numbers[1:]:
            op = rng.choice("+-*")
            value = {"+": value + n, "-": value - n, "*": value * n}[op]
        listed = ", ".join(map(str, numbers))
        prompt = (
            f"Using the numbers {listed}, each exactly once, and + - * /, make {int(value)}. "
            "Reply with only the expression."
        )
        return Problem(prompt=prompt, answer=f"{int(value)}|{','.join(map(str, numbers))}")

    def _is_eval(self, problem: Problem) -> bool:
        return random.Random(f"countdown-split-{self._seed}-{problem.answer}").random() < 0.2

    def train_problem(self, index: int) -> Problem:
        rng = random.Random(f"countdown-train-{self._seed}-{index}")
        while True:
            problem = self._make(rng)
            if not self._is_eval(problem):
                return problem

    def eval_problems(self, count: int) -> list[Problem]:
        out, i = [], 0
        while len(out) < count:
            problem = self._make(random.Random(f"countdown-eval-{self._seed}-{i}"))
            i += 1
            if self._is_eval(problem):
                out.append(problem)
        return out

    def reward(self, prompt: str, completion: str, answer: str) -> float:
        return countdown_reward(prompt, completion, answer)
