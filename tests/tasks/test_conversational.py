"""Conversational datasets (TRL's and Hugging Face's form): rows whose prompt is a list of {role, content}
turns, in `messages` or in `prompt`, rendered by the chat template; the answer stays in its field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from colorl.cli import main
from colorl.config import TaskConfig
from colorl.models import build_tokenizer
from colorl.tasks import build_task
from colorl.tasks.base import ChatTurn, Problem
from colorl.tasks.chat import problem_ids
from colorl.tasks.jsonl import DatasetError, read_problems

TURNS = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 1 + 1?"},
         {"role": "assistant", "content": "2"}, {"role": "user", "content": "And 2 + 3?"}]
ROWS = [{"messages": TURNS, "answer": "5"},
        {"prompt": [{"role": "user", "content": "What is 4 + 4?"}], "answer": 8},
        {"prompt": "What is 3 + 3?", "answer": "6"}]


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_conversational_rows_keep_their_turns_and_render_through_the_chat_template(tmp_path):
    chat, short, plain = read_problems(_write(tmp_path / "chat.jsonl", ROWS))
    assert chat.prompt == "And 2 + 3?" and chat.answer == "5" and len(chat.turns) == 4
    assert chat.turns[2] == ChatTurn("assistant", "2")
    assert short == Problem("What is 4 + 4?", "8", (ChatTurn("user", "What is 4 + 4?"),))
    assert plain == Problem("What is 3 + 3?", "6")
    tokenizer = build_tokenizer()
    expected = tokenizer.apply_chat_template(TURNS, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert problem_ids(tokenizer, chat, "ignored: the row has its own system turn") == list(expected["input_ids"])
    text = tokenizer.decode(problem_ids(tokenizer, short, "Be brief."))
    assert text.index("Be brief.") < text.index("What is 4 + 4?")  # model.system_prompt first, when the row has none
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt


@pytest.mark.parametrize("row, message", [
    ({"messages": "What is 2 + 2?", "answer": "4"}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "hi"}], "answer": "4"}, "messages[0]: role 'robot'"),
    ({"messages": [{"role": "user", "content": 4}], "answer": "4"}, "messages[0]: content must be text"),
    ({"prompt": TURNS[:3], "answer": "4"}, "prompt: the last turn must be the user's"),
    ({"messages": TURNS, "prompt": "x", "answer": "4"}, "needs fields 'answer' and either 'prompt'"),
])
def test_a_malformed_conversation_is_refused_naming_the_line(tmp_path, row, message):
    with pytest.raises(DatasetError) as error:
        read_problems(_write(tmp_path / "bad.jsonl", [ROWS[2], row]))
    assert str(error.value).startswith(f"{tmp_path / 'bad.jsonl'}:2: ") and message in str(error.value)


def test_a_malformed_conversational_dataset_is_refused_before_launch_in_one_line(tmp_path, capsys):
    bad = _write(tmp_path / "bad.jsonl", [ROWS[0], {"messages": [{"role": "user"}], "answer": "1"}])
    argv = ["train", "configs/tiny.yaml", "--dry-run", "--set", "task.name=jsonl", "--set", f"task.path={bad}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"colorl: error: {bad}:2: messages[0]: content must be text, got None"


def test_hf_dataset_rows_with_messages_are_conversational(tmp_path):
    pytest.importorskip("datasets")
    data = _write(tmp_path / "chat.jsonl", [{"messages": TURNS, "answer": "5"}] * 4)
    task = build_task(TaskConfig(name="hf_dataset", path=str(data), options={"eval_fraction": 0.0}), seed=0)
    problem = task.train_problem(0)
    assert problem.prompt == "And 2 + 3?" and problem.answer == "5"
    assert [t.role for t in problem.turns] == ["system", "user", "assistant", "user"]


@pytest.mark.matrix
def test_a_conversational_dataset_trains(tmp_path):
    data = _write(tmp_path / "chat.jsonl", [{"messages": [*TURNS[:3], {"role": "user", "content": f"What is {i} + 1?"}],
                                             "answer": str(i + 1)} for i in range(8)])
    run_dir = tmp_path / "run"
    sets = ["task.name=jsonl", f"task.path={data}", "run.steps=1", "rollout.batch_groups=2",
            "rollout.max_new_tokens=8", "run.log_samples_every=1"]
    assert main(["train", "configs/tiny.yaml", "--run-dir", str(run_dir), *(a for s in sets for a in ("--set", s))]) == 0
    (line,) = [json.loads(text) for text in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert line["trained_tokens"] > 0
    samples = [json.loads(text) for text in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["prompt"] == f"What is {int(s['answer']) - 1} + 1?" for s in samples)
