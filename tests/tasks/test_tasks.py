from __future__ import annotations

import json

import pytest

from colorl.config import TaskConfig
from colorl.tasks import TaskOptionError, build_task


def test_arithmetic_is_seeded_and_eval_is_held_out():
    task = build_task(TaskConfig(name="arithmetic", options={"digits": 1}), seed=3)
    again = build_task(TaskConfig(name="arithmetic", options={"digits": 1}), seed=3)
    train = [task.train_problem(i) for i in range(200)]
    assert train == [again.train_problem(i) for i in range(200)]
    evals = task.eval_problems(100)
    assert len(evals) == 20  # 20% of the 100 one-digit pairs
    assert not {p.prompt for p in evals} & {p.prompt for p in train}
    assert all(task.reward(p.prompt, f"The sum is {p.answer}", p.answer) == 1.0 for p in train[:20])


def test_countdown_problems_are_solvable_by_their_construction():
    task = build_task(TaskConfig(name="countdown"), seed=0)
    problem = task.train_problem(5)
    target, numbers = problem.answer.split("|")
    assert len(numbers.split(",")) == 3 and "make " + target in problem.prompt
    evals = {p.answer for p in task.eval_problems(20)}
    assert not evals & {task.train_problem(i).answer for i in range(300)}


def test_jsonl_task_reads_problems_and_reports_bad_lines(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": f"#### {i}"}) for i in range(30)))
    task = build_task(TaskConfig(name="jsonl", path=str(good), options={"eval_fraction": 0.1}), seed=0)
    assert len(task.eval_problems(100)) == 3
    first = task.train_problem(0)
    assert task.reward(first.prompt, f"so \\boxed{{{first.answer.split()[-1]}}}", first.answer) == 1.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "answer": "1"}\n{"prompt": "y"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        build_task(TaskConfig(name="jsonl", path=str(bad)), seed=0)


def test_unknown_task_option_is_rejected():
    with pytest.raises(TaskOptionError, match="task.options.colour"):
        build_task(TaskConfig(name="arithmetic", options={"colour": 1}), seed=0)


def test_arithmetic_products_and_the_suffix_option():
    plain = build_task(TaskConfig(name="arithmetic", options={"digits": 2}), seed=3)
    products = build_task(TaskConfig(name="arithmetic", options={"digits": 2, "operator": "*", "suffix": ""}), seed=3)
    for i in range(20):
        a, b = (int(x) for x in plain.train_problem(i).prompt.split("?")[0].removeprefix("What is ").split(" + "))
        assert plain.train_problem(i).prompt == f"What is {a} + {b}? Reply with only the number."  # the default
        assert products.train_problem(i).prompt == f"What is {a} * {b}?"  # same operand pairs, no suffix
        assert products.train_problem(i).answer == str(a * b)
    with pytest.raises(ValueError, match="task.options.operator='-'"):
        build_task(TaskConfig(name="arithmetic", options={"operator": "-"}), seed=0)
