"""Engine registry: `rollout.engine` names a backend; each is imported only when chosen."""
from __future__ import annotations

import importlib
from pathlib import Path

import torch

from colorl.engines.base import Engine

# name -> "module:Class"; a backend's module is imported only when that backend is used
ENGINES = {"hf": "colorl.engines.hf:HFEngine", "native": "colorl.engines.native.engine:NativeEngine",
           "sglang": "colorl.engines.sglang:SGLangEngine", "vllm": "colorl.engines.vllm:VLLMEngine"}


def engine_class(name: str) -> type[Engine]:
    """The backend's class, for its capabilities (e.g. `keeps_kv_across_updates`) before building one."""
    module, _, cls = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def build_engine(name: str, model_dir: Path, engine_cfg, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Engine:
    return engine_class(name)(model_dir, engine_cfg, device, dtype)
