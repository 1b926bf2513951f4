"""train.activation_checkpointing: the same loss and gradients as without it, for less kept activation.

One process (full weights and LoRA, the chunked LM head at 7 rows a chunk) and two gloo ranks under
FSDP2: each trainer built twice from the same weights, with and without checkpointing, runs the
same batch; the sums must be equal and the gradients equal to float32 rounding. The saved-tensor
hook counts what autograd keeps between forward and backward: with checkpointing, much less.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from colorl.distributed import run_world
from exactness_helpers import _grads, _summary, mixed_batch, relative_error, trainer

CASES = {"full": (), "lora": ("model.lora={r: 4, alpha: 8, targets: [q_proj, v_proj]}",)}


def kept_activation_bytes(t, batch) -> tuple[dict, dict[str, torch.Tensor], int]:
    """(sums, gradients, bytes autograd saved for backward) of one accumulation."""
    saved = 0

    def pack(tensor):
        nonlocal saved
        if not isinstance(tensor, torch.nn.Parameter):  # weights are kept anyway
            saved += tensor.numel() * tensor.element_size()
        return tensor

    t.optimizer.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        sums = t.accumulate_gradients(batch)
    grads = _grads(t.model)
    t.optimizer.zero_grad(set_to_none=True)
    return _summary(sums), grads, saved


def with_and_without(model_dir, sets: tuple[str, ...], batch) -> dict:
    out = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        t = trainer(model_dir, *sets, f"train.activation_checkpointing={str(checkpointing).lower()}")
        out[checkpointing] = kept_activation_bytes(t, batch)
    (plain, plain_grads, plain_saved), (ckpt, ckpt_grads, ckpt_saved) = out[False], out[True]
    return {"plain": plain, "checkpointed": ckpt, "plain_saved": plain_saved, "checkpointed_saved": ckpt_saved,
            "grad_error": {n: relative_error(ckpt_grads[n], g) for n, g in plain_grads.items()},
            "grads_missing": sorted(set(plain_grads) ^ set(ckpt_grads))}


def assert_same(report: dict) -> None:
    assert report["grads_missing"] == [] and report["grad_error"]
    for field, value in report["checkpointed"].items():
        assert math.isclose(value, report["plain"][field], rel_tol=1e-6, abs_tol=1e-6), field
    worst = max(report["grad_error"].items(), key=lambda kv: kv[1])
    assert worst[1] <= 1e-6, worst
    # the layers keep only their inputs: well under half of what autograd kept without it
    assert report["checkpointed_saved"] < 0.5 * report["plain_saved"], report


@pytest.mark.parametrize("case", list(CASES))
def test_one_process_same_loss_and_gradients_less_kept(tiny_model_dir, case):
    assert_same(with_and_without(tiny_model_dir, CASES[case], mixed_batch(seed=3)))


def _ranks(rank: int, world: int, model_dir: str, out: str) -> None:
    report = {case: with_and_without(model_dir, sets, mixed_batch(seed=4 + rank, n=7 - 2 * rank))
              for case, sets in CASES.items()}
    with open(f"{out}/{rank}.json", "w") as handle:
        json.dump(report, handle)


def test_world_two_fsdp_same_loss_and_gradients(tiny_model_dir, tmp_path):
    run_world(_ranks, 2, str(tiny_model_dir), str(tmp_path))
    for rank in range(2):
        report = json.loads((tmp_path / f"{rank}.json").read_text())
        for case in CASES:
            assert_same(report[case])
