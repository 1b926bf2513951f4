"""Trainer parameter names -> engine weight names, one table per model family.

The trainer's names come from the (possibly peft-wrapped, FSDP2-sharded) Hugging Face model;
the engine's from `Engine.named_weights()`. `route` is the start-up check: every engine weight is
fed by exactly one trainer tensor, every trainer tensor lands somewhere, and shapes and dtypes
agree. Any violation is a `NameMapError` that names the tensor.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

import torch

PEFT_PREFIX = "base_model.model."
PEFT_BASE_LAYER = ".base_layer"


class NameMapError(ValueError):
    """The trainer's and the engine's weights do not correspond one to one."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorSpec":
        return cls(tuple(tensor.shape), tensor.dtype)

    def __str__(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class NameMap:
    """How one family's trainer names become engine names.

    `renames`: (regex, replacement) pairs applied in order to the trainer's HF name.
    `tied`: engine name -> trainer name feeding it when the trainer ties the two (an engine may
    expose a tied weight under both names; the trainer's `named_parameters` lists it once).
    """

    family: str
    renames: tuple[tuple[str, str], ...] = ()
    tied: tuple[tuple[str, str], ...] = (("lm_head.weight", "model.embed_tokens.weight"),)

    def engine_name(self, trainer_name: str) -> str:
        name = canonical_name(trainer_name)
        for pattern, replacement in self.renames:
            name = re.sub(pattern, replacement, name)
        return name


# The native and hf engines keep the Hugging Face module layout, and SGLang loads HF names, so
# these families map by identity; a family with fused or renamed engine weights adds `renames`.
NAME_MAPS: dict[str, NameMap] = {family: NameMap(family) for family in ("llama", "qwen2", "qwen3", "mistral")}


def name_map_for(model_type: str) -> NameMap:
    try:
        return NAME_MAPS[model_type]
    except KeyError:
        raise NameMapError(
            f"no weight name map for model family {model_type!r}; known: {sorted(NAME_MAPS)} "
            "(add one to colorl/sync/name_maps.py)"
        ) from None


def _castable(trainer: torch.dtype, engine: torch.dtype) -> bool:
    """The engine may serve another floating dtype than the trainer keeps (fp32 master weights,
    bf16 serving on GPUs): the checkpoint engine casts each tensor as its bucket is unpacked."""
    return trainer.is_floating_point and engine.is_floating_point


def canonical_name(trainer_name: str) -> str:
    """The plain HF name of a trainer parameter: peft's wrapper prefix and base_layer removed."""
    name = trainer_name.removeprefix(PEFT_PREFIX)
    return name.replace(PEFT_BASE_LAYER + ".", ".")


def route(name_map: NameMap, trainer: Mapping[str, TensorSpec],
          engine: Mapping[str, TensorSpec]) -> dict[str, list[str]]:
    """Trainer name -> the engine names it feeds. Raises NameMapError naming the first bad tensor."""
    routes: dict[str, list[str]] = {}
    fed_by: dict[str, str] = {}
    canonical = {canonical_name(name): name for name in trainer}

    def connect(trainer_name: str, engine_name: str) -> None:
        if engine_name in fed_by:
            raise NameMapError(
                f"engine weight {engine_name} is covered twice: by {fed_by[engine_name]} and by {trainer_name}"
            )
        want, got = trainer[trainer_name], engine[engine_name]
        if want.shape != got.shape or (want.dtype != got.dtype and not _castable(want.dtype, got.dtype)):
            raise NameMapError(
                f"engine weight {engine_name} is {got} but trainer tensor {trainer_name} is {want}"
            )
        fed_by[engine_name] = trainer_name
        routes.setdefault(trainer_name, []).append(engine_name)

    for trainer_name in trainer:
        engine_name = name_map.engine_name(trainer_name)
        if engine_name not in engine:
            raise NameMapError(
                f"trainer tensor {trainer_name} maps to {engine_name}, which the engine does not have "
                f"(family {name_map.family})"
            )
        connect(trainer_name, engine_name)
    for engine_name, source in name_map.tied:
        if engine_name in engine and engine_name not in fed_by and source in canonical:
            connect(canonical[source], engine_name)
    missing = [name for name in engine if name not in fed_by]
    if missing:
        raise NameMapError(
            f"engine weight {missing[0]} is not covered by any trainer tensor"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    return routes
