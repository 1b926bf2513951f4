"""The SGLang adapter against the real package: every name it uses exists in the pinned wheel.

SGLang needs CUDA and pins its own torch, so it is never installed or imported here. The test
downloads the wheel of `SGLANG_VERSION` (tests/helpers/sglang_wheel.py: `pip download --no-deps`,
cached in ~/.cache/colorl/wheels or $COLORL_WHEEL_CACHE) and reads its source with `ast`:
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
from functools import cached_property
from pathlib import Path

import pytest

import colorl.engines.sglang as adapter
import sglang_wheel  # tests/helpers
from standin_rank import load_standin  # tests/helpers

ROOT = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).parent / "sglang_standin.py"


@pytest.fixture(scope="module")
def wheel() -> "Wheel":
    return Wheel(sglang_wheel.require())


class Wheel(sglang_wheel.Wheel):
    """What the contract reads of the wheel: methods, request fields, server args, sampling keys."""

    @cached_property
    def engine_methods(self) -> dict[str, set[str]]:
        return _methods(self.engine_class)

    @cached_property
    def tokenizer_manager_methods(self) -> dict[str, set[str]]:
        return {name: _arg_names(f) for name, f in self.tokenizer_manager_functions.items()}

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
    return {name: _arg_names(f) for name, f in sglang_wheel.methods_of(cls).items()}


def _arg_names(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = function.args
    return {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}


def _positional(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The parameters a call can fill by position, `self` left out."""
    return [a.arg for a in function.args.posonlyargs + function.args.args][1:]


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
        self.positional: list[tuple[str, str, list[ast.expr]]] = []  # (owner, method, positional arguments)
        self.unpacked: dict[str, int] = {}  # a, b = self._engine.m(...): method -> names unpacked
        self.tokenizer_manager: list[tuple[str, set[str]]] = []  # self._tm.m(kw=...)
        self.requests: list[tuple[str, set[str]]] = []  # self._io.Cls(kw=...)
        self.server_args: set[str] = set()  # sglang.Engine(kw=...)
        self.sampling: set[str] = set()  # keys of `params` in add()
        self.reply_keys: set[str] = set()  # x["key"] / x.get("key") on SGLang's replies

    def visit_Call(self, node: ast.Call) -> None:
        func, keywords = node.func, {k.arg for k in node.keywords if k.arg}
        if isinstance(func, ast.Attribute):
            owner = func.value
            if _is_self_attr(owner, "_engine") or _is_self_attr(owner, "_tm"):
                self.positional.append((owner.attr, func.attr, list(node.args)))
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
        value = node.value
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Call) and _is_self_attr(value.func.value, "_engine"):
            self.unpacked[value.func.attr] = len(target.elts)
        self.generic_visit(node)


class ReplyPaths:
    """The paths of keys (and positions) the adapter reads from SGLang's replies, following the names
    it gives them: `meta = chunk["meta_info"]`, `for span in spans`, ... Roots: "chunk" (a streamed
    chunk of async_generate) and "server_info" (get_server_info()). "[]" stands for a list's items."""

    def __init__(self, tree: ast.Module):
        self.aliases: dict[str, tuple] = {"chunk": ("chunk",)}
        for _ in range(3):  # aliases of aliases
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                    self._alias(node.targets[0].id, node.value)
                elif isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
                    self._alias(node.target.id, node.iter, item=True)
        self.reads = {path for node in ast.walk(tree) if (path := self.resolve(node)) and len(path) > 1}

    def _alias(self, name: str, value: ast.expr, item: bool = False) -> None:
        path = self.resolve(value)
        if path:
            self.aliases[name] = path + ("[]",) if item else path

    def resolve(self, node: ast.AST) -> tuple | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            base = self.resolve(node.value)
            return base + (node.slice.value,) if base else None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "get_server_info" and _is_self_attr(node.func.value, "_engine"):
                return ("server_info",)
            if node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Constant):
                base = self.resolve(node.func.value)
                return base + (node.args[0].value,) if base else None
        return None


def _reply_schema(wheel) -> set[tuple]:
    """Every path SGLang's replies hold, read from where the wheel builds them."""
    def dict_keys(node: ast.AST) -> set:
        return {k.value for k in getattr(node, "keys", []) if isinstance(k, ast.Constant)}

    tm, versions = wheel.tree("sglang/srt/managers/tokenizer_manager.py"), wheel.tree("sglang/srt/utils/weight_versions.py")
    chunk = set().union(*(dict_keys(n) for n in ast.walk(tm) if isinstance(n, ast.Dict) and "meta_info" in dict_keys(n)))
    meta: set = set()
    for tree in (tm, versions):
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                target = node.targets[0]
                if isinstance(target, ast.Name) and target.id == "meta_info":
                    meta |= dict_keys(node.value)
                elif (isinstance(target, ast.Subscript) and getattr(target.value, "id", None) == "meta_info"
                      and isinstance(target.slice, ast.Constant)):
                    meta.add(target.slice.value)
    to_json = [f for f in ast.walk(wheel.tree("sglang/srt/managers/schedule_batch.py"))
               if isinstance(f, ast.FunctionDef) and f.name == "to_json"]
    finish = set().union(*(dict_keys(r.value) for f in to_json for r in ast.walk(f) if isinstance(r, ast.Return)))
    add_spans = wheel.functions("sglang/srt/utils/weight_versions.py")["add_weight_versions_to_meta_info"]
    span = set().union(*(dict_keys(n) for n in ast.walk(add_spans) if isinstance(n, ast.Dict)))
    detokenize = wheel.functions("sglang/srt/managers/tokenizer_manager.py")["detokenize_logprob_tokens"]
    entry = next(n.elt for n in ast.walk(detokenize) if isinstance(n, ast.ListComp))
    assert isinstance(entry, ast.Tuple) and entry.elts[0].id == "logprob"  # (logprob, token_id, None)
    init_info = wheel.functions("sglang/srt/managers/scheduler.py")["get_init_info"]
    server = set().union(*(dict_keys(n) for n in ast.walk(init_info) if isinstance(n, ast.Dict)))
    server_info = ast.unparse(wheel.functions("sglang/srt/entrypoints/engine.py")["get_server_info"])
    assert "**self._scheduler_init_result.scheduler_infos[0]" in server_info and "resolved_dict()" in server_info
    server |= wheel.server_args  # the server info starts with the resolved server arguments
    paths = {("chunk", k) for k in chunk} | {("chunk", "meta_info", k) for k in meta} | {("chunk", "output_ids", "[]")}
    paths |= {("chunk", "meta_info", "finish_reason", k) for k in finish} | {("server_info", k) for k in server}
    paths |= {("chunk", "meta_info", "weight_versions", "[]", k) for k in span}
    paths |= {("chunk", "meta_info", "output_token_logprobs", "[]", i) for i in range(len(entry.elts))}
    return {path[:n] for path in paths for n in range(1, len(path) + 1)}


def _paths(value, path: tuple) -> set[tuple]:
    """The paths a reply the stand-in built holds (the same notation as ReplyPaths)."""
    found = {path}
    if isinstance(value, dict):
        for key, item in value.items():
            found |= _paths(item, path + (key,))
    elif isinstance(value, list):
        for item in value:
            found |= _paths(item, path + ("[]",))
    elif isinstance(value, tuple):
        for i, item in enumerate(value):
            found |= _paths(item, path + (i,))
    return found


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
                                                      "update_weight_version", "abort_request", "check_weights"}
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
    produced |= set(wheel.io_struct["ChecksumInfo"])  # check_weights' reply: one ChecksumInfo per TP rank
    assert uses.reply_keys >= {"output_ids", "meta_info", "finish_reason", "output_token_logprobs", "type",
                               "weight_versions", "version", "start", "end", "max_total_num_tokens"}
    assert sorted(uses.reply_keys - produced) == []
    finish_types = wheel.strings("sglang/srt/managers/schedule_batch.py")
    assert set(adapter.FINISH_REASONS) <= finish_types
    tags = wheel.strings("sglang/srt/constants.py")
    assert {tag for level in adapter.RELEASE_TAGS.values() for tag in level} <= tags
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" in wheel.text("sglang/srt/layers/sampler.py")


def test_the_checksum_check_hashes_what_the_adapter_hashes(wheel):
    """Qwen2's SGLang model cannot be read back (no get_weights_by_name), so the adapter compares
    SGLang's weight checksums: each parameter of the model, fused as its stacked_params_mapping says
    (the adapter's STACKED), hashed with mm_utils.tensor_hash as f"{h:016x}"; the reply carries them
    per rank under "checksums"."""
    assert "get_weights_by_name" not in wheel.functions("sglang/srt/models/qwen2.py")
    checker = wheel.text("sglang/srt/utils/weight_checker.py")
    assert "from sglang.srt.managers.mm_utils import tensor_hash" in checker
    assert 'return f"{tensor_hash(t):016x}"' in checker
    assert "checksums[name] = _hash_tensor(comparable.dequantize().data)" in checker
    for model in ("qwen2", "llama"):
        triples = {tuple(e.value for e in node.elts) for node in ast.walk(wheel.tree(f"sglang/srt/models/{model}.py"))
                   if isinstance(node, ast.Tuple) and len(node.elts) == 3 and all(isinstance(e, ast.Constant) for e in node.elts)}
        for part, (fused, shard) in adapter.STACKED.items():
            shard_id = "qkv"[shard] if fused == "qkv_proj" else shard
            assert {(fused, part, shard_id), (f".{fused}", f".{part}", shard_id)} & triples, (model, part)
    returns = ast.unparse(wheel.tokenizer_manager_functions["check_weights"].returns)
    assert returns == "Tuple[bool, str, Optional[List[Dict]], Optional[str]]", returns


def test_update_must_run_inside_a_weight_update_session(wheel):
    """Why the adapter opens begin/end_weight_update around its buckets in this version."""
    source = wheel.text("sglang/srt/managers/scheduler_components/weight_updater.py")
    assert "update_weights_from_tensor must run between" in source


def test_positional_arguments_land_where_the_wheel_expects_them(wheel, uses):
    """A call by position must fill the parameter it means: at most as many positional arguments as
    the wheel's method takes, and a request object passed to a tokenizer-manager method must be the
    class its first parameter is annotated with."""
    functions = {"_engine": methods_of_engine(wheel), "_tm": wheel.tokenizer_manager_functions}
    assert uses.positional, "the adapter passes nothing by position?"
    for owner, method, arguments in uses.positional:
        function = functions[owner][method]
        positional = _positional(function)
        assert len(arguments) <= len(positional), f"{owner}.{method} takes {positional} by position, got {len(arguments)}"
        for argument, name in zip(arguments, positional):
            if isinstance(argument, ast.Call) and _is_self_attr(argument.func.value, "_io"):
                parameter = next(a for a in function.args.args if a.arg == name)
                assert ast.unparse(parameter.annotation) == argument.func.attr, (method, name)


def methods_of_engine(wheel) -> dict:
    return sglang_wheel.methods_of(wheel.engine_class)


def test_results_the_adapter_unpacks_have_that_shape(wheel, uses):
    """`ok, message = engine.m(...)`: sglang.Engine.m returns the tokenizer manager's m, which is
    declared Tuple[bool, str]; the stand-in returns the same pairs. get_weights_by_name gives rows as
    nested lists (the model's tolist()), which read_weights turns back into a tensor."""
    assert set(uses.unpacked) >= {"update_weights_from_tensor", "begin_weight_update", "end_weight_update"}
    standin = {n.name: n for n in ast.parse(STANDIN.read_text()).body if isinstance(n, ast.ClassDef)}["Engine"]
    standin_methods = sglang_wheel.methods_of(standin)
    for method, arity in uses.unpacked.items():
        body = ast.unparse(methods_of_engine(wheel)[method])
        assert f"self.loop.run_until_complete(self.tokenizer_manager.{method}(" in body, method
        returns = wheel.tokenizer_manager_functions[method].returns
        assert ast.unparse(returns) == "Tuple[bool, str]" and arity == 2, (method, ast.unparse(returns))
        shapes = {len(r.value.elts) if isinstance(r.value, ast.Tuple) else None
                  for r in ast.walk(standin_methods[method]) if isinstance(r, ast.Return)}
        assert shapes == {arity}, f"stand-in {method} returns {shapes}"
    llama = ast.unparse(wheel.functions("sglang/srt/models/llama.py")["get_weights_by_name"])
    assert ".tolist()[:truncate_size]" in llama
    assert "return all_parameters[0]" in ast.unparse(wheel.tokenizer_manager_functions["get_weights_by_name"])


def test_reply_keys_nest_as_in_the_wheel(wheel):
    """Not only names: every path the adapter reads (chunk -> meta_info -> finish_reason -> type, the
    spans' version/start/end, the log-prob entries' position 0, the server info's pool size) exists
    at that depth in what the wheel builds, and so does every path of the stand-in's replies."""
    schema = _reply_schema(wheel)
    reads = ReplyPaths(ast.parse(inspect.getsource(adapter))).reads
    assert reads >= {("chunk", "meta_info", "finish_reason", "type"), ("chunk", "output_ids"),
                     ("chunk", "meta_info", "weight_versions", "[]", "version"),
                     ("chunk", "meta_info", "output_token_logprobs", "[]", 0), ("server_info", "max_total_num_tokens")}
    assert sorted(reads - schema, key=str) == []
    sglang_standin = load_standin()

    state = sglang_standin._Req("r", [1, 2], {}, output_ids=[5, 6, 7], logprobs=[-1.0, -2.0, -0.5], events=[("0", 2)])
    owner = type("Owner", (), {"weight_version": "1", "tokenizer_manager": type("Manager", (), {
        "auto_create_handle_loop": lambda self: None})()})()
    chunk = sglang_standin.Engine._chunk(owner, state, {"type": "length", "length": 3})
    produced = _paths(chunk, ("chunk",)) | _paths(sglang_standin.Engine.get_server_info(owner), ("server_info",))
    assert sorted(produced - schema, key=str) == []


# -- the stand-in speaks the same names --------------------------------------------------------------

def test_standin_signatures_exist_in_the_wheel(wheel):
    tree = ast.parse(STANDIN.read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    real = {"Engine": wheel.engine_methods, "TokenizerManager": wheel.tokenizer_manager_methods}
    functions = {"Engine": methods_of_engine(wheel), "TokenizerManager": wheel.tokenizer_manager_functions}
    for name, methods in real.items():
        for method, function in sglang_wheel.methods_of(classes[name]).items():
            if method.startswith("_"):
                continue
            args = _arg_names(function)
            assert method in methods, f"stand-in {name}.{method} is not in the wheel"
            assert args <= methods[method], f"stand-in {name}.{method} has {args - methods[method]} the wheel lacks"
            theirs = _positional(functions[name][method])
            assert _positional(function) == theirs[:len(_positional(function))], \
                f"stand-in {name}.{method} orders its parameters {_positional(function)}, the wheel {theirs}"
    for name in ("PauseGenerationReqInput", "ContinueGenerationReqInput", "UpdateWeightVersionReqInput",
                 "FlushCacheReqOutput", "CheckWeightsReqInput"):
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


def test_what_the_adapter_assumes_of_start_up_and_aborts(wheel):
    """Issue 30: get_server_info's first await installs the tokenizer manager's signal handlers (the
    adapter takes them back after it); a request's state says whether the scheduler has it
    (`dispatched`, read by `interrupt`), and a handler cancelled before the dispatch drops it; the
    engine's start sets the NCCL variables `SGLangEngine.process_env` sets first, unless set."""
    from colorl.engines.sglang import SGLangEngine

    manager = "sglang/srt/managers/tokenizer_manager.py"
    info = ast.unparse(wheel.functions("sglang/srt/entrypoints/engine.py")["get_server_info"])
    assert "self.tokenizer_manager.get_internal_state()" in info
    internal = ast.unparse(wheel.functions("sglang/srt/managers/tokenizer_control_mixin.py")["get_internal_state"])
    assert internal.splitlines()[1].strip() == "self.auto_create_handle_loop()"
    assert "dispatched" in sglang_wheel_fields(wheel.classes(manager)["ReqState"])
    release = ast.unparse(wheel.functions(manager)["_release_req_states_on_failure"])
    assert "if state.dispatched:" in release and "del self.rid_to_state[rid]" in release
    generate = ast.unparse(wheel.functions(manager)["generate_request"])
    assert "except BaseException:" in generate and "self._release_req_states_on_failure(request_states)" in generate
    settings = ast.unparse(wheel.functions("sglang/srt/entrypoints/engine.py")["_set_envs_and_config"])
    for key in SGLangEngine.process_env:
        assert f"'{key}' not in os.environ" in settings and f"os.environ['{key}'] = str(" in settings


def sglang_wheel_fields(cls: ast.ClassDef) -> set[str]:
    return set(_fields(cls))
