"""Damaged checkpoints are named and refused by --resume, or set aside on request; never loaded."""
from __future__ import annotations

import shutil

import pytest
import torch

from colorl.cli import main
from colorl.models import load_model
from colorl.train.checkpoint import (
    CheckpointUnusable, TrainerState, checkpoint_dir, checkpoint_problem, complete_steps, drop_older_optimizer_states,
    has_optimizer_state, latest_step, load_checkpoint, prune_checkpoints, resume_step, save_checkpoint,
)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, tiny_model_dir):
    """Real checkpoints of a tiny model at steps 1, 2 and 3 (one process), written once."""
    run_dir = tmp_path_factory.mktemp("saved")
    model = load_model(tiny_model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in (1, 2, 3):
        model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
        optimizer.step()
        save_checkpoint(run_dir, model, optimizer, TrainerState(step=step, version=step, data_position=4 * step))
    return run_dir


@pytest.fixture()
def run_with_checkpoints(tmp_path, saved_run, tiny_model_dir):
    """A copy of `saved_run` for one test to damage, and a model + optimizer of the same shapes."""
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run, run_dir)
    model = load_model(tiny_model_dir)
    return run_dir, model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _file(run_dir, step, pattern):
    return next(checkpoint_dir(run_dir, step).glob(pattern))


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("pattern, damage, words", [
    ("model/*.safetensors", _truncate, ["model/model-00001-of-00001.safetensors has", "bytes"]),
    ("optim/*.distcp", _flip_a_byte, ["optim/__0_0.distcp", "checksum"]),
    ("rng_rank0.pt", lambda p: p.unlink(), ["rng_rank0.pt is missing"]),
    ("state.json", lambda p: p.write_text('{"step": 3'), ["state.json is unreadable"]),
])
def test_damaged_newest_checkpoint_is_refused_by_name(run_with_checkpoints, pattern, damage, words):
    run_dir, *_ = run_with_checkpoints
    assert [checkpoint_problem(run_dir, s) for s in (1, 2, 3)] == [None, None, None]
    damage(_file(run_dir, 3, pattern))
    with pytest.raises(CheckpointUnusable) as refused:
        resume_step(run_dir)
    message = str(refused.value)
    for word in ["step_3 is damaged", "step_2 is usable", "--resume-from-last-good", *words]:
        assert word in message, (word, message)
    assert complete_steps(run_dir) == [1, 2, 3]  # refusing changes nothing


def test_fall_back_sets_damaged_checkpoints_aside_and_loads_the_last_good(run_with_checkpoints):
    run_dir, model, optimizer = run_with_checkpoints
    _truncate(_file(run_dir, 3, "model/*.safetensors"))
    _flip_a_byte(_file(run_dir, 2, "optim/*.distcp"))
    step, notes = resume_step(run_dir, fall_back=True)
    assert step == 1 and latest_step(run_dir) == 1
    assert [n.split(" is damaged")[0] for n in notes] == ["checkpoint step_3", "checkpoint step_2"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1", "step_2.damaged", "step_3.damaged"]
    assert load_checkpoint(run_dir, 1, model, optimizer) == TrainerState(1, 1, 4)


def test_nothing_usable_is_said_so(run_with_checkpoints):
    run_dir, *_ = run_with_checkpoints
    for step in (1, 2, 3):
        _truncate(_file(run_dir, step, "optim/*.distcp"))
    with pytest.raises(CheckpointUnusable, match="step_3 is damaged .*no earlier checkpoint is usable"):
        resume_step(run_dir, fall_back=True)


def test_cli_resume_refuses_a_damaged_checkpoint_with_one_line(run_with_checkpoints, capsys):
    run_dir, *_ = run_with_checkpoints
    _truncate(_file(run_dir, 3, "model/*.safetensors"))
    code = main(["train", "configs/tiny.yaml", "--run-dir", str(run_dir), "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "step_3 is damaged" in err[0] and "step_2 is usable" in err[0]


def test_half_deleted_or_half_written_folders_are_never_checkpoints(run_with_checkpoints):
    run_dir, model, optimizer = run_with_checkpoints
    root = run_dir / "checkpoints"
    (root / "step_9.partial").mkdir()  # killed while writing
    (root / "step_8.deleting").mkdir()  # killed while pruning
    (root / "step_8.deleting" / "state.json").write_text("{}")
    assert latest_step(run_dir) == 3
    assert prune_checkpoints(run_dir, keep=1) == [1, 2]
    save_checkpoint(run_dir, model, optimizer, TrainerState(step=4))  # the next save clears the leftovers
    assert sorted(p.name for p in root.iterdir()) == ["step_3", "step_4"]


def test_only_the_newest_checkpoint_keeps_the_optimizer_state(run_with_checkpoints, capsys):
    """run.optimizer_state=newest: older checkpoints lose `optim/` (and pass their own check), still load
    their weights, and a resume from one says the optimizer starts fresh; the summary says where the
    space went."""
    from colorl.metrics.summary import disk_line

    run_dir, model, optimizer = run_with_checkpoints
    assert drop_older_optimizer_states(run_dir) == [1, 2]
    assert [has_optimizer_state(run_dir, s) for s in (1, 2, 3)] == [False, False, True]
    assert drop_older_optimizer_states(run_dir) == []  # nothing left to drop
    assert all(checkpoint_problem(run_dir, s) is None for s in (1, 2, 3))
    assert load_checkpoint(run_dir, 2, model, optimizer) == TrainerState(2, 2, 8) and not optimizer.state
    assert load_checkpoint(run_dir, 3, model, optimizer) == TrainerState(3, 3, 12) and optimizer.state
    line = disk_line(run_dir)
    assert line.startswith("disk: ") and "step_3 " in line and "GB optimizer state)" in line
    assert "step_1 " in line and line.count("(weights only)") == 2
    shutil.rmtree(checkpoint_dir(run_dir, 3))
    assert main(["train", "configs/tiny.yaml", "--run-dir", str(run_dir), "--resume", "--dry-run"]) == 0
    assert "it kept no optimizer state, so the optimizer starts fresh" in capsys.readouterr().out
