"""Security basics, checked on the source tree and on a real run directory.

- Only safetensors and DCP are loaded; any `torch.load` left says `weights_only=True`; no pickle
  (or its relatives) reads a file; YAML goes through `safe_load`; no `trust_remote_code`.
- Code is imported by name only from explicit config keys (`task.reward`, `task.options.row_map`),
  and engine backends only from colorl's own fixed table.
- Run directories and everything in them are created with the user's umask (no chmod, no mkdtemp); the
  caches of compiled code and kernel verdicts are the user's own folders (colorl/files.py closes them: 0700).
"""
from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for d in ("colorl", "bench", "tests") for p in (ROOT / d).rglob("*.py"))
UNSAFE_MODULES = {"pickle", "cPickle", "dill", "marshal", "shelve", "joblib", "cloudpickle"}
BUILTIN_CODE = {"__import__", "exec", "eval", "compile"}  # as bare names; `model.eval()` is something else
ALLOWED_DYNAMIC = {
    # user code a config names explicitly: task.reward, task.options.row_map, an environment's module:Class
    ("colorl/user_code.py", "import_named", "import_module"),
    ("colorl/engines/__init__.py", "engine_class", "import_module"),  # a fixed table of colorl's own modules
    # the stand-ins run the pinned wheels' own code (SGLang's restricted unpickler and weight hash, vLLM's
    # device choice), on inputs the test process made itself, never on a file
    ("tests/helpers/sglang_wheel.py", "define", "exec"),
    ("tests/helpers/sglang_wheel.py", "define", "compile"),
}
ALLOWED_IMPORTS = {("tests/helpers/sglang_wheel.py", "pickle")}  # the namespace SGLang's SafeUnpickler subclasses in


def _name(node: ast.AST) -> str:
    """Dotted name of a call's target: `torch.load`, `yaml.safe_load`, `load`."""
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _keyword(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_uses(source: str, rel: str) -> list[str]:
    tree = ast.parse(source)
    found = []
    functions = {}  # call node -> enclosing function name
    for func in ast.walk(tree):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(func):
                functions.setdefault(id(node), func.name)
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} imports {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES
                      and (rel, a.name) not in ALLOWED_IMPORTS]
        elif isinstance(node, ast.ImportFrom):
            module = (node.module or "").split(".")[0]
            if module in UNSAFE_MODULES:
                found.append(f"{where} imports from {module}")
            if module in ("torch", "yaml") and any(a.name in ("load", "unsafe_load", "full_load") for a in node.names):
                found.append(f"{where} imports {module}.load by name (hides it from this check)")
        elif isinstance(node, ast.Call):
            name = _name(node.func)
            last = name.rsplit(".", 1)[-1]
            if name == "torch.load" and not _is_true(_keyword(node, "weights_only")):
                found.append(f"{where} torch.load without weights_only=True")
            elif name in ("yaml.load", "yaml.load_all"):
                loader = _name(_keyword(node, "Loader")) if _keyword(node, "Loader") is not None else ""
                if not loader.endswith(("SafeLoader", "CSafeLoader")):
                    found.append(f"{where} {name} without a SafeLoader")
            elif name in ("yaml.unsafe_load", "yaml.full_load", "yaml.unsafe_load_all", "yaml.full_load_all"):
                found.append(f"{where} {name}")
            elif last == "load" and name.startswith(("np.", "numpy.")) and _is_true(_keyword(node, "allow_pickle")):
                found.append(f"{where} {name}(allow_pickle=True)")
            elif _is_true(_keyword(node, "trust_remote_code")):
                found.append(f"{where} trust_remote_code=True")
            elif (last == "import_module" or name in BUILTIN_CODE) and \
                    (rel, functions.get(id(node)), last) not in ALLOWED_DYNAMIC:
                found.append(f"{where} {name}() outside user_code.import_named")
            elif name in ("os.chmod", "os.fchmod", "tempfile.mkdtemp") and rel.startswith("colorl/") and \
                    rel not in ("colorl/models.py", "colorl/launch.py", "colorl/files.py"):
                found.append(f"{where} {name} (run files follow the user's umask)")
    return found


def test_source_tree_has_no_unsafe_load():
    found = [use for path in SOURCES for use in unsafe_uses(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))]
    assert found == []


@pytest.mark.parametrize("snippet", [
    "import torch\ntorch.load('x.pt')",
    "import torch\ntorch.load('x.pt', weights_only=False)",
    "import pickle\npickle.load(open('x', 'rb'))",
    "from pickle import loads",
    "import yaml\nyaml.load(text)",
    "import yaml\nyaml.load(text, Loader=yaml.Loader)",
    "import yaml\nyaml.unsafe_load(text)",
    "from torch import load",
    "import numpy as np\nnp.load('x.npy', allow_pickle=True)",
    "from transformers import AutoModel\nAutoModel.from_pretrained(p, trust_remote_code=True)",
    "import importlib\nimportlib.import_module(name)",
    "eval(text)",
])
def test_the_check_catches_each_unsafe_form(snippet):
    assert len(unsafe_uses(snippet, "colorl/x.py")) == 1


@pytest.mark.parametrize("snippet", [
    "import torch\ntorch.load('x.pt', weights_only=True)",
    "import yaml\nyaml.safe_load(text)",
    "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)",
])
def test_the_check_passes_safe_forms(snippet):
    assert unsafe_uses(snippet, "colorl/x.py") == []


def test_run_files_follow_the_users_umask(tmp_path, tiny_model_dir):
    """prepare_run_dir, a checkpoint, metrics and events under umask 027: nothing group-writable or
    world-readable, nothing stricter than the umask either (0o750 folders, 0o640 files)."""
    import torch

    from colorl.config import load_config
    from colorl.metrics.logger import METRIC_KEYS, MetricsWriter
    from colorl.models import load_model
    from colorl.train.checkpoint import TrainerState, save_checkpoint
    from colorl.worker import prepare_run_dir

    old = os.umask(0o027)
    try:
        run_dir = tmp_path / "runs" / "r"
        prepare_run_dir(load_config("configs/tiny.yaml"), run_dir, resume=False)
        model = load_model(tiny_model_dir)
        optimizer = torch.optim.AdamW(model.parameters())
        save_checkpoint(run_dir, model, optimizer, TrainerState(step=1))
        MetricsWriter(run_dir).write({k: 0 for k in METRIC_KEYS})
    finally:
        os.umask(old)
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*")}
    assert len(modes) > 10
    assert {p: m for p, m in modes.items() if m != (0o750 if (tmp_path / p).is_dir() else 0o640)} == {}
