"""What `--resume` may change: keys that alter the data stream or tensor shapes are refused.

A resumed run replays the same problems and the same sampling seeds from its checkpoint. A new
model, task, group size, batch size, seed or rank count would silently train on other data or
fail deep inside a rank, so those differences are refused (listed) unless `--force`; any other
change (steps, learning rate, eval cadence ...) is listed as a warning and applied.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# a changed key starting with one of these alters data or shapes
REFUSED = ("model.", "task.", "rollout.group_size", "rollout.batch_groups", "run.seed", "launch.nproc", "mode")


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key}: {self.old!r} -> {self.new!r}"


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def last_config(run_dir: Path) -> dict | None:
    """The config the run's latest steps ran with: config.yaml, or the newest config.resume-*.yaml."""
    resumes = sorted(run_dir.glob("config.resume-*.yaml"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    path = resumes[-1] if resumes else run_dir / "config.yaml"
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def config_changes(old: dict, new: dict) -> tuple[list[Change], list[Change]]:
    """(refused, warned): the keys whose values differ, split by whether a resume may change them."""
    before, after = _flat(old), _flat(new)
    changes = [Change(k, before.get(k), after.get(k)) for k in sorted(before.keys() | after.keys())
               if before.get(k) != after.get(k)]
    refused = [c for c in changes if c.key.startswith(REFUSED)]
    return refused, [c for c in changes if c not in refused]
