"""colorl: a single-node GRPO trainer. `colorl train CONFIG` on the command line; `colorl.run(...)` from Python
(not `colorl.train`: that name is the training engine's package)."""
from __future__ import annotations


def run(*args, **kwargs):
    """colorl.api.run: the same run as `colorl train`, from a notebook or a script (docs/python.md)."""
    from colorl.api import run as run_training

    return run_training(*args, **kwargs)


__all__ = ["run"]
