"""The pinned vLLM CUDA wheel (PyPI's `vllm`, not the CPU build), read but never installed: it
needs CUDA and pins its own torch.

`obtain()` downloads it once (`pip download --no-deps`, about 330 MB, cached beside the SGLang
wheel: tests/helpers/sglang_wheel.py). `distributed_args()` is its `UniProcExecutor._distributed_args`
taken verbatim from the source, so the CPU stand-in (tests/engines/vllm_standin.py) picks each
engine's device index exactly as vLLM's CUDA build does.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

from sglang_wheel import CACHE, Wheel, WheelUnavailable, define, methods_of  # tests/helpers

VLLM_VERSION = "0.32.0"  # colorl/engines/vllm.py's; the stand-in's test checks they agree
EXECUTOR = "vllm/v1/executor/uniproc_executor.py"


def _cached() -> Path | None:
    found = sorted(CACHE.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    return found[0] if found else None


def obtain() -> Path:
    path = _cached()
    if path is None:
        CACHE.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--only-binary=:all:",
                               f"vllm=={VLLM_VERSION}", "-d", str(CACHE)], capture_output=True, text=True, timeout=900)
        path = _cached()
        if path is None:
            reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise WheelUnavailable(f"vllm=={VLLM_VERSION} wheel not obtainable (registry unreachable?): {reason}")
    return path


def missing() -> str | None:
    """Why the wheel cannot be had here, or None."""
    try:
        obtain()
    except WheelUnavailable as exc:
        return str(exc)
    return None


@lru_cache(maxsize=1)
def wheel() -> Wheel:
    return Wheel(obtain())


def method(path: str, cls: str, name: str) -> ast.FunctionDef:
    return methods_of(wheel().classes(path)[cls])[name]


@lru_cache(maxsize=1)
def distributed_args():
    """`UniProcExecutor._distributed_args` of the wheel (device index from `device_config.device`), run
    with stand-ins for the network helpers it calls (the stand-in opens no process group)."""
    node = method(EXECUTOR, "UniProcExecutor", "_distributed_args")
    namespace = {"aiter_requires_tcp_store": lambda: False, "get_ip": lambda: "127.0.0.1", "get_open_port": lambda: 0,
                 "get_distributed_init_method": lambda ip, port: f"tcp://{ip}:{port}",
                 "get_file_store_init_method": lambda: "file:///standin"}
    return define([node], namespace, EXECUTOR)["_distributed_args"]
