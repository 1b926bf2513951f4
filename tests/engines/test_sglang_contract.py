"""The SGLang adapter against the real package: every name it uses exists in the pinned wheel.

SGLang needs CUDA and pins its own torch, so it is never installed or imported here. The test
downloads the wheel of `SGLANG_VERSION` (`pip download --no-deps`, cached in
~/.cache/colorl/wheels or $COLORL_WHEEL_CACHE) and reads its source with `ast`:
- what the adapter calls (read from colorl/engines/sglang.py's own syntax tree, so the list cannot
  drift from the code): `sglang.Engine(**server args)`, the engine's and the tokenizer
  manager's methods with their keywords, the io_struct request classes with their fields, the
  sampling-parameter keys, and the keys it reads from SGLang's replies;
- the recording stand-in (sglang_standin.py) the other test drives the adapter against: its
  methods, keywords and request fields must exist in the wheel under the same names.
Skipped, saying why, only when the package registry cannot be reached.
"""
from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import zipfile
from functools import cached_property
from pathlib import Path

import pytest

import colorl.engines.sglang as adapter

ROOT = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).parent / "sglang_standin.py"
CACHE = Path(os.environ.get("COLORL_WHEEL_CACHE", Path.home() / ".cache" / "colorl" / "wheels"))


def _find_wheel() -> Path | None:
    found = sorted(CACHE.glob(f"sglang-{adapter.SGLANG_VERSION}-*.whl"))
    return found[0] if found else None


@pytest.fixture(scope="module")
def wheel() -> "Wheel":
    path = _find_wheel()
    if path is None:
        CACHE.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                               f"sglang=={adapter.SGLANG_VERSION}", "-d", str(CACHE)],
                              capture_output=True, text=True, timeout=600)
        path = _find_wheel()
        if path is None:
            reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"sglang=={adapter.SGLANG_VERSION} wheel not obtainable (registry unreachable?): {reason}")
    return Wheel(path)


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

    def strings(self, *names: str) -> set[str]:
        return {node.value for name in names for node in ast.walk(self.tree(name))
                if isinstance(node, ast.Constant) and isinstance(node.value, str)}

    @cached_property
    def engine_methods(self) -> dict[str, set[str]]:
        engine = self.classes("sglang/srt/entrypoints/engine.py")["Engine"]
        return _methods(engine)

    @cached_property
    def tokenizer_manager_methods(self) -> dict[str, set[str]]:
        """TokenizerManager and the mixins it is assembled from."""
        methods: dict[str, set[str]] = {}
        for name in ("sglang/srt/managers/tokenizer_manager.py", "sglang/srt/managers/tokenizer_control_mixin.py"):
            for cls in self.classes(name).values():
                if cls.name in ("TokenizerManager", "TokenizerControlMixin"):
                    methods.update(_methods(cls))
        return methods

    @cached_property
    def io_struct(self) -> dict[str, dict[str, ast.expr | None]]:
        """Request classes -> {field: default} (BaseReq's own fields included)."""
        classes = self.classes("sglang/srt/managers/io_struct.py")
        return {name: _fields(cls) for name, cls in classes.items()}

    @cached_property
    def server_args(self) -> set[str]:
        """ServerArgs is assembled from the namespace classes listed in server_args.py."""
        tree = self.tree("sglang/srt/server_args.py")
        namespaces = next(
            {elt.id for elt in node.value.elts} for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_INPUT_NAMESPACES")
        fields: set[str] = set()
        for name in self.zip.namelist():
            if name.startswith("sglang/srt/arg_groups/fields/") and name.endswith(".py"):
                for cls in self.classes(name).values():
                    if cls.name in namespaces:
                        fields.update(f for f in _fields(cls) if not f.startswith("_"))
        return fields

    @cached_property
    def sampling_params(self) -> set[str]:
        cls = self.classes("sglang/srt/sampling/sampling_params.py")["SamplingParams"]
        return set(_fields(cls))


def _methods(cls: ast.ClassDef) -> dict[str, set[str]]:
    out = {}
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            out[node.name] = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    return out


def _fields(cls: ast.ClassDef) -> dict[str, ast.expr | None]:
    fields = {"rid": None} if any(getattr(b, "id", None) == "BaseReq" for b in cls.bases) else {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            fields[node.target.id] = node.value
    return fields


# -- what the adapter uses, read from its syntax tree ----------------------------------------------

class Uses(ast.NodeVisitor):
    def __init__(self):
        self.engine: list[tuple[str, set[str]]] = []  # self._engine.m(kw=...)
        self.tokenizer_manager: list[tuple[str, set[str]]] = []  # self._tm.m(kw=...)
        self.requests: list[tuple[str, set[str]]] = []  # self._io.Cls(kw=...)
        self.server_args: set[str] = set()  # sglang.Engine(kw=...)
        self.sampling: set[str] = set()  # keys of `params` in add()
        self.reply_keys: set[str] = set()  # x["key"] / x.get("key") on SGLang's replies

    def visit_Call(self, node: ast.Call) -> None:
        func, keywords = node.func, {k.arg for k in node.keywords if k.arg}
        if isinstance(func, ast.Attribute):
            owner = func.value
            if _is_self_attr(owner, "_engine"):
                self.engine.append((func.attr, keywords))
            elif _is_self_attr(owner, "_tm"):
                self.tokenizer_manager.append((func.attr, keywords))
            elif _is_self_attr(owner, "_io"):
                self.requests.append((func.attr, keywords))
            elif isinstance(owner, ast.Name) and owner.id == "sglang" and func.attr == "Engine":
                self.server_args |= keywords
            elif func.attr == "get" and isinstance(owner, ast.Name) and owner.id in ("meta", "chunk", "span"):
                self.reply_keys.add(node.args[0].value)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            if isinstance(node.value, ast.Name) and node.value.id == "params":
                self.sampling.add(key.value)
            else:
                self.reply_keys.add(key.value)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == "params" and isinstance(node.value, ast.Dict):
            self.sampling |= {k.value for k in node.value.keys}
        self.generic_visit(node)


def _is_self_attr(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == name and getattr(node.value, "id", None) == "self"


@pytest.fixture(scope="module")
def uses() -> Uses:
    visitor = Uses()
    visitor.visit(ast.parse(inspect.getsource(adapter)))
    return visitor


# -- the adapter ------------------------------------------------------------------------------------

def test_the_wheel_is_the_pinned_version_and_exports_engine(wheel):
    assert wheel.version() == adapter.SGLANG_VERSION
    assert "Engine" in wheel.strings("sglang/__init__.py")
    pin = f"sglang=={adapter.SGLANG_VERSION}"
    assert pin in (ROOT / "pyproject.toml").read_text(), f"the colorl[sglang] extra must pin {pin}"


def test_server_args_exist(wheel, uses):
    assert uses.server_args >= {"model_path", "mem_fraction_static", "enable_memory_saver", "weight_version"}
    assert sorted(uses.server_args - wheel.server_args) == []


def test_engine_methods_and_keywords_exist(wheel, uses):
    assert {m for m, _ in uses.engine} >= {"async_generate", "update_weights_from_tensor", "begin_weight_update",
                                             "end_weight_update", "release_memory_occupation",
                                             "resume_memory_occupation", "flush_cache"}
    for method, keywords in uses.engine:
        assert method in wheel.engine_methods, f"sglang.Engine has no {method}"
        assert keywords <= wheel.engine_methods[method], f"Engine.{method} lacks {keywords - wheel.engine_methods[method]}"


def test_tokenizer_manager_methods_and_request_classes_exist(wheel, uses):
    assert {m for m, _ in uses.tokenizer_manager} == {"pause_generation", "continue_generation",
                                                      "update_weight_version", "abort_request"}
    for method, keywords in uses.tokenizer_manager:
        assert method in wheel.tokenizer_manager_methods, f"TokenizerManager has no {method}"
        assert keywords <= wheel.tokenizer_manager_methods[method]
    for cls, keywords in uses.requests:
        assert cls in wheel.io_struct, f"io_struct has no {cls}"
        assert keywords <= set(wheel.io_struct[cls]), f"{cls} lacks {keywords - set(wheel.io_struct[cls])}"
    pause = wheel.classes("sglang/srt/managers/io_struct.py")["PauseGenerationReqInput"]
    assert "in_place" in ast.unparse(pause.body[1].annotation)  # mode: Literal["abort", "retract", "in_place"]


def test_sampling_keys_and_reply_fields_exist(wheel, uses):
    assert uses.sampling <= wheel.sampling_params, uses.sampling - wheel.sampling_params
    produced = wheel.strings("sglang/srt/managers/tokenizer_manager.py", "sglang/srt/utils/weight_versions.py",
                             "sglang/srt/managers/scheduler.py")
    assert uses.reply_keys >= {"output_ids", "meta_info", "finish_reason", "output_token_logprobs", "type",
                               "weight_versions", "version", "start", "end", "max_total_num_tokens"}
    assert sorted(uses.reply_keys - produced) == []
    finish_types = wheel.strings("sglang/srt/managers/schedule_batch.py")
    assert set(adapter.FINISH_REASONS) <= finish_types
    tags = wheel.strings("sglang/srt/constants.py")
    assert {tag for level in adapter.RELEASE_TAGS.values() for tag in level} <= tags
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" in wheel.text("sglang/srt/layers/sampler.py")


def test_update_must_run_inside_a_weight_update_session(wheel):
    """Why the adapter opens begin/end_weight_update around its buckets in this version."""
    source = wheel.text("sglang/srt/managers/scheduler_components/weight_updater.py")
    assert "update_weights_from_tensor must run between" in source


# -- the stand-in speaks the same names --------------------------------------------------------------

def test_standin_signatures_exist_in_the_wheel(wheel):
    tree = ast.parse(STANDIN.read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    real = {"Engine": wheel.engine_methods, "TokenizerManager": wheel.tokenizer_manager_methods}
    for name, methods in real.items():
        for method, args in _methods(classes[name]).items():
            if method.startswith("_"):
                continue
            assert method in methods, f"stand-in {name}.{method} is not in the wheel"
            assert args <= methods[method], f"stand-in {name}.{method} has {args - methods[method]} the wheel lacks"
    for name in ("PauseGenerationReqInput", "ContinueGenerationReqInput", "UpdateWeightVersionReqInput",
                 "FlushCacheReqOutput"):
        mine, theirs = _fields(classes[name]), wheel.io_struct[name]
        assert set(mine) <= set(theirs), f"stand-in {name} fields {set(mine) - set(theirs)}"
        for field, default in mine.items():
            assert ast.dump(default) == ast.dump(theirs[field]) if default is not None else theirs[field] is None


def test_the_sglang_extra_pins_what_the_wheel_pins(wheel):
    """Issue 19 defect 11: `pip install 'colorl[sglang]'` gives one consistent environment: the extra
    names the torch and transformers releases the wheel itself requires."""
    import tomllib

    metadata = next(n for n in wheel.zip.namelist() if n.endswith(".dist-info/METADATA"))
    requires = {line.split(":", 1)[1].strip().split(";")[0].replace(" ", "")
                for line in wheel.zip.read(metadata).decode().splitlines() if line.startswith("Requires-Dist:")}
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["sglang"]
    assert f"sglang=={adapter.SGLANG_VERSION}" in extra
    for package in ("torch", "transformers"):
        pinned = [r for r in requires if r.startswith(f"{package}==")]
        assert pinned and pinned[0] in extra, (package, pinned, extra)
