"""The packed path (no padding, LM head only at trained tokens) against the padded path it replaced.

Same weights, same batch: loss, every logged sum, and the gradient of every parameter. Tolerances:
fp32 relative 1e-5 on sums and on each parameter's gradient norm-wise (the two paths sum in
different orders); bf16 mixed precision relative 2e-2 (bf16 has 8 mantissa bits, and the packed
path's LM-head gradient sums its chunks in fp32 where the padded one rounded once in bf16).
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from colorl.distributed import run_world
from exactness_helpers import WORLD_CASES, mixed_batch, packed_and_padded, trainer, world_cases

TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}


def assert_exact(report: dict, tolerance: float) -> None:
    assert report["grads_missing"] == []
    for field, value in report["packed"].items():
        reference = report["padded"][field]
        assert math.isclose(value, reference, rel_tol=tolerance, abs_tol=tolerance), (field, value, reference)
    worst = max(report["grad_error"].items(), key=lambda kv: kv[1])
    assert worst[1] <= tolerance, worst


@pytest.mark.parametrize("sets", [
    ("loss.kl_coef=0.1",),
    ("loss.aggregation=seq_mean",),
    ("model.lora={r: 4, alpha: 8, targets: [q_proj, v_proj]}", "loss.kl_coef=0.1"),
], ids=["fp32_kl", "seq_mean", "lora_kl"])
def test_one_process_packed_equals_padded(tiny_model_dir, sets):
    torch.manual_seed(0)
    t = trainer(tiny_model_dir, *sets, "train.lr=1e-3")
    t.train_step(mixed_batch(seed=1))  # move the policy off the KL reference
    report = packed_and_padded(t, mixed_batch(seed=2))
    assert report["packed"]["tokens"] > 50 and report["packed"]["truncated"] > 0
    if "loss.kl_coef=0.1" in sets:
        assert report["packed"]["kl_ref"] > 0
    assert_exact(report, TOLERANCE["fp32"])


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_samples_sharing_their_prompt_equal_the_padded_path(tiny_model_dir, checkpointing):
    """Groups of three samples of one prompt, packed with the prompt once (colorl/train/packing.py): the
    same loss, sums and gradients as the padded path, where every sample runs its own prompt."""
    torch.manual_seed(0)
    t = trainer(tiny_model_dir, "loss.kl_coef=0.1", "train.lr=1e-3",
                f"train.activation_checkpointing={str(checkpointing).lower()}")
    t.train_step(mixed_batch(seed=1, group=3))
    batch = mixed_batch(seed=2, n=9, group=3, masked=(4,))
    shared = []
    forward = t.token_logprobs
    t.token_logprobs = lambda model, micro: (shared.append(micro.prompt_of is not None), forward(model, micro))[1]
    report = packed_and_padded(t, batch)
    assert any(shared)  # some micro-batch ran a prompt once for several samples
    assert_exact(report, TOLERANCE["fp32"])


@pytest.fixture(scope="module")
def world2(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("world2")
    run_world(world_cases, 2, str(tiny_model_dir), str(out))
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("case", list(WORLD_CASES))
def test_world_two_packed_equals_padded(world2, case):
    """Two gloo ranks with FSDP2 shards; rank 1 runs fewer real micro-batches (placeholders)."""
    tolerance = TOLERANCE["bf16" if case == "bf16" else "fp32"]
    for rank, report in enumerate(world2):
        assert_exact(report[case], tolerance)
        first = report[case]["first_step"]
        # every trained parameter moved, except LoRA's A matrices: B starts at zero, so A's first gradient is 0
        assert all("lora_A" in name for name in first["unchanged"]), (rank, first["unchanged"])
        assert first["tokens"] == world2[0][case]["first_step"]["tokens"], rank
