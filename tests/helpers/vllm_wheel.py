"""The pinned vLLM CUDA wheel (PyPI's `vllm`, not the CPU build), read but never installed: it
needs CUDA and pins its own torch.

`obtain()` downloads it once (`pip download --no-deps`, about 330 MB, cached beside the SGLang
wheel: tests/helpers/sglang_wheel.py). `distributed_args()` is its `UniProcExecutor._distributed_args`
taken verbatim from the source, so the CPU stand-in (tests/engines/vllm_standin.py) picks each
engine's device index exactly as vLLM's CUDA build does.
"""
from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

from sglang_wheel import Wheel, WheelUnavailable, define, methods_of, obtain_wheel  # tests/helpers

VLLM_VERSION = "0.32.0"  # colorl/engines/vllm.py's; the stand-in's test checks they agree
EXECUTOR = "vllm/v1/executor/uniproc_executor.py"


def obtain() -> Path:
    return obtain_wheel("vllm", VLLM_VERSION, "--only-binary=:all:", timeout=900)


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
