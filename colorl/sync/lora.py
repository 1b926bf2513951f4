"""LoRA weight sync: only the adapters travel; the engine computes with W0 + s·BA.

The engine runs a plain (un-peft'ed) model, so each adapted Linear's engine weight is merged in
place from a kept copy of its base weight W0 with the same arithmetic as peft's `merge()`:
`W = W0 + (B @ A) * s` (on CPU, half-precision adapters are multiplied in fp32 and cast back, as
peft does), so the engine holds exactly what `merge_and_unload()` would produce.

Deviation from a run-time LoRA engine: the kept W0 costs one extra copy of every adapted weight
(the q/k/v/o projections by default) on the engine's device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from colorl.sync.name_maps import canonical_name


@dataclass(frozen=True)
class LoraTarget:
    """One adapted Linear: its engine weight and the trainer's adapter parameters feeding it."""

    engine_name: str  # HF name of the merged weight, e.g. model.layers.0.self_attn.q_proj.weight
    a_name: str  # trainer name of lora_A.weight  [r, in]
    b_name: str  # trainer name of lora_B.weight  [out, r]
    scaling: float


def find_lora_targets(model: nn.Module) -> list[LoraTarget]:
    """The adapted layers of a peft model; an empty list for a model without LoRA.

    Refuses what the merge does not reproduce: several active adapters, DoRA and other variants,
    adapter biases, fan_in_fan_out layers, non-Linear targets.
    """
    from peft.tuners.lora import LoraLayer

    names = {id(p): name for name, p in model.named_parameters()}
    targets = []
    for module_name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        where = canonical_name(module_name)
        adapters = list(module.active_adapters)
        if len(adapters) != 1:
            raise NotImplementedError(f"LoRA sync needs exactly one active adapter; {where} has {adapters}")
        adapter = adapters[0]
        if getattr(module, "lora_variant", {}).get(adapter) is not None:
            raise NotImplementedError(f"LoRA sync does not support LoRA variants (DoRA, ...): {where}")
        if module.lora_bias.get(adapter) or module.fan_in_fan_out or adapter not in module.lora_A:
            raise NotImplementedError(f"LoRA sync supports plain Linear adapters only: {where}")
        targets.append(LoraTarget(
            engine_name=f"{where}.weight",
            a_name=names[id(module.lora_A[adapter].weight)],
            b_name=names[id(module.lora_B[adapter].weight)],
            scaling=float(module.scaling[adapter]),
        ))
    return targets


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name or ".lora_magnitude_" in name


def merge_into(out: torch.Tensor, w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """out = W0 + (B @ A) * s, bit for bit as peft's merge (`out` may be an engine weight)."""
    half_on_cpu = b.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)
    if half_on_cpu:
        delta = ((b.float() @ a.float()) * scaling).to(b.dtype)  # [out, in]
    else:
        delta = (b @ a) * scaling  # [out, in]
    return torch.add(w0, delta, out=out)
