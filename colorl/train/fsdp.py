"""FSDP2 wrapping of a Hugging Face causal LM: one `fully_shard` per decoder block, then the root."""
from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a HF causal LM (Llama / Qwen2 / Qwen3 all use model.model.layers)."""
    base = getattr(model, "base_model", model)  # peft wraps the HF model once more
    inner = base.model if hasattr(base, "model") and hasattr(base.model, "layers") else base
    while not hasattr(inner, "layers") and hasattr(inner, "model"):
        inner = inner.model
    return list(inner.layers)


def checkpoint_layers(model: torch.nn.Module) -> torch.nn.Module:
    """Activation checkpointing per decoder layer: backward recomputes a layer from its saved input
    instead of keeping its intermediates. torch's composable `checkpoint` leaves the parameter names
    as they are (the checkpoint engine and the saved checkpoints see no wrapper) and composes with
    `fully_shard` applied after it."""
    from torch.distributed._composable import checkpoint

    for layer in decoder_layers(model):
        checkpoint(layer)
    return model


def make_mesh(device: str) -> DeviceMesh:
    """A 1-D mesh over the ranks; `device` may name an index ("cuda:1"), the mesh takes its type."""
    return init_device_mesh(torch.device(device).type, (torch.distributed.get_world_size(),))


def shard_model(model: torch.nn.Module, mesh: DeviceMesh, cpu_offload: bool = False,
                compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Shard in place; parameters become DTensors sharded on dim 0 across the mesh.

    With `compute_dtype`, forward and backward run in it while the sharded parameters (what the
    optimizer steps and the checkpoint engine publishes) and the gradient reduction keep the
    model's own dtype.
    """
    kwargs = {"mesh": mesh}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if compute_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def add_forward_method(model: torch.nn.Module, name: str, fn) -> None:
    """Bind `fn` to `model` as `model.<name>`, run by FSDP2 like `forward` (gathers around it).

    The trainer's forward returns log-probs of the trained tokens, not the HF forward's logits; as a
    registered forward method it gets the same unshard / reshard and backward hooks.
    """
    setattr(model, name, types.MethodType(fn, model))
    register_fsdp_forward_method(model, name)


def gathers_once(device: str, compute_dtype: torch.dtype | None) -> bool:
    """A step keeps its blocks gathered (`gathered_for_the_step`): on a CPU under mixed precision, where
    the casts cost more than the one compute-dtype copy of the model it holds (`colorl plan` counts it)."""
    return torch.device(device).type == "cpu" and compute_dtype is not None


@contextlib.contextmanager
def gathered_for_the_step(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Keep each block's gathered compute-dtype weights from its first forward to the step's last backward.

    Under mixed precision every gather casts the float32 shards to the compute dtype; by default FSDP2
    gathers each block twice per micro-batch (forward, and again for backward). The weights do not
    change between a step's micro-batches, so one gather serves them all, for one compute-dtype copy
    of the model held through the train phase. On a CPU with bf16 units those casts were 12-18 % of
    the train phase (bench/README.md, "bf16 where the CPU has it"). The blocks are resharded at the
    end, before the optimizer steps the shards, so no later forward sees stale weights.
    """
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)] if enabled else []
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.set_reshard_after_backward(False, recurse=False)
    try:
        yield
    finally:
        for module in modules:
            module.set_reshard_after_forward(module is not model, recurse=False)
            module.set_reshard_after_backward(True, recurse=False)
            module.reshard()
