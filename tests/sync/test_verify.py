"""The bit-exact check after a sync (colorl/sync/verify.py), as `colorl doctor` turns it on."""
from __future__ import annotations

from typing import Mapping

import pytest
import torch

from colorl.config import SyncConfig
from colorl.models import load_model
from colorl.sync import CheckpointEngine
from colorl.sync import checkpoint_engine as transfer
from colorl.sync.verify import WeightCheckUnavailable, WeightMismatch
from sync_helpers import ODD, ModelEngine, TensorEngine, build_model
from test_sync_engines import lora_models, step

SMALL = SyncConfig(bucket_mb=0.01)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """Untied head, attention biases: every kind of tensor the map routes."""
    return build_model(tmp_path_factory.mktemp("verify") / "qwen2", family="qwen2", tie_word_embeddings=False, **ODD)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("verify") / "llama", **ODD)


class ReadableTensorEngine(TensorEngine):
    """Weights in 'another process', read back as SGLang's `get_weights_by_name` would."""

    def read_weights(self) -> Mapping[str, torch.Tensor]:
        return dict(self.model.named_parameters())


def test_every_sync_and_every_applied_version_is_checked(llama_dir):
    model, engine = load_model(llama_dir), ModelEngine(llama_dir)
    ckpt = CheckpointEngine(model, engine, SMALL)
    verifier = ckpt.enable_verification()
    step(model)
    ckpt.sync(engine, 1)
    step(model)
    staged = ckpt.publish(2)
    step(model)  # the trainer moves on: the check is against version 2, not the live weights
    assert ckpt.apply_pending(engine).version == 2
    assert verifier.checked == [1, 2] and staged.expected is not None


def test_a_corrupted_transfer_fails_the_check_naming_the_weight(llama_dir, monkeypatch):
    model, engine = load_model(llama_dir), ModelEngine(llama_dir)
    ckpt = CheckpointEngine(model, engine, SMALL)
    ckpt.enable_verification()
    real, calls = transfer.copy_rows, []

    def off_by_one_ulp(target, row, block):  # the first row block of the sync arrives one ulp off
        calls.append(1)
        real(target, row, torch.nextafter(block, torch.full_like(block, float("inf"))) if len(calls) == 1 else block)

    monkeypatch.setattr(transfer, "copy_rows", off_by_one_ulp)
    step(model)
    with pytest.raises(WeightMismatch, match=r"version 1: 1 of \d+ engine weights differ .*first: model\.embed_tokens"):
        ckpt.sync(engine, 1)


def test_lora_engines_are_checked_against_the_merged_weights(qwen2_dir):
    trainer, _, cfg = lora_models(qwen2_dir)
    engine = ReadableTensorEngine(qwen2_dir)
    ckpt = CheckpointEngine(trainer, engine, SMALL, cfg)
    verifier = ckpt.enable_verification()
    step(trainer, scale=-0.5)
    ckpt.sync(engine, 1)
    assert verifier.checked == [1]
    with torch.no_grad():
        engine.model.model.layers[1].self_attn.v_proj.weight[0, 0] += 1.0  # as if one merge were skipped
    with pytest.raises(WeightMismatch, match=r"first: model\.layers\.1\.self_attn\.v_proj\.weight"):
        verifier.check(engine, verifier.expected(), 1)


def test_an_engine_that_cannot_be_read_back_is_not_passed(llama_dir):
    model, engine = load_model(llama_dir), TensorEngine(llama_dir)
    ckpt = CheckpointEngine(model, engine, SMALL)
    ckpt.enable_verification()
    with pytest.raises(WeightCheckUnavailable, match="TensorEngine keeps its weights in another process"):
        ckpt.sync(engine, 1)
