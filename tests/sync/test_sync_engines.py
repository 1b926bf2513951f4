"""CheckpointEngine at world size 1 without a process group: engines, LoRA, publish / apply."""
from __future__ import annotations

import copy
import threading

import pytest
import torch

from colorl.config import EngineConfig, LoraConfig, SyncConfig
from colorl.models import load_model
from colorl.sync import CheckpointEngine, NameMapError, naive_sync
from sync_helpers import ODD, ModelEngine, TensorEngine, build_model, mismatches, scramble

SMALL = SyncConfig(bucket_mb=0.01)  # 10 KiB: smaller than the 46 KiB embedding, so it is split


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("sync") / "llama", **ODD)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """Attention biases, untied head."""
    return build_model(tmp_path_factory.mktemp("sync") / "qwen2", family="qwen2", tie_word_embeddings=False, **ODD)


def step(model: torch.nn.Module, scale: float = 1.5) -> None:
    """A stand-in optimizer step: every trainable weight changes."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.mul_(scale).add_(0.125)


def full_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("engine_cls", [ModelEngine, TensorEngine])
def test_sync_puts_every_weight_bit_for_bit(family, engine_cls, llama_dir, qwen2_dir):
    folder = llama_dir if family == "llama" else qwen2_dir
    model, engine = load_model(folder), engine_cls(folder)
    ckpt = CheckpointEngine(model, engine, SMALL)
    step(model)
    scramble(engine)
    stats = ckpt.sync(engine, 3)
    assert mismatches(engine, full_weights(model)) == []
    assert engine.version == 3 and stats.buckets == len(ckpt.buckets) > 5
    assert stats.bytes_moved == sum(p.numel() * 4 for p in model.parameters())
    assert stats.time_sync_s > 0 and stats.gb_per_s > 0
    if engine_cls is TensorEngine:  # one update_weights_from_tensor-like call per bucket completing tensors
        assert 0 < len(engine.calls) <= stats.buckets
        assert sorted(n for call in engine.calls for n in call) == sorted(engine.named_weights())


def test_naive_sync_agrees(llama_dir):
    model, engine = load_model(llama_dir), ModelEngine(llama_dir)
    step(model)
    scramble(engine)
    naive_sync(model, engine, 1)
    assert mismatches(engine, full_weights(model)) == []


def test_real_engines(llama_dir):
    """The hf and native engines, through their own named_weights (the native one fuses q/k/v)."""
    from colorl.engines.hf import HFEngine
    from colorl.engines.native.engine import NativeEngine

    model = load_model(llama_dir)
    for engine in (HFEngine(llama_dir, EngineConfig(), "cpu", torch.float32),
                   NativeEngine(llama_dir, EngineConfig(num_blocks=4, max_num_seqs=2), "cpu", torch.float32)):
        ckpt = CheckpointEngine(model, engine, SMALL)
        step(model)
        ckpt.sync(engine, engine.version + 1)
        live, expected = engine.named_weights(), full_weights(model)
        assert sorted(live) == sorted(expected), type(engine).__name__
        assert all(torch.equal(live[n], expected[n]) for n in expected), type(engine).__name__


def test_engine_of_another_shape_is_refused_at_start_up(llama_dir, tmp_path):
    other = build_model(tmp_path / "other", **{**ODD, "intermediate_size": 38})
    with pytest.raises(NameMapError, match=r"model\.layers\.0\.mlp\.\w+_proj\.weight is \[38, 45\] float32 but"):
        CheckpointEngine(load_model(llama_dir), ModelEngine(other), SMALL)


def lora_models(folder, targets=("q_proj", "v_proj", "o_proj")):
    """A peft trainer with non-zero adapters, and an unmerged reference copy of it."""
    from colorl.train.policy import apply_lora

    torch.manual_seed(0)
    cfg = LoraConfig(r=4, alpha=8, targets=list(targets))
    trainer = apply_lora(load_model(folder), cfg)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if "lora_B" in name:
                p.normal_()
    return trainer, copy.deepcopy(trainer), cfg


def merged(peft_model) -> dict[str, torch.Tensor]:
    return full_weights(copy.deepcopy(peft_model).merge_and_unload())


@pytest.mark.parametrize("engine_cls", [ModelEngine, TensorEngine])
def test_lora_moves_adapters_and_matches_peft_merge(engine_cls, qwen2_dir):
    trainer, reference, cfg = lora_models(qwen2_dir)
    engine = engine_cls(qwen2_dir)
    scramble(engine)
    ckpt = CheckpointEngine(trainer, engine, SMALL, cfg)
    assert mismatches(engine, merged(reference)) == []  # start-up: base moved once, adapters merged
    for model in (trainer, reference):
        step(model, scale=-0.5)  # only the adapters are trainable
    stats = ckpt.sync(engine, 1)
    assert mismatches(engine, merged(reference)) == []
    adapters = sum(p.numel() * 4 for n, p in trainer.named_parameters() if "lora_" in n)
    assert stats.bytes_moved == adapters


def test_lora_config_must_agree_with_the_model(llama_dir):
    trainer, _, cfg = lora_models(llama_dir)
    with pytest.raises(ValueError, match="LoRA layers but model.lora is not set"):
        CheckpointEngine(trainer, ModelEngine(llama_dir), SMALL, None)
    with pytest.raises(ValueError, match="no LoRA layers"):
        CheckpointEngine(load_model(llama_dir), ModelEngine(llama_dir), SMALL, cfg)


def test_publish_is_applied_at_the_rollout_threads_next_step_boundary(llama_dir):
    model, engine = load_model(llama_dir), ModelEngine(llama_dir)
    ckpt = CheckpointEngine(model, engine, SMALL)
    before = full_weights(engine.model)
    step(model)
    v1 = full_weights(model)
    staged = ckpt.publish(1)
    step(model)  # the trainer goes on; the staged version is a snapshot
    assert mismatches(engine, before) == [] and ckpt.pending_version == 1
    ckpt.publish(2)  # a newer version supersedes an unapplied one
    v2 = full_weights(model)

    applied, boundary = [], threading.Event()

    def rollout_loop():  # the engine's thread: apply only between steps
        boundary.wait(timeout=10)
        applied.append(ckpt.apply_pending(engine))
        applied.append(ckpt.apply_pending(engine))

    thread = threading.Thread(target=rollout_loop)
    thread.start()
    boundary.set()
    thread.join(timeout=10)
    assert applied[0].version == 2 and applied[1] is None
    assert engine.version == 2 and mismatches(engine, v2) == []
    staged.apply(engine)  # a StagedUpdate can also be applied directly
    assert engine.version == 1 and mismatches(engine, v1) == []
