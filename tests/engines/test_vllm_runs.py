"""Whole `colorl train` runs with rollout.engine=vllm on the real vLLM CPU build (make test-vllm): both
modes, LoRA, eval, resume, with the checkpoint engine's bit-exact check after every sync (colorl
doctor's rank function), on the tiny model with head_dim 32 (vLLM's CPU attention refuses 16)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not importable here (it runs in its own venv: make test-vllm)")

from colorl.cli import main  # noqa: E402
from colorl.doctor import checked_rank  # noqa: E402
from checked_runs import checked_run as run_checked, metrics, weights  # noqa: E402  (tests/helpers)

BASE = ["rollout.engine=vllm", "model.path=tiny-random-llama-hd32", "task.reward=reward_fns:long_is_right",
        "rollout.max_new_tokens=8", "run.eval_every=1", "run.eval_prompts=4", "train.lr=1e-2", "launch.device=cpu"]
LORA = "model.lora={r: 4, alpha: 8}"
RESUMABLE = ["run.steps=3", "run.save_every=2", "run.optimizer_state=all"]
HELPERS = str(Path(__file__).parents[1] / "helpers")


@pytest.fixture(autouse=True)
def _helpers(monkeypatch):
    monkeypatch.syspath_prepend(HELPERS)  # reward_fns


def checked_run(sets: list[str], run_dir: Path, resume: bool = False) -> list[dict]:
    return run_checked(checked_rank, [*BASE, *sets], run_dir, resume, "vllm")


@pytest.mark.timeout(300)
def test_colocated_lora_sleep2_eval_bit_exact_and_resume(tmp_path):
    sets = [*RESUMABLE, LORA, "engine.sleep_level=2", "mode=colocated"]
    (report,) = checked_run(sets, tmp_path / "straight")
    assert report["checked_versions"] == [0, 1, 2, 3]  # start-up, then after each step: bit-exact
    lines = metrics(tmp_path / "straight")
    assert [r["step"] for r in lines] == [1, 2, 3] and all(r["eval_accuracy"] is not None for r in lines)
    assert all(r["staleness_max"] == 0 for r in lines)
    # resume from step 2 through the CLI: step 3 trains exactly as the uninterrupted run did
    resumed = tmp_path / "resumed"
    cli = [a for s in [*BASE, *sets] for a in ("--set", s)]
    assert main(["train", "configs/tiny.yaml", *cli, "--set", "run.steps=2", "--run-dir", str(resumed)]) == 0
    assert main(["train", "configs/tiny.yaml", *cli, "--run-dir", str(resumed), "--resume"]) == 0
    keys = ("step", "version", "loss", "reward_mean", "response_len_mean")
    assert [{k: r[k] for k in keys} for r in metrics(resumed)] == [{k: r[k] for k in keys} for r in lines]
    a, b = weights(tmp_path / "straight", 3), weights(resumed, 3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("partial", ["keep", "recompute"])
def test_bounded_lag_partial_rollout_bit_exact(tmp_path, partial):
    lora = [LORA] if partial == "keep" else []
    (report,) = checked_run(["run.steps=3", *lora, "mode=bounded_lag", "staleness.max=1",
                             f"staleness.partial_rollout={partial}"], tmp_path / "run")
    checked = report["checked_versions"]
    assert checked[0] == 0 and checked == sorted(set(checked)) and len(checked) >= 2  # published versions applied
    lines = metrics(tmp_path / "run")
    assert [r["step"] for r in lines] == [1, 2, 3] and all(r["staleness_max"] <= 1 for r in lines)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in lines)


@pytest.mark.timeout(300)
def test_colocated_world_size_2(tmp_path):
    cli = [a for s in [*BASE, "run.steps=2"] for a in ("--set", s)]
    assert main(["train", "configs/tiny.yaml", *cli, "--nproc=2", "--run-dir", str(tmp_path / "w2")]) == 0
    lines = metrics(tmp_path / "w2")
    assert [r["step"] for r in lines] == [1, 2] and all(r["version"] == r["step"] for r in lines)


@pytest.mark.timeout(600)
def test_doctor_runs_its_vllm_cases_on_the_model_vllm_accepts(tmp_path, capsys):
    """`colorl doctor` on CPU adds the vllm cases where vLLM is installed, on the tiny model with head_dim 32."""
    cases = ["vllm/colocated/sleep2/lora", "vllm/bounded_lag/full"]
    code = main(["doctor", "--device", "cpu", "--nproc", "1", "--out", str(tmp_path / "d"),
                 *[a for c in cases for a in ("--case", c)]])
    out = capsys.readouterr().out
    assert code == 0, out
    assert all(f"PASS  {case} " in out for case in cases), out


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "train"])
def test_a_model_vllm_refuses_on_cpu_is_refused_before_launch_in_one_line(tmp_path, capsys, dry_run):
    args = ["train", "configs/tiny.yaml", "--set", "rollout.engine=vllm", "--set", "launch.device=cpu",
            "--run-dir", str(tmp_path / "run"), *(["--dry-run"] if dry_run else [])]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "head_dim 16" in err[0] and "model.path=tiny-random-llama-hd32" in err[0], err
    assert not (tmp_path / "run").exists()  # nothing launched
