"""The real model through the whole product: two ranks, two steps, export, reload (slow)."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from colorl.cli import main


@pytest.mark.slow
def test_quickstart_model_two_ranks_two_steps_and_export(tmp_path, smollm2_dir):
    run = tmp_path / "run"
    sets = ["run.steps=2", "run.save_every=0", "rollout.batch_groups=4", "rollout.max_new_tokens=16"]
    argv = ["train", "configs/quickstart.yaml", "--nproc", "2", "--run-dir", str(run)]
    assert main(argv + [x for s in sets for x in ("--set", s)]) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert all(0.0 <= r["reward_mean"] <= 1.0 and r["time_sync_s"] < r["time_step_s"] for r in lines)
    assert main(["export", str(run), str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    original = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    changed = [n for n, t in exported.state_dict().items() if not torch.equal(t, original.state_dict()[n])]
    assert len(changed) > 0.9 * len(original.state_dict())
