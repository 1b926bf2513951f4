"""Engines and worlds for the checkpoint-engine tests (imported by the spawned ranks too)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping

import torch

from colorl.engines.base import Engine, EngineStats
from colorl.models import load_model, save_tiny_model

# Sizes not divisible by 2 or 3 (vocab is the byte tokenizer's 259): uneven FSDP2 shards.
ODD = dict(hidden_size=45, head_dim=16, num_attention_heads=3, num_key_value_heads=1,
           intermediate_size=37, num_hidden_layers=3)


class ModelEngine(Engine):
    """A stand-in engine: a plain HF model whose parameters are the live engine weights."""

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32):
        self.model = load_model(model_dir, dtype)
        self.version = 0

    def named_weights(self) -> Mapping[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def add(self, request): raise NotImplementedError
    def step(self): raise NotImplementedError
    def has_unfinished(self): return False
    def abort(self, request_ids): raise NotImplementedError
    def interrupt(self, request_ids): raise NotImplementedError
    def sleep(self, level=1): pass
    def wake(self): pass
    def stats(self): return EngineStats(0, 0, 0, 0, 0, 0.0)


class TensorEngine(ModelEngine):
    """Like an SGLang adapter: weights reachable only through `load_weights(name, full tensor)`.

    `named_weights()` gives meta tensors (shapes and dtypes for the start-up check); each
    `load_weights` call is recorded as one bucket.
    """

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32):
        super().__init__(model_dir, dtype)
        self.calls: list[list[str]] = []

    def named_weights(self) -> Mapping[str, torch.Tensor]:
        return {name: torch.empty_like(p, device="meta") for name, p in self.model.named_parameters()}

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        live = dict(self.model.named_parameters())
        names = []
        with torch.no_grad():
            for name, tensor in named_tensors:
                assert tensor.shape == live[name].shape, name
                live[name].copy_(tensor)
                names.append(name)
        self.calls.append(names)


def live_weights(engine: Engine) -> dict[str, torch.Tensor]:
    if isinstance(engine, ModelEngine):
        return dict(engine.model.named_parameters())
    return dict(engine.named_weights())


def scramble(engine: Engine) -> None:
    """Overwrite every engine weight so a sync that skips one cannot pass."""
    with torch.no_grad():
        for tensor in live_weights(engine).values():
            tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor.zero_()


def mismatches(engine: Engine, expected: Mapping[str, torch.Tensor]) -> list[str]:
    """Engine weights that differ from `expected` in any bit (names), plus any not expected."""
    live = live_weights(engine)
    bad = [name for name in live if name not in expected]
    bad += [name for name, want in expected.items() if name not in live or not bit_equal(live[name], want)]
    return sorted(set(bad))


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def build_model(out: Path, family: str = "llama", **overrides) -> Path:
    if not (out / "config.json").is_file():
        save_tiny_model(out, family=family, **overrides)
    return out


class PeakMemory:
    """Peak bytes allocated by torch on this thread inside the block, above the level at entry.

    Measured from the profiler's allocation events (every CPU tensor allocation and free).
    """

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        events = [e for e in self._prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        events.sort(key=lambda e: e.start_ns())
        level = peak = 0
        for event in events:
            level += event.nbytes()
            peak = max(peak, level)
        self.peak = peak
        return False


# -- the scenarios every rank of a spawned world runs (tests/sync/test_sync_distributed.py) ------

def _step_sharded(model: torch.nn.Module, scale: float) -> None:
    """A stand-in optimizer step on the shards; elementwise, so it equals the same step on full tensors."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                (p.to_local() if isinstance(p, DTensor) else p).mul_(scale).add_(0.125)


def _step_full(model: torch.nn.Module, scale: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.mul_(scale).add_(0.125)


def _full(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def world_scenarios(rank: int, world: int, llama_dir: str, qwen2_dir: str, out: str) -> None:
    """Each scenario records the engine weights that differ from the trainer's full tensors."""
    import copy
    import json

    from colorl.config import EngineConfig, LoraConfig, SyncConfig
    from colorl.sync import CheckpointEngine
    from colorl.train.fsdp import make_mesh, shard_model
    from colorl.train.policy import apply_lora

    torch.manual_seed(0)
    mesh = make_mesh("cpu")
    small = SyncConfig(bucket_mb=0.01)  # smaller than the embedding: split across buckets
    report: dict[str, object] = {}

    # full fine-tune, odd shapes, tied embeddings; two versions
    model = load_model(Path(llama_dir))
    reference = copy.deepcopy(model)
    shard_model(model, mesh)
    engine = ModelEngine(Path(llama_dir))
    scramble(engine)
    ckpt = CheckpointEngine(model, engine, small)
    with PeakMemory() as first:
        ckpt.sync(engine, 1)
    report["llama_v1"] = mismatches(engine, _full(reference))
    report["peak_bytes"] = first.peak
    report["two_buckets_bytes"] = 2 * max(b.nbytes for b in ckpt.buckets)
    _step_sharded(model, 1.5)
    _step_full(reference, 1.5)
    stats = ckpt.sync(engine, 2)
    report["llama_v2"] = mismatches(engine, _full(reference))
    report["llama_vs_full_tensor"] = mismatches(engine, {n: p.full_tensor() for n, p in model.named_parameters()})
    report["stats"] = [stats.version, stats.bytes_moved, stats.buckets, engine.version]
    report["shared_memory"] = ckpt._shared

    # the gloo broadcast transport (the default between hosts, or without /dev/shm)
    scramble(engine)
    ckpt = CheckpointEngine(model, engine, small, shared_memory=False)
    with PeakMemory() as first:
        ckpt.sync(engine, 3)
    report["llama_broadcast"] = mismatches(engine, _full(reference))
    report["peak_bytes_broadcast"] = first.peak

    # the same into the native engine (fused q/k/v and gate/up views)
    from colorl.engines.native.engine import NativeEngine

    native = NativeEngine(Path(llama_dir), EngineConfig(num_blocks=4, max_num_seqs=2), "cpu", torch.float32)
    CheckpointEngine(model, native, small).sync(native, 2)
    live = native.named_weights()
    report["native"] = sorted(n for n, t in _full(reference).items() if not torch.equal(live[n], t))

    # biases, untied head, whole tensors handed over per bucket (the SGLang path)
    model = load_model(Path(qwen2_dir))
    reference = _full(model)
    shard_model(model, mesh)
    engine = TensorEngine(Path(qwen2_dir))
    scramble(engine)
    CheckpointEngine(model, engine, SyncConfig(bucket_mb=0.05)).sync(engine, 1)
    report["qwen2_tensor_path"] = mismatches(engine, reference)

    # bounded lag: publish on this thread, apply on the rollout thread at a step boundary
    _step_sharded(model, -2.0)
    published = {n: p.full_tensor().clone() for n, p in model.named_parameters()}  # world 1: a view
    ckpt = CheckpointEngine(model, engine, SyncConfig(bucket_mb=0.05))
    ckpt.publish(7)
    _step_sharded(model, 3.0)  # training goes on: the staged version must not move
    import threading

    applied = []
    thread = threading.Thread(target=lambda: applied.append(ckpt.apply_pending(engine)))
    thread.start()
    thread.join(timeout=60)
    report["publish_apply"] = mismatches(engine, published) + ([] if engine.version == 7 else ["version"])

    # LoRA: only adapters travel; the engine equals peft's merge
    lora = LoraConfig(r=4, alpha=8, targets=["q_proj", "v_proj", "o_proj"])
    torch.manual_seed(0)
    trainer = apply_lora(load_model(Path(qwen2_dir)), lora)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if "lora_B" in name:
                p.normal_()
    reference = copy.deepcopy(trainer)
    shard_model(trainer, mesh)
    engine = ModelEngine(Path(qwen2_dir))
    scramble(engine)
    ckpt = CheckpointEngine(trainer, engine, small, lora)
    report["lora_startup"] = mismatches(engine, _full(copy.deepcopy(reference).merge_and_unload()))
    _step_sharded(trainer, -0.5)
    _step_full(reference, -0.5)
    stats = ckpt.sync(engine, 1)
    report["lora_v1"] = mismatches(engine, _full(copy.deepcopy(reference).merge_and_unload()))
    report["lora_bytes"] = [stats.bytes_moved, sum(p.numel() * 4 for n, p in reference.named_parameters() if "lora_" in n)]

    Path(out, f"{rank}.json").write_text(json.dumps(report))
