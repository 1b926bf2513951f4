"""The `--modes` grammar of `colorl bench`: `MODE[:key=value[,key=value...]]`, variants separated by commas.

    colocated,bounded_lag:eta=1,bounded_lag:eta=2,buffer=queue_drop,colocated:nproc=2

A comma-separated item with `=` and no `:` continues the previous variant's settings; an item
without `=` (or with `:`) starts a new variant. Commas inside brackets belong to the value
(`rollout.length_override={mean: 64, cap: 512}`). Keys are the short names below or any dotted
config key. Unknown modes and keys are rejected here, before anything runs; a known key with a
bad value is the variant's own failure (the config's validation reports it).

Pure Python: no torch, so argument errors come back at once; the config schema is imported only
when a variant is parsed (the CLI's start-up stays fast).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, get_args, get_origin

if TYPE_CHECKING:
    from pydantic import BaseModel

SHORT_KEYS = {
    "eta": "staleness.max",
    "buffer": "staleness.buffer",
    "q": "staleness.queue_factor",
    "kv": "staleness.partial_rollout",
    "partial": "staleness.partial_rollout",
    "c": "rollout.concurrency",
    "nproc": "launch.nproc",
}


class VariantError(ValueError):
    """A `--modes` string that cannot be run; the message is one line."""


@dataclass(frozen=True)
class Variant:
    spec: str  # as the user wrote it, e.g. "bounded_lag:eta=2,buffer=queue_drop"
    mode: str
    settings: tuple[tuple[str, str], ...] = field(default=())  # (dotted config key, value text)

    @property
    def overrides(self) -> list[str]:
        """`--set` items for `colorl train`: the mode first, then this variant's keys."""
        return [f"mode={self.mode}"] + [f"{key}={value}" for key, value in self.settings]

    @property
    def dirname(self) -> str:
        """A file-system-safe, readable name for the variant's run directory."""
        return re.sub(r"[^A-Za-z0-9._=+-]+", "-", self.spec.replace(":", "-")).strip("-")


def parse_modes(text: str) -> list[Variant]:
    items = _split_top_level(text)
    if not items or any(not item for item in items):
        raise VariantError(f"--modes {text!r}: expected MODE[:key=value,...] separated by commas, with no empty item")
    groups: list[list[str]] = []
    for item in items:
        starts_variant = ":" in item.split("=", 1)[0] or "=" not in item
        if starts_variant:
            groups.append([item])
        elif not groups:
            raise VariantError(f"--modes {text!r}: {item!r} comes before any mode")
        else:
            groups[-1].append(item)
    variants = [_variant(group) for group in groups]
    seen: set[str] = set()
    for variant in variants:
        if variant.dirname in seen:
            raise VariantError(f"--modes: variant {variant.spec!r} is given twice")
        seen.add(variant.dirname)
    return variants


def _variant(items: list[str]) -> Variant:
    from colorl.config import MODES

    mode, _, first = items[0].partition(":")
    if mode not in MODES:
        raise VariantError(f"--modes: unknown mode {mode!r}; allowed: {', '.join(MODES)}")
    pairs = ([first] if first else []) + items[1:]
    if items[0].endswith(":"):
        raise VariantError(f"--modes: {items[0]!r} has a ':' but no key=value after it")
    settings = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise VariantError(f"--modes: {pair!r} in variant {mode!r} is not key=value")
        settings.append((_full_key(key, mode), value.strip()))
    spec = items[0] + "".join(f",{pair}" for pair in items[1:])
    return Variant(spec=spec, mode=mode, settings=tuple(settings))


def _full_key(key: str, mode: str) -> str:
    if key in SHORT_KEYS:
        return SHORT_KEYS[key]
    if key == "mode":
        raise VariantError(f"--modes: 'mode' is the variant's head ({mode}:...), not one of its keys")
    if "." in key and config_key_exists(key):
        return key
    raise VariantError(f"--modes: unknown key {key!r} in variant {mode!r}; use {', '.join(SHORT_KEYS)} "
                       "or a dotted config key such as rollout.concurrency")


def config_key_exists(key: str) -> bool:
    """True when `a.b.c` names a field of `Config` (anything below a free-form dict counts)."""
    from pydantic import BaseModel

    from colorl.config import Config

    model: type[BaseModel] | None = Config
    for part in key.split("."):
        if model is None:
            return False
        info = model.model_fields.get(part)
        if info is None:
            return False
        kinds = (info.annotation, *get_args(info.annotation))  # Optional[Section] -> (..., Section, None)
        if any(kind is dict or get_origin(kind) is dict for kind in kinds):
            return True
        sections = [k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)]
        model = sections[0] if sections else None
    return True


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside (), [] and {}."""
    items, depth, current = [], 0, []
    for char in text:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth = max(0, depth - 1)
        if char == "," and depth == 0:
            items.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    items.append("".join(current).strip())
    return items
