"""What a user sees around a real (tiny) run: the summary, `colorl plot`, and what `--resume` accepts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from colorl.cli import main
from colorl.metrics.display import eta_seconds
from colorl.resume import config_changes

pytestmark = pytest.mark.matrix  # whole colorl train runs through the CLI: make test-matrix

HELPERS = str(Path(__file__).parent / "helpers")
SETS = ["rollout.engine=hf", "task.reward=reward_fns:digit_fraction", "rollout.batch_groups=2",
        "rollout.max_new_tokens=8", "run.save_every=1", "run.eval_every=1", "run.eval_prompts=4"]


def _train(run: Path, *extra: str) -> int:
    argv = ["train", "configs/tiny.yaml", "--run-dir", str(run)]
    for item in SETS:
        argv += ["--set", item]
    return main(argv + list(extra))


def test_summary_plot_and_resume_rules(tmp_path, monkeypatch, capfd):
    monkeypatch.syspath_prepend(HELPERS)
    run = tmp_path / "run"
    assert _train(run, "--set", "run.steps=2") == 0
    out = capfd.readouterr().out
    assert "held-out accuracy (greedy, 4 prompts never trained on): " in out and "before → " in out
    assert "precision: compute float32, serving float32 (auto: forced by COLORL_BF16=0)" in out  # what auto became
    assert "wall time " in out
    disk = next(line for line in out.splitlines() if line.startswith("disk: "))  # where the space went
    assert "step_2 " in disk and "optimizer state)" in disk and "step_1 " in disk and "(weights only)" in disk
    assert f"colorl export {run} {run}/hf" in out and f"colorl plot {run}" in out
    documented = (Path(__file__).resolve().parents[1] / "docs" / "run-directory.md").read_text()
    keys = {key for line in (run / "metrics.jsonl").read_text().splitlines() for key in json.loads(line)}
    assert sorted(k for k in keys if f"`{k}`" not in documented) == []  # every metrics key is explained

    assert main(["plot", str(run), "--out", str(tmp_path / "png")]) == 0
    written = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert written == ["length.png", "policy.png", "reward.png", "time.png"]  # colocated: no staleness chart
    assert all((tmp_path / "png" / name).read_bytes()[:4] == b"\x89PNG" for name in written)
    assert main(["plot", str(tmp_path / "nothing")]) == 2
    assert "no such run directory" in capfd.readouterr().err

    # a change that alters the data stream is refused, with the list of differences
    assert _train(run, "--set", "run.steps=3", "--set", "run.seed=5", "--set", "rollout.group_size=3",
                  "--resume") == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run.seed: 0 -> 5" in err[0] and "rollout.group_size: 4 -> 3" in err[0]
    assert "--force" in err[0]
    # other changes are listed as warnings and the run resumes, saying from where at once
    assert _train(run, "--set", "run.steps=3", "--set", "train.lr=0.001", "--resume") == 0
    captured = capfd.readouterr()
    assert "warning: --resume with a changed key: train.lr: 0.0001 -> 0.001" in captured.err
    assert captured.out.startswith(f"resuming from step 2 of 3: loading {run / 'checkpoints' / 'step_2'}")


def test_context_length_is_checked_before_launch(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(HELPERS)
    assert _train(tmp_path / "run", "--set", "rollout.max_new_tokens=600") == 2
    err = capsys.readouterr().err
    assert "rollout.max_new_tokens=600" in err and "context of 512 tokens" in err
    assert not (tmp_path / "run").exists()


def test_eta_ignores_the_first_step():
    assert eta_seconds([0.0, 100.0], done=1, total=10) is None  # only a warm-up step: no guess
    assert eta_seconds([0.0, 100.0, 110.0, 121.0, 130.0], done=4, total=10) == pytest.approx(10.0 * 6)


def test_config_changes_split_refused_and_warned():
    old = {"run": {"seed": 0, "steps": 2}, "model": {"path": "a", "lora": None}, "train": {"lr": 1.0}}
    new = {"run": {"seed": 0, "steps": 4}, "model": {"path": "b", "lora": {"r": 8}}, "train": {"lr": 1.0}}
    refused, warned = config_changes(old, new)
    assert [str(c) for c in refused] == ["model.lora.r: None -> 8", "model.path: 'a' -> 'b'"]
    assert [c.key for c in warned] == ["run.steps"]


def test_held_out_eval_also_after_the_last_step(tmp_path, monkeypatch, capsys):
    """eval_every=2 over 3 steps: evaluated before step 1, at step 2 and after step 3 (so the summary's
    before → after line reports the end of the run)."""
    monkeypatch.syspath_prepend(HELPERS)
    run = tmp_path / "run"
    assert _train(run, "--set", "run.steps=3", "--set", "run.eval_every=2", "--set", "run.save_every=0") == 0
    evaluated = [json.loads(line).get("eval_accuracy") is not None for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert evaluated == [False, True, True]
    assert "at step 3" in capsys.readouterr().out
