"""colorl.run from Python: the CLI's run, with the config as a path or a dict and overrides by section."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import colorl
from colorl.api import RunFailed

HELPERS = str(Path(__file__).parent / "helpers")


@pytest.mark.matrix
def test_train_from_python_returns_the_run_and_its_metrics(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(HELPERS)
    config = yaml.safe_load(Path("configs/tiny.yaml").read_text())
    result = colorl.run(config, {"task.reward": "reward_fns:digit_fraction"}, run_dir=tmp_path / "run",
                          run={"steps": 2}, rollout={"batch_groups": 4, "max_new_tokens": 8})
    assert result.run_dir == tmp_path / "run" and (result.run_dir / "config.yaml").is_file()
    assert [r["step"] for r in result.metrics] == [1, 2] and result.last["version"] == 2
    saved = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert saved["run"]["steps"] == 2 and saved["rollout"]["max_new_tokens"] == 8


def test_bad_input_raises_run_failed_with_the_clis_exit_code(tmp_path, capsys):
    with pytest.raises(RunFailed) as failure:
        colorl.run("configs/tiny.yaml", run_dir=tmp_path / "run", rollout={"group_size": 1})
    assert failure.value.exit_code == 2
    assert "rollout.group_size" in capsys.readouterr().err
