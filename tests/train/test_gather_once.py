"""A CPU step under mixed precision gathers each FSDP2 block once (colorl/train/fsdp.gathered_for_the_step).

Two gloo ranks, bf16 compute over float32 shards, several micro-batches a step: the step that keeps the
blocks gathered must give bit for bit the losses, gradients and weights of the step that gathers twice per
micro-batch, over two optimizer steps (a block left gathered with last step's weights would change the
second step), with one gather per block and step.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from colorl.distributed import run_world
from exactness_helpers import _full_params, _grads, rank_batch, trainer


def gathers_and_steps(rank: int, world: int, model_dir: str, out: str) -> None:
    gathers = []
    real_gather = _fsdp_param_group.foreach_all_gather
    _fsdp_param_group.foreach_all_gather = lambda *a, **k: (gathers.append(1), real_gather(*a, **k))[1]
    report = {}
    for gather_once in (False, True):
        torch.manual_seed(0)
        t = trainer(Path(model_dir), "train.mixed_precision=bfloat16", "train.lr=1e-3")
        assert t.gather_once  # what a CPU under mixed precision picks
        t.gather_once = gather_once
        blocks = sum(1 for m in t.model.modules() if isinstance(m, FSDPModule))
        steps = []
        for seed in (0, 1):
            gathers.clear()
            batch = rank_batch(rank, seed)
            t.optimizer.zero_grad(set_to_none=True)
            sums = t.accumulate_gradients(batch)
            grads = _grads(t.model)
            stats = t.train_step(batch)  # the same gradients again, then the optimizer steps
            steps.append({"loss": sums.loss, "train_loss": stats.loss, "gathers": len(gathers),
                          "grads": {n: g.flatten()[:64].tolist() for n, g in grads.items()},
                          "grad_sums": {n: float(g.double().sum()) for n, g in grads.items()},
                          "weights": {n: float(w.double().sum()) for n, w in _full_params(t.model).items()}})
        report[str(gather_once)] = {"blocks": blocks, "steps": steps}
    Path(out, f"{rank}.json").write_text(json.dumps(report))


@pytest.fixture(scope="module")
def reports(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("gather_once")
    run_world(gathers_and_steps, 2, str(tiny_model_dir), str(out))
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]


def test_gathering_once_gives_the_same_step_bit_for_bit(reports):
    for report in reports:
        twice, once = report["False"]["steps"], report["True"]["steps"]
        for before, after in zip(twice, once):
            assert after["loss"] == before["loss"] and after["train_loss"] == before["train_loss"]
            assert after["grads"] == before["grads"] and after["grad_sums"] == before["grad_sums"]
            assert after["weights"] == before["weights"]
        assert once[0]["weights"] != once[1]["weights"]  # the optimizer moved the weights in between


def test_gathering_once_gathers_each_block_once_a_pass(reports):
    for report in reports:
        blocks = report["True"]["blocks"]
        # a pass is accumulate_gradients, then train_step: each gathers every block once
        assert all(step["gathers"] == 2 * blocks for step in report["True"]["steps"])
        # gathering per micro-batch: each block's forward and backward, every micro-batch
        assert all(step["gathers"] > 4 * blocks for step in report["False"]["steps"])
