"""The bit-exact check after a weight sync: the engine serves exactly the trainer's weights.

Off in training (it costs a full copy of the weights per version); `colorl doctor` and the engine
conformance tests turn it on with `CheckpointEngine.enable_verification()`. What the engine must
hold is computed from the trainer's parameters independently of the transfer (no buckets, no
shared memory): each full tensor under its engine name, tied weights under both names, and with
LoRA the merge W0 + s·BA of the current adapters, cast to the engine weight's dtype as the
checkpoint engine writes it.

An engine whose weights live in another process (SGLang) returns meta tensors from
`named_weights()`; it is checked through its `read_weights()` (name -> tensor as served, or the
first rows of it: SGLang reads weights back as Python lists), and an engine that offers neither
cannot be checked: `WeightCheckUnavailable`.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from colorl.faults import RunFault
from colorl.sync.lora import LoraTarget, is_adapter_param, merge_into
from colorl.sync.name_maps import NameMap, TensorSpec, canonical_name


class WeightMismatch(RunFault):
    """After a sync the engine does not hold the trainer's weights (one line: which, how many)."""


class WeightCheckUnavailable(RunFault):
    """The engine's served weights cannot be read back, so a sync cannot be checked."""


def served_weights(engine) -> Mapping[str, torch.Tensor]:
    """The engine's weights as it serves them: live `named_weights()`, else its `read_weights()`."""
    weights = engine.named_weights()
    if not any(t.is_meta for t in weights.values()):
        return weights
    reader = getattr(engine, "read_weights", None)
    if reader is None:
        raise WeightCheckUnavailable(
            f"{type(engine).__name__} keeps its weights in another process and has no read_weights(): "
            f"the weights it serves after a sync cannot be compared with the trainer's")
    return reader()


def _equal_rows(served: torch.Tensor, expected: torch.Tensor) -> bool:
    """Bit-equal; an engine read back through row prefixes (SGLang) is compared on those rows."""
    rows = served.shape[0] if served.dim() else 0
    if served.shape != expected.shape and (served.dim() != expected.dim() or served.shape[1:] != expected.shape[1:]
                                           or not 0 < rows <= expected.shape[0]):
        return False
    return torch.equal(served.to(expected.device), expected.narrow(0, 0, rows) if served.dim() else expected)


class SyncVerifier:
    """Expected engine weights of the trainer's current version, and the comparison with an engine."""

    def __init__(self, model: nn.Module, name_map: NameMap, lora: list[LoraTarget],
                 engine_specs: Mapping[str, TensorSpec]):
        self.model = model
        self.name_map = name_map
        self.lora = lora
        self.engine_specs = dict(engine_specs)
        self.checked: list[int] = []  # versions verified on this rank, in order

    def expected(self) -> dict[str, torch.Tensor]:
        """Engine name -> the tensor it must hold now (a copy; collective at world size > 1)."""
        full: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                tensor = p.full_tensor() if isinstance(p, DTensor) else p.detach()
                full[name if is_adapter_param(name) else canonical_name(name)] = tensor
        expected = {self.name_map.engine_name(name): t for name, t in full.items() if not is_adapter_param(name)}
        for engine_name, source in self.name_map.tied:
            if engine_name in self.engine_specs and engine_name not in expected and source in expected:
                expected[engine_name] = expected[source]
        expected = {name: t.to(self.engine_specs[name].dtype, copy=True) for name, t in expected.items()
                    if name in self.engine_specs}
        with torch.no_grad():
            for target in self.lora:
                w0 = expected[target.engine_name]
                merge_into(w0, w0.clone(), full[target.a_name], full[target.b_name], target.scaling)
        return expected

    def check(self, engine, expected: Mapping[str, torch.Tensor], version: int) -> None:
        """Raise WeightMismatch unless every engine weight equals `expected` bit for bit."""
        served = served_weights(engine)
        missing = sorted(set(self.engine_specs) - set(expected))
        differing = [name for name, tensor in expected.items()
                     if name not in served or not _equal_rows(served[name], tensor)]
        if missing or differing:
            names = missing + differing
            raise WeightMismatch(
                f"weight sync to version {version}: {len(names)} of {len(self.engine_specs)} engine weights "
                f"differ from the trainer's (first: {names[0]})")
        self.checked.append(version)
