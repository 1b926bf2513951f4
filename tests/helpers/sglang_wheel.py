"""The pinned SGLang wheel, read but never installed: SGLang needs CUDA and pins its own torch.

`obtain()` downloads it once (`pip download --no-deps`, cached in ~/.cache/colorl/wheels or
$COLORL_WHEEL_CACHE). `Wheel` parses its source with `ast`; `serializer()` builds SGLang's own
tensor transport from that source (`MultiprocessingSerializer` over torch's ForkingPickler, and
the `SafeUnpickler` allow-list its scheduler loads with), so the CPU stand-in of the package
passes colorl's tensors through exactly what the real scheduler would accept.
"""
from __future__ import annotations

import ast
import base64
import io
import os
import pickle
import subprocess
import sys
import zipfile
from functools import cached_property, lru_cache
from pathlib import Path

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions on ForkingPickler)
from multiprocessing.reduction import ForkingPickler

SGLANG_VERSION = "0.5.23"  # colorl/engines/sglang.py's; the contract test checks they agree
CACHE = Path(os.environ.get("COLORL_WHEEL_CACHE", Path.home() / ".cache" / "colorl" / "wheels"))
SERIALISATION = "sglang/srt/utils/common.py"
TRANSPORT = ("_safe_load_torch_storage", "SafeUnpickler", "MultiprocessingSerializer")
HASHING = "sglang/srt/managers/mm_utils.py"  # tensor_hash: what the weight checker's checksums hash with


class WheelUnavailable(RuntimeError):
    """The registry could not be reached and no cached copy exists."""


def obtain_wheel(package: str, version: str, *pip_args: str, timeout: int = 600) -> Path:
    """A pinned wheel, downloaded once (`pip download --no-deps`) into CACHE and read from there after."""

    def cached() -> Path | None:
        found = sorted(CACHE.glob(f"{package}-{version}-*.whl"))
        return found[0] if found else None

    path = cached()
    if path is None:
        CACHE.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *pip_args,
                               f"{package}=={version}", "-d", str(CACHE)], capture_output=True, text=True,
                              timeout=timeout)
        path = cached()
        if path is None:
            reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise WheelUnavailable(f"{package}=={version} wheel not obtainable (registry unreachable?): {reason}")
    return path


def obtain() -> Path:
    return obtain_wheel("sglang", SGLANG_VERSION)


def require() -> Path:
    """The wheel, or the calling test skipped saying why (only when the registry is unreachable)."""
    import pytest

    try:
        return obtain()
    except WheelUnavailable as exc:
        pytest.skip(str(exc))


class Wheel:
    """Source files of the wheel, parsed on demand, never imported."""

    def __init__(self, path: Path):
        self.zip = zipfile.ZipFile(path)

    def text(self, name: str) -> str:
        return self.zip.read(name).decode("utf-8")

    def tree(self, name: str) -> ast.Module:
        return ast.parse(self.text(name))

    def version(self) -> str:
        meta = next(n for n in self.zip.namelist() if n.endswith(".dist-info/METADATA"))
        return next(line.split(":", 1)[1].strip() for line in self.text(meta).splitlines() if line.startswith("Version:"))

    def classes(self, name: str) -> dict[str, ast.ClassDef]:
        return {node.name: node for node in ast.walk(self.tree(name)) if isinstance(node, ast.ClassDef)}

    def functions(self, name: str) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
        return {node.name: node for node in ast.walk(self.tree(name))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def strings(self, *names: str) -> set[str]:
        return {node.value for name in names for node in ast.walk(self.tree(name))
                if isinstance(node, ast.Constant) and isinstance(node.value, str)}

    @cached_property
    def engine_class(self) -> ast.ClassDef:
        return self.classes("sglang/srt/entrypoints/engine.py")["Engine"]

    @cached_property
    def tokenizer_manager_functions(self) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
        """TokenizerManager and the mixins it is assembled from."""
        functions = {}
        for name in ("sglang/srt/managers/tokenizer_manager.py", "sglang/srt/managers/tokenizer_control_mixin.py"):
            for cls in self.classes(name).values():
                if cls.name in ("TokenizerManager", "TokenizerControlMixin"):
                    functions.update(methods_of(cls))
        return functions


def methods_of(cls: ast.ClassDef) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {node.name: node for node in cls.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def define(nodes: list[ast.stmt], namespace: dict, where: str) -> dict:
    """Runs definitions taken verbatim from a pinned wheel (SGLang's, vLLM's) with the names their module
    imports, so that a stand-in computes with the real code; only ever on the pinned wheel's source, the one
    place the tests run code they did not write (tests/faults/test_security.py allows it here alone)."""
    exec(compile(ast.Module(body=nodes, type_ignores=[]), f"<{where} of the wheel>", "exec"), namespace)
    return namespace


@lru_cache(maxsize=1)
def serializer() -> type:
    """SGLang 0.5.23's `MultiprocessingSerializer` (serialize with ForkingPickler; deserialize with
    `SafeUnpickler`, whose allow-list refuses any global it does not name), built from the wheel's
    own source: the definitions are taken verbatim and run with the names that module imports."""
    source = Wheel(obtain()).text(SERIALISATION)
    tree = ast.parse(source)
    wanted = [node for node in tree.body if getattr(node, "name", None) in TRANSPORT]
    assert sorted(node.name for node in wanted) == sorted(TRANSPORT), "the wheel's serialisation code moved"
    namespace = {"io": io, "pickle": pickle, "torch": torch, "ForkingPickler": ForkingPickler,
                 "pybase64": base64, "__name__": "sglang.srt.utils.common"}
    return define(wanted, namespace, SERIALISATION)["MultiprocessingSerializer"]


@lru_cache(maxsize=1)
def tensor_hash():
    """SGLang 0.5.23's `tensor_hash` (sglang.srt.managers.mm_utils), which its weight checker hashes
    every weight with (`f"{tensor_hash(t):016x}"`), built from the wheel's own source: its host path
    (sha256 of the bytes) verbatim; its CUDA path (a Triton kernel) is never reached on CPU."""
    tree = ast.parse(Wheel(obtain()).text(HASHING))
    wanted = [node for node in tree.body if getattr(node, "name", None) == "tensor_hash"]
    assert len(wanted) == 1, "the wheel's tensor_hash moved"

    def gpu_tensor_hash(tensor):
        raise AssertionError("the stand-in runs on CPU: SGLang's CUDA hash is not reached")

    def flatten_nested_list(nested):  # sglang.srt.utils.common's
        return [x for sub in nested for x in flatten_nested_list(sub)] if isinstance(nested, list) else [nested]

    import hashlib

    namespace = {"torch": torch, "hashlib": hashlib, "gpu_tensor_hash": gpu_tensor_hash,
                 "flatten_nested_list": flatten_nested_list, "__name__": "sglang.srt.managers.mm_utils"}
    return define(wanted, namespace, HASHING)["tensor_hash"]
