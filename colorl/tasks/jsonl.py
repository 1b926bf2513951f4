"""Problems from a JSONL file of {"prompt": ..., "answer": ...}; math answer checking by default.

A row may be conversational instead (TRL's and Hugging Face's form): `messages`, or `prompt`, a
list of {"role", "content"} turns ending with the user's (colorl/tasks/chat.py).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from colorl.config import read_text
from colorl.tasks.base import Problem, check_options, register
from colorl.tasks.chat import ConversationFormatError, conversational_problem
from colorl.tasks.rewards import math_reward


class DatasetError(ValueError):
    """A dataset file that cannot be used; one line naming the file and line."""


def read_problems(path: str | Path) -> list[Problem]:
    problems = []
    for number, line in enumerate(read_text(Path(path), DatasetError).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record) or "answer" not in record:
            raise DatasetError(f"{path}:{number}: needs fields 'answer' and either 'prompt' (text, or a list of "
                               f"{{\"role\", \"content\"}} turns) or 'messages' (such a list)")
        problems.append(_problem(record, f"{path}:{number}"))
    if not problems:
        raise DatasetError(f"{path}: no problems")
    return problems


def _problem(record: dict, where: str) -> Problem:
    """A plain row's prompt text, or a conversational row's turns (`messages`, or `prompt` as a list)."""
    field = "messages" if "messages" in record else "prompt"
    value, answer = record[field], str(record["answer"])
    if field == "prompt" and not isinstance(value, list):
        return Problem(prompt=str(value), answer=answer)
    try:
        return conversational_problem(value, field, answer)
    except ConversationFormatError as exc:
        raise DatasetError(f"{where}: {exc}") from None


class ListedTask:
    """A task over a fixed list of problems: a seeded held-out slice (or a given eval list), an
    endless train stream reshuffled every epoch, and math answer checking."""

    name = "listed"

    def __init__(self, seed: int, problems: list[Problem], eval_problems: list[Problem] | None,
                 eval_fraction: float) -> None:
        if eval_problems is not None:
            self._train, self._eval = problems, eval_problems
        else:
            shuffled = problems[:]
            random.Random(f"{self.name}-split-{seed}").shuffle(shuffled)
            cut = int(len(shuffled) * eval_fraction)
            self._eval, self._train = shuffled[:cut], shuffled[cut:] or shuffled
        self._seed = seed

    def train_problem(self, index: int) -> Problem:
        epoch, offset = divmod(index, len(self._train))
        order = list(range(len(self._train)))
        random.Random(f"{self.name}-{self._seed}-{epoch}").shuffle(order)
        return self._train[order[offset]]

    def eval_problems(self, count: int) -> list[Problem]:
        return self._eval[:count]

    def reward(self, prompt: str, completion: str, answer: str) -> float:
        return math_reward(prompt, completion, answer)


def eval_fraction_option(options: dict, default: float = 0.1) -> float:
    fraction = options.get("eval_fraction", default)
    if not 0 <= fraction < 1:
        raise ValueError(f"task.options.eval_fraction={fraction}: allowed 0 <= x < 1")
    return fraction


@register("jsonl")
class JsonlTask(ListedTask):
    name = "jsonl"

    def __init__(self, seed: int, options: dict, path: str, eval_path: str | None = None) -> None:
        fraction = eval_fraction_option(check_options(self.name, options, {"eval_fraction": float}))
        super().__init__(seed, read_problems(path), read_problems(eval_path) if eval_path else None, fraction)
