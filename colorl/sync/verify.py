"""The bit-exact check after a weight sync: the engine serves exactly the trainer's weights.

Off in training (it costs a full copy of the weights per version); `colorl doctor` and the engine
conformance tests turn it on with `CheckpointEngine.enable_verification()`. What the engine must
hold is computed from the trainer's parameters independently of the transfer (no buckets, no
shared memory): each full tensor under its engine name, tied weights under both names, and with
LoRA the merge W0 + s·BA of the current adapters, cast to the engine weight's dtype as the
checkpoint engine writes it.

The weights compared are those the engine computes with, read back from the engine itself:
- an engine whose `named_weights()` are the tensors it serves (native, hf) is read there;
- an engine that serves from elsewhere offers `read_weights()`: name -> the tensor as served, or
  its first rows, or None where that weight cannot be read back (vLLM: its model runner's own
  parameters, a CPU kernel's packed linear read back through the kernel; the staging copy its
  `named_weights()` returns is not what it serves);
- or `compare_weights(expected)` -> `Comparison`, when the engine can only compare in its own
  terms (SGLang: row prefixes through `get_weights_by_name`, else its weight checksums).
A weight that cannot be read back is not passed silently: the verifier lists it in `unread`,
and `colorl doctor` says so in the case's line. An engine that offers none of these (meta
tensors and no read-back) cannot be checked: `WeightCheckUnavailable`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
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


@dataclass
class Comparison:
    """An engine's served weights against the expected ones, by engine name."""

    differing: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)  # the engine cannot read these back: not compared


def compare(served: Mapping[str, torch.Tensor | None], expected: Mapping[str, torch.Tensor],
            aliases: Mapping[str, str] | None = None) -> Comparison:
    """`served` (a None value: that weight cannot be read back) against `expected`; `aliases`: a
    name the engine may serve a tied weight under besides its source's (alias -> source), compared
    when it does."""
    result = Comparison()
    pairs = [*expected.items(), *((alias, expected[source]) for alias, source in (aliases or {}).items()
                                   if alias in served and alias not in expected and source in expected)]
    for name, tensor in pairs:
        if name in served and served[name] is None:
            result.unread.append(name)
        elif name not in served or not _equal_rows(served[name], tensor):
            result.differing.append(name)
    return result


def compare_served(engine, expected: Mapping[str, torch.Tensor], aliases: Mapping[str, str] | None = None) -> Comparison:
    """The weights `engine` computes with against `expected`, through the engine's own read-back."""
    if hasattr(engine, "compare_weights"):
        return engine.compare_weights(expected)
    if hasattr(engine, "read_weights"):
        return compare(engine.read_weights(), expected, aliases)
    weights = engine.named_weights()
    if any(t.is_meta for t in weights.values()):
        raise WeightCheckUnavailable(
            f"{type(engine).__name__} keeps its weights in another process and has no read_weights(): "
            f"the weights it serves after a sync cannot be compared with the trainer's")
    return compare(weights, expected, aliases)


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
        self.unread: set[str] = set()  # engine weights the engine could not read back, so not compared

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
        """Raise WeightMismatch unless every engine weight it can read back equals `expected` bit for bit."""
        aliases = {alias: source for alias, source in self.name_map.tied if alias not in self.engine_specs}
        result = compare_served(engine, expected, aliases)
        names = sorted(set(self.engine_specs) - set(expected)) + result.differing
        if names:
            raise WeightMismatch(
                f"weight sync to version {version}: {len(names)} of {len(self.engine_specs)} engine weights "
                f"differ from the trainer's (first: {names[0]})")
        self.unread.update(result.unread)
        self.checked.append(version)
