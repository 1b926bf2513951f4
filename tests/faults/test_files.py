"""Damaged inputs and damaged run files: one line and exit 2, or handled; never a traceback."""
from __future__ import annotations

import json

import pytest

from colorl.cli import main
from colorl.metrics.logger import MetricsWriter, read_metrics


def run_cli(capsys, argv):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_exit_2(capsys, argv, *words):
    code, _, err = run_cli(capsys, argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def test_config_that_is_not_utf8(capsys, tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("run: {name: caf\xe9}\nmodel: {path: tiny-random-llama}\n".encode("latin-1"))
    one_line_exit_2(capsys, ["train", str(bad), "--dry-run"], f"{bad}:1", "not UTF-8", "0xe9")


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "~\n"])
def test_empty_config_is_refused_not_trained_with_defaults(capsys, tmp_path, text):
    empty = tmp_path / "empty.yaml"
    empty.write_text(text)
    one_line_exit_2(capsys, ["train", str(empty), "--dry-run"], "empty config file")


@pytest.mark.parametrize("text, kind", [("- a\n", "list"), ("just words\n", "str"), ("42\n", "int")])
def test_non_mapping_config(capsys, tmp_path, text, kind):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    one_line_exit_2(capsys, ["train", str(bad), "--dry-run"], "mapping", kind)


@pytest.mark.parametrize("text", ["run: {steps: 2}\n", "model: {dtype: float32}\n", "model: {path: ''}\n"])
def test_config_naming_no_model(capsys, tmp_path, text):
    cfg = tmp_path / "nomodel.yaml"
    cfg.write_text(text)
    one_line_exit_2(capsys, ["train", str(cfg), "--dry-run"], "names no model", "model.path")
    code, _, err = run_cli(capsys, ["train", str(cfg), "--dry-run", "--set", "model.path=tiny-random-llama"])
    assert code == 0, err


def test_config_nested_too_deeply(capsys, tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("model: " + "[" * 5000 + "]" * 5000 + "\n")
    one_line_exit_2(capsys, ["train", str(deep), "--dry-run"], str(deep))


def _jsonl_argv(path):
    return ["train", "configs/tiny.yaml", "--dry-run", "--set", "task.name=jsonl", "--set", f"task.path={path}"]


def test_dataset_that_is_not_utf8(capsys, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_bytes(b'{"prompt": "1+1", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "3"}\n')
    one_line_exit_2(capsys, _jsonl_argv(data), f"{data}:2", "not UTF-8")


def test_dataset_line_that_is_not_json_is_named_by_number(capsys, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n\n{"prompt": "2+2", "answer": \n')
    one_line_exit_2(capsys, _jsonl_argv(data), f"{data}:3", "not valid JSON")


def test_dataset_that_is_a_directory(capsys, tmp_path):
    one_line_exit_2(capsys, _jsonl_argv(tmp_path), "task.path", "not found")


def _record(step: int) -> dict:
    from colorl.metrics.logger import METRIC_KEYS

    return {**{k: 0.5 for k in METRIC_KEYS}, "step": step, "version": step}


@pytest.mark.parametrize("torn", [b'{"step": 3, "loss": 0.', '{"step": 3, "note": "é'.encode()[:-1], b"7", b'{"x": 1}'])
def test_metrics_with_a_torn_last_line_are_read_and_appended_to(tmp_path, torn):
    writer = MetricsWriter(tmp_path)
    writer.write(_record(1))
    writer.write(_record(2))
    with open(tmp_path / "metrics.jsonl", "ab") as handle:  # a crash in the middle of writing step 3
        handle.write(torn)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    resumed = MetricsWriter(tmp_path)  # --resume opens the file again and redoes step 3
    resumed.write(_record(3))
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    lines = (tmp_path / "metrics.jsonl").read_bytes().split(b"\n")
    assert lines[2] == torn and json.loads(lines[3])["step"] == 3  # append-only: the torn bytes stay
