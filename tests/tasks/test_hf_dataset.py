"""`task.name: hf_dataset` on datasets built in the test: save_to_disk folders, JSON, Parquet, offline."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")  # the optional extra colorl[datasets]

from colorl.cli import main  # noqa: E402
from colorl.config import TaskConfig  # noqa: E402
from colorl.tasks import TaskOptionError, build_task  # noqa: E402

HELPERS = str(Path(__file__).resolve().parents[1] / "helpers")


def _rows(n: int, start: int = 0) -> list[dict]:
    return [{"question": f"What is {i} + {i}?", "solution": f"{i} + {i} = {2 * i} #### {2 * i}"} for i in range(start, start + n)]


def _hf(path, **options) -> object:
    return build_task(TaskConfig(name="hf_dataset", path=str(path), options=options), seed=0)


def test_save_to_disk_folder_with_train_and_test_splits(tmp_path):
    folder = tmp_path / "ds"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(_rows(20)),
                          "test": datasets.Dataset.from_list(_rows(5, start=100))}).save_to_disk(str(folder))
    task = _hf(folder, prompt_field="question", answer_field="solution", eval_split="test")
    evals = task.eval_problems(10)
    assert [p.prompt for p in evals] == [f"What is {i} + {i}?" for i in range(100, 105)]
    train = {task.train_problem(i).prompt for i in range(20)}
    assert train == {f"What is {i} + {i}?" for i in range(20)}  # one epoch covers every train row once
    first = task.train_problem(0)
    number = first.answer.rsplit("####", 1)[1].strip()
    assert task.reward(first.prompt, f"so the answer is \\boxed{{{number}}}", first.answer) == 1.0
    assert task.reward(first.prompt, "the answer is 12345", first.answer) == 0.0
    with pytest.raises(TaskOptionError, match="cannot load"):  # offline: a hub id not in the local cache
        _hf("nobody/no-such-dataset")
    with pytest.raises(TaskOptionError, match="no split 'validation'"):
        _hf(folder, split="validation", prompt_field="question", answer_field="solution")


def test_json_and_parquet_files_and_a_seeded_eval_slice(tmp_path):
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("\n".join(json.dumps({"prompt": r["question"], "answer": 2 * i}) for i, r in enumerate(_rows(30))))
    parquet = tmp_path / "train.parquet"
    datasets.Dataset.from_list([{"prompt": r["question"], "answer": str(2 * i)} for i, r in enumerate(_rows(30))]
                               ).to_parquet(str(parquet))
    from_json, from_parquet = _hf(jsonl, eval_fraction=0.2), _hf(parquet, eval_fraction=0.2)
    assert len(from_json.eval_problems(100)) == 6
    assert from_json.eval_problems(100) == from_parquet.eval_problems(100)  # numbers become text answers
    assert not {p.prompt for p in from_json.eval_problems(100)} & {from_json.train_problem(i).prompt for i in range(24)}


def test_row_map_function(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_rows.py").write_text(
        "def to_problem(row):\n    return 'Solve: ' + row['question'], row['solution'].split('####')[1].strip()\n")
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(_rows(4)))
    task = _hf(path, row_map="my_rows:to_problem", eval_fraction=0.0)
    problem = task.train_problem(0)
    assert problem.prompt.startswith("Solve: What is") and problem.answer.isdigit()
    with pytest.raises(TaskOptionError, match="row_map"):
        _hf(path, row_map="my_rows:nothing_here")


def test_malformed_rows_are_skipped_by_index_and_none_usable_refuses(tmp_path):
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "", "answer": "3"},
            {"prompt": "What is 2 + 2?", "answer": None}, {"prompt": "What is 3 + 3?", "answer": "6"}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    task = _hf(path, eval_fraction=0.0)
    assert [i for i, _ in task.skipped] == [1, 2]
    assert task.notes() == ["task hf_dataset: 2 of 4 rows skipped (rows 1, 2; first: empty or non-text prompt)"]
    empty = tmp_path / "bad.jsonl"
    empty.write_text("\n".join(json.dumps({"q": i}) for i in range(3)))
    with pytest.raises(TaskOptionError, match=r"no usable rows \(3 skipped; row 0: KeyError"):
        _hf(empty)


def test_cli_refuses_an_unusable_dataset_and_trains_on_a_usable_one(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(HELPERS)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "x"}) + "\n")
    base = ["train", "configs/tiny.yaml", "--set", "task.name=hf_dataset"]
    assert main(base + ["--set", f"task.path={bad}", "--dry-run"]) == 2
    assert "no usable rows" in capsys.readouterr().err
    assert main(base + ["--dry-run"]) == 2
    assert "task.path is required" in capsys.readouterr().err

    folder = tmp_path / "ds"
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(12)] + [{"prompt": None, "answer": "1"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    run = tmp_path / "run"
    argv = base + ["--set", f"task.path={folder}", "--set", "run.steps=1", "--set", "rollout.batch_groups=2",
                   "--set", "rollout.max_new_tokens=6", "--set", "task.reward=reward_fns:digit_fraction",
                   "--run-dir", str(run)]
    assert main(argv) == 0
    assert "1 of 13 rows skipped (rows 12" in capsys.readouterr().err
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]
