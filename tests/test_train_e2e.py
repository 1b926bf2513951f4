"""Real multi-process runs of the colocated loop on a tiny random model (gloo, world size 1 and 2)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from colorl.cli import main
from colorl.config import load_config
from colorl.distributed import run_world

pytestmark = pytest.mark.matrix  # whole colorl train runs, one and two ranks: make test-matrix

HELPERS = str(Path(__file__).parent / "helpers")


def tiny_overrides(extra=()):
    return ["task.reward=reward_fns:digit_fraction", "run.steps=3",
            "rollout.batch_groups=4", "rollout.max_new_tokens=12", *extra]


def _train_in_process(rank, world, cfg_dict, run_dir, out_file):
    """Build the real rank context, run three steps, check weights and engine inside the ranks."""
    from colorl.modes.colocated import run_colocated
    from colorl.worker import StopRequest
    from rank_context import fresh_rank_context

    ctx = fresh_rank_context(rank, world, cfg_dict, run_dir)
    cfg = ctx.cfg
    params = dict(ctx.trainer.model.named_parameters())
    before = {n: p.full_tensor().clone() for n, p in params.items()}
    run_colocated(ctx, StopRequest())
    after = {n: p.full_tensor() for n, p in params.items()}
    engine = ctx.engine.named_weights()
    unchanged = [n for n in before if params[n].requires_grad and torch.equal(before[n], after[n])]
    frozen_changed = [n for n in before if not params[n].requires_grad and not torch.equal(before[n], after[n])]
    # with LoRA the engine holds merged weights under other names (checked in tests/sync); else bit-equal
    # (cast to the served dtype: a no-op where the engine serves the trainer's float32)
    mismatched = [] if cfg.model.lora else [n for n in after if not torch.equal(engine[n], after[n].to(engine[n].dtype))]
    if rank == 0:
        Path(out_file).write_text(json.dumps({"unchanged": unchanged, "mismatched": mismatched,
                                              "frozen_changed": frozen_changed,
                                              "compute_dtype": str(ctx.trainer.compute_dtype),
                                              "served_dtypes": sorted({str(t.dtype) for t in engine.values()}),
                                              "engine_version": ctx.engine.version,
                                              "state_version": ctx.state.version}))


@pytest.mark.parametrize("world, extra", [
    (1, ["rollout.engine=hf"]), (1, []), (2, []),
    (2, ["model.lora={r: 4, alpha: 8}", "train.lr=1e-2", "train.offload_optimizer=true", "loss.kl_coef=0.1"]),
    (1, ["loss.kl_coef=0.1", "train.lr=1e-3"]),
    (2, ["train.mixed_precision=bfloat16"]),
], ids=["world1-hf", "world1-native", "world2-native", "world2-lora-offload-kl", "world1-kl", "world2-bf16-compute"])
def test_three_steps_change_every_weight_and_sync_the_engine(tmp_path, monkeypatch, world, extra):
    monkeypatch.syspath_prepend(HELPERS)
    cfg = load_config("configs/tiny.yaml", tiny_overrides([f"launch.nproc={world}", *extra]))
    out = tmp_path / "out.json"
    run_world(_train_in_process, world, cfg.model_dump(mode="json"), str(tmp_path / "run"), str(out))
    report = json.loads(out.read_text())
    assert report["unchanged"] == []
    assert report["mismatched"] == []  # engine weights equal trainer weights bit for bit
    assert report["frozen_changed"] == []
    assert report["engine_version"] == report["state_version"] == 3
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in lines)
    assert all(r["staleness_mean"] == 0 and r["staleness_max"] == 0 for r in lines)
    if cfg.loss.kl_coef:  # θ = ref at step 1, then the policy moves away from the reference
        assert lines[0]["kl_ref"] < 1e-6 < lines[-1]["kl_ref"]
    else:
        assert all(r["kl_ref"] == 0 for r in lines)


def test_auto_precision_where_bf16_wins_computes_and_serves_bf16(tmp_path, monkeypatch):
    """What `auto` does on a CPU with bf16 products whose race bf16 won (forced here: every CPU runs it): the
    trainer computes in bf16 over float32 weights and the engine serves them cast to bf16."""
    monkeypatch.syspath_prepend(HELPERS)
    monkeypatch.setenv("COLORL_BF16", "1")
    cfg = load_config("configs/tiny.yaml", tiny_overrides(["launch.nproc=1", "run.steps=3"]))
    assert (cfg.train.mixed_precision, cfg.engine.dtype) == ("auto", "auto")
    out = tmp_path / "out.json"
    run_world(_train_in_process, 1, cfg.model_dump(mode="json"), str(tmp_path / "run"), str(out))
    report = json.loads(out.read_text())
    assert report["compute_dtype"] == "torch.bfloat16" and report["served_dtypes"] == ["torch.bfloat16"]
    assert report["unchanged"] == [] and report["mismatched"] == []


def _cli(argv) -> int:
    return main(["train", "configs/tiny.yaml", *argv])


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    folder = run_dir / "checkpoints" / f"step_{step}" / "model"
    tensors = {}
    for file in folder.glob("*.safetensors"):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize("world", [1, 2])
def test_resume_continues_exactly(tmp_path, monkeypatch, world):
    monkeypatch.syspath_prepend(HELPERS)
    base = [f"--nproc={world}"] + [a for o in tiny_overrides(["run.save_every=2"]) for a in ("--set", o)]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert _cli(base + ["--set", "run.steps=4", "--run-dir", str(straight)]) == 0
    assert _cli(base + ["--set", "run.steps=2", "--run-dir", str(resumed)]) == 0
    assert _cli(base + ["--set", "run.steps=4", "--run-dir", str(resumed), "--resume"]) == 0
    keys = ("loss", "reward_mean", "response_len_mean", "grad_norm", "version")
    read = lambda d: [{k: r[k] for k in ("step",) + keys} for r in map(json.loads, (d / "metrics.jsonl").open())]
    assert read(straight) == read(resumed)
    a, b = _weights(straight, 4), _weights(resumed, 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], _weights(resumed, 2)[k]) for k in a)


def test_keep_checkpoints_prunes_the_oldest(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(HELPERS)
    sets = tiny_overrides(["run.steps=3", "run.save_every=1", "run.keep_checkpoints=2"])
    assert _cli([x for s in sets for x in ("--set", s)] + ["--run-dir", str(tmp_path / "r")]) == 0
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["step_2", "step_3"]


def test_failing_reward_is_counted_the_run_goes_on_and_tensorboard_logs(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(HELPERS)
    argv = [a for o in tiny_overrides(["run.steps=2", "task.reward=reward_fns:flaky", "run.tensorboard=true"])
            for a in ("--set", o)]
    assert _cli(argv + ["--run-dir", str(tmp_path / "r")]) == 0
    lines = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["reward_errors"] for r in lines) > 0
    assert list((tmp_path / "r" / "tensorboard").glob("events.out.tfevents.*"))
