"""Issue 31: in colocated mode the native engine's weights are dead while the trainer trains whenever
the next sync rewrites every one of them (a full fine-tune), so by default it sleeps at level 2 and
releases them; the run's results must not change, and LoRA (whose sync re-sends only the adapted
matrices) must keep them.

Real colocated runs (world 1, tiny model), the engine observed from inside the train phase."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from colorl.config import load_config
from colorl.distributed import run_world

HELPERS = str(Path(__file__).parents[1] / "helpers")
SAME = ("loss", "reward_mean", "response_len_mean", "grad_norm", "version")


def _observed_run(rank, world, cfg_dict, run_dir, out_file):
    from colorl.modes.colocated import run_colocated
    from colorl.worker import StopRequest
    from rank_context import fresh_rank_context

    ctx = fresh_rank_context(rank, world, cfg_dict, run_dir)
    engine, train_step = ctx.engine, ctx.trainer.train_step
    held: list[int] = []  # bytes of the engine's weights during each train phase

    def observed(batch):
        held.append(sum(p.numel() * p.element_size() for p in engine.model.parameters()))
        return train_step(batch)

    ctx.trainer.train_step = observed
    run_colocated(ctx, StopRequest())
    engine_weights = engine.named_weights()
    mismatched = [n for n, p in ctx.trainer.model.named_parameters()
                  if not ctx.cfg.model.lora and not torch.equal(engine_weights[n], p.full_tensor())]
    Path(out_file).write_text(json.dumps({"held": held, "mismatched": mismatched, "sleep_level": ctx.cfg.sleep_level,
                                          "full_bytes": sum(t.nbytes for t in engine_weights.values())}))


def _run(tmp_path, name: str, sets: list[str]) -> tuple[dict, list[dict]]:
    cfg = load_config("configs/tiny.yaml", ["task.reward=reward_fns:digit_fraction", "run.steps=2",
                                            "rollout.batch_groups=2", "rollout.max_new_tokens=8", *sets])
    out = tmp_path / f"{name}.json"
    run_world(_observed_run, 1, cfg.model_dump(mode="json"), str(tmp_path / name), str(out))
    metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return json.loads(out.read_text()), [{k: r[k] for k in SAME} for r in metrics]


def test_the_default_releases_the_engine_weights_while_training_and_changes_no_result(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(HELPERS)
    released, released_metrics = _run(tmp_path, "default", [])
    kept, kept_metrics = _run(tmp_path, "level1", ["engine.sleep_level=1"])
    assert released["sleep_level"] == 2 and released["held"] == [0, 0]  # no engine weights while training
    assert kept["held"] == [kept["full_bytes"]] * 2
    assert released_metrics == kept_metrics  # same samples, same losses, same updates
    assert released["mismatched"] == kept["mismatched"] == []  # the sync brought them back bit for bit


def test_lora_keeps_the_engine_weights_at_sleep_level_2(tmp_path, monkeypatch):
    """LoRA's sync writes W0 + s·BA into the adapted matrices only: the rest must survive the sleep."""
    monkeypatch.syspath_prepend(HELPERS)
    report, metrics = _run(tmp_path, "lora", ["model.lora={r: 4, alpha: 8}", "train.lr=1e-2", "engine.sleep_level=2"])
    assert report["sleep_level"] == 2 and report["held"] == [report["full_bytes"]] * 2
    assert [r["version"] for r in metrics] == [1, 2]


@pytest.mark.parametrize("sets, level", [
    ([], 2),
    (["model.lora={r: 4, alpha: 8}"], 1),
    (["mode=bounded_lag"], 1),
    (["rollout.engine=hf"], 1),
    (["engine.sleep_level=1"], 1),
    (["engine.sleep_level=2", "model.lora={r: 4, alpha: 8}"], 2),
])
def test_the_sleep_level_chosen_when_unset(sets, level):
    assert load_config("configs/tiny.yaml", sets).sleep_level == level
