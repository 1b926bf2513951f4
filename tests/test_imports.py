"""The house: no import circle among colorl's modules, lazy (in-function) imports included. A circle means two
layers that each need the other (the config resolving user code that imports the config; a tracker drawing
charts through the reader that writes to it), and one of them should hand the other what it needs."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1] / "colorl"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        for name in names:
            while name and name not in modules:  # colorl.a.b.NAME -> the module colorl.a.b
                name = name.rpartition(".")[0]
            if name.startswith("colorl"):
                found.add(name)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_no_import_circle_among_colorls_modules():
    files = {module_name(path): path for path in ROOT.rglob("*.py")}
    modules = set(files)
    # a package's __init__ is imported with any of its modules; the edges that matter are the modules' own
    graph = {name: imported_modules(path, modules) - {name} - {p for p in modules if name.startswith(p + ".")}
             for name, path in files.items()}
    assert circles(graph) == []


def test_no_bench_script_hides_an_installed_module():
    """A bench runs as `python bench/x.py`, which puts bench/ first on the path: a bench module named like an
    installed package hides it from everything imported after it (transformers 5.25 imports the `kernels`
    package, which bench/kernels.py hid: every bench stopped with an ImportError, `make bench` included)."""
    import importlib.util

    bench = Path(__file__).parents[1] / "bench"
    assert [p.stem for p in bench.glob("*.py") if importlib.util.find_spec(p.stem) is not None] == []
