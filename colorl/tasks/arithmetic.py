"""Addition (or multiplication) problems, generated and seeded. One-digit addition gives SmolLM2-135M
a good GRPO signal.

Train and eval are split by operand pair (every fifth pair, by a seeded shuffle, is held out),
so eval prompts are never trained on.

Options: `digits` (1..6), `eval_fraction`, `operator` ("+" or "*"), and `suffix`, the instruction
after the question ("" drops it: the calculator environment gives its own instructions).
"""
from __future__ import annotations

import random
from operator import add, mul

from colorl.tasks.base import Problem, check_options, register
from colorl.tasks.rewards import math_reward

SUFFIX = "Reply with only the number."
OPERATORS = {"+": add, "*": mul}


@register("arithmetic")
class ArithmeticTask:
    name = "arithmetic"

    def __init__(self, seed: int, options: dict) -> None:
        opts = check_options(self.name, options, {"digits": int, "eval_fraction": float, "operator": str, "suffix": str})
        digits = opts.get("digits", 1)
        self._operator, self._suffix = opts.get("operator", "+"), opts.get("suffix", SUFFIX)
        if self._operator not in OPERATORS:
            raise ValueError(f"task.options.operator={self._operator!r}: allowed {sorted(OPERATORS)}")
        if not 1 <= digits <= 6:
            raise ValueError(f"task.options.digits={digits}: allowed 1..6")
        low, high = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
        pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)] if digits <= 2 else None
        self._seed, self._low, self._high = seed, low, high
        fraction = opts.get("eval_fraction", 0.2)
        if not 0 < fraction < 1:
            raise ValueError(f"task.options.eval_fraction={fraction}: allowed 0 < x < 1")
        self._fraction = fraction
        if pairs is not None:
            random.Random(f"arith-split-{seed}").shuffle(pairs)
            cut = max(1, int(len(pairs) * fraction))
            self._eval, self._train = pairs[:cut], pairs[cut:]
        else:  # too many pairs to list: split by parity of a hash
            self._eval = self._train = None

    def _is_eval(self, pair: tuple[int, int]) -> bool:
        return random.Random(f"arith-{self._seed}-{pair}").random() < self._fraction

    def _pair(self, split: str, index: int) -> tuple[int, int]:
        listed = self._train if split == "train" else self._eval
        if listed is not None:
            epoch, offset = divmod(index, len(listed))
            order = list(range(len(listed)))
            random.Random(f"arith-{split}-{self._seed}-{epoch}").shuffle(order)
            return listed[order[offset]]
        rng = random.Random(f"arith-{split}-{self._seed}-{index}")
        while True:
            pair = (rng.randint(self._low, self._high), rng.randint(self._low, self._high))
            if self._is_eval(pair) == (split == "eval"):
                return pair

    def _problem(self, pair: tuple[int, int]) -> Problem:
        a, b = pair
        question = f"What is {a} {self._operator} {b}?"
        return Problem(prompt=f"{question} {self._suffix}" if self._suffix else question,
                       answer=str(OPERATORS[self._operator](a, b)))

    def train_problem(self, index: int) -> Problem:
        return self._problem(self._pair("train", index))

    def eval_problems(self, count: int) -> list[Problem]:
        size = len(self._eval) if self._eval is not None else count
        return [self._problem(self._pair("eval", i)) for i in range(min(count, size))]

    def reward(self, prompt: str, completion: str, answer: str) -> float:
        return math_reward(prompt, completion, answer)
