"""Engine registry: `rollout.engine` names a backend; each is imported only when chosen."""
from __future__ import annotations

from pathlib import Path

import torch

from colorl.engines.base import Engine


def _hf(model_dir, engine_cfg, device, dtype) -> Engine:
    from colorl.engines.hf import HFEngine

    return HFEngine(model_dir, engine_cfg, device, dtype)


def _native(model_dir, engine_cfg, device, dtype) -> Engine:
    from colorl.engines.native.engine import NativeEngine

    return NativeEngine(model_dir, engine_cfg, device, dtype)


def _sglang(model_dir, engine_cfg, device, dtype) -> Engine:
    from colorl.engines.sglang import SGLangEngine

    return SGLangEngine(model_dir, engine_cfg, device, dtype)


ENGINES = {"hf": _hf, "native": _native, "sglang": _sglang}


def build_engine(name: str, model_dir: Path, engine_cfg, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Engine:
    return ENGINES[name](model_dir, engine_cfg, device, dtype)
