"""Disk full during a checkpoint: one line naming the path and the space needed, the previous
checkpoint intact and still the one --resume picks, no partial folder taken for a checkpoint.

The small disk is a real size-limited tmpfs (mounting needs root / CAP_SYS_ADMIN; skipped otherwise).
"""
from __future__ import annotations

import re
import subprocess

import pytest
import torch

from colorl.faults import RunFault
from colorl.models import load_model
from colorl.train import checkpoint
from colorl.train.checkpoint import TrainerState, checkpoint_problem, latest_step, resume_step, save_checkpoint


@pytest.fixture()
def small_disk(tmp_path):
    mounted = []

    def mount(size: str):
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _trained(tiny_model_dir):
    model = load_model(tiny_model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    return model, optimizer


def _only_step_1_left(run_dir):
    assert latest_step(run_dir) == 1 and checkpoint_problem(run_dir, 1) is None
    assert resume_step(run_dir) == (1, [])
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_1"]


def test_second_checkpoint_that_does_not_fit_is_refused_before_writing(small_disk, tiny_model_dir):
    run_dir = small_disk("2m")
    model, optimizer = _trained(tiny_model_dir)
    save_checkpoint(run_dir, model, optimizer, TrainerState(step=1))
    with pytest.raises(RunFault) as full:
        save_checkpoint(run_dir, model, optimizer, TrainerState(step=2))
    message = str(full.value)
    assert "\n" not in message and f"in {run_dir / 'checkpoints'}" in message
    assert re.search(r"checkpoint step_2 needs about [\d.]+ MiB .* only [\d.]+ MiB is free", message), message
    assert "step_1 is the newest complete checkpoint" in message
    _only_step_1_left(run_dir)


def test_disk_filling_up_during_the_write_is_caught_too(small_disk, tiny_model_dir, monkeypatch):
    """The estimate can be wrong (another process writes too): ENOSPC inside DCP gives the same
    kind of one-line fault, and the half-written folder is removed."""
    run_dir = small_disk("2m")
    model, optimizer = _trained(tiny_model_dir)
    save_checkpoint(run_dir, model, optimizer, TrainerState(step=1))
    monkeypatch.setattr(checkpoint, "_needed_bytes", lambda *a: 0)
    with pytest.raises(RunFault, match=r"disk full while writing checkpoint .*step_2\.partial; step_1 is the newest"):
        save_checkpoint(run_dir, model, optimizer, TrainerState(step=2))
    _only_step_1_left(run_dir)


@pytest.mark.slow
def test_real_run_on_a_full_disk_stops_with_one_line(small_disk):
    import drill

    run_dir = small_disk("3m") / "run"
    code, out, err, _ = drill.finish(drill.train(run_dir, ["run.eval_every=0"]))
    lines = [line for line in err.splitlines() if line.startswith("colorl: error:")]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
    step = latest_step(run_dir)
    assert step is not None and f"checkpoint step_{step + 1} needs about" in lines[0]
    assert f"step_{step} is the newest complete checkpoint" in lines[0]
    assert resume_step(run_dir) == (step, [])
    assert not list((run_dir / "checkpoints").glob("*.partial"))
