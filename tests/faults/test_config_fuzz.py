"""Fuzzing the config loader and the `--set` parser: every input is accepted (exit 0) or rejected
with one line on stderr and exit 2; nothing raises, nothing prints a traceback."""
from __future__ import annotations

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st
from pydantic import BaseModel

from colorl.cli import main
from colorl.config import Config


def _key_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    paths = []
    for name, field in model.model_fields.items():
        paths.append(prefix + name)
        for arg in getattr(field.annotation, "__args__", (field.annotation,)):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                paths += _key_paths(arg, f"{prefix}{name}.")
    return paths


KEYS = _key_paths(Config)
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-3, 300), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30), st.sampled_from(["native", "hf", "jsonl", "colocated", "bounded_lag", "tiny-random-llama",
                                           "float32", "1e-4", "auto", "cpu", "x" * 300, "a\x00b", "../..", "/"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), inner, max_size=3)),
    max_leaves=8)
keys = st.one_of(st.sampled_from(KEYS), st.text(max_size=20))


def check(capsys, argv) -> None:
    code = main(argv)
    captured = capsys.readouterr()
    assert code in (0, 2), (argv, code, captured.err)
    if code == 2:
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("colorl: error: "), (argv, captured.err)
    assert "Traceback" not in captured.err


@SETTINGS
@given(data=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)))
def test_arbitrary_config_files(capsys, tmp_path_factory, data):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_bytes(data)
    check(capsys, ["train", str(path), "--dry-run"])


@SETTINGS
@given(sections=st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), values, max_size=6),
       model=st.booleans())
def test_config_files_shaped_like_configs(capsys, tmp_path_factory, sections, model):
    if model:
        sections = {**sections, "model": {"path": "tiny-random-llama"}}
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(yaml.safe_dump(sections, allow_unicode=True))
    check(capsys, ["train", str(path), "--dry-run"])


@pytest.mark.parametrize("key", ["literal[", "str", "list[int]", "function-after"])
def test_unknown_keys_named_like_pydantics_own_tags_are_named(capsys, tmp_path, key):
    """pydantic's error locations name union members ('str', 'literal[...]') beside the config's keys; the error
    line leaves those out, but a key the user wrote is never one of them (found by the fuzz above)."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({key: None, "model": {"path": "tiny-random-llama"}}))
    assert main(["train", str(path), "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == f"colorl: error: unknown key {key!r}; allowed: {sorted(Config.model_fields)}"


@SETTINGS
@given(items=st.lists(st.one_of(
    st.tuples(keys, values).map(lambda kv: f"{kv[0]}={yaml.safe_dump(kv[1], default_flow_style=True).strip()}"),
    st.tuples(keys, st.text(max_size=30)).map(lambda kv: f"{kv[0]}={kv[1]}"),
    st.text(max_size=30)), min_size=1, max_size=4))
def test_set_overrides(capsys, items):
    argv = ["train", "configs/tiny.yaml", "--dry-run"]
    for item in items:
        argv += ["--set", item]
    check(capsys, argv)


@pytest.mark.parametrize("item", [
    "model.path=" + "x" * 300, "model.path=" + "a/" * 3000, "task.path=" + "x" * 300, "model.path=~no_such_user_x/m",
    "run.seed=99999999999999999999999999", "run.seed=-1", "\x1e=\x1f", "a\u2028b=1", "=3", "run.=3", ".steps=3",
    "run=3", "run.steps=[" * 3000, "model.path=a\x00b",
])
def test_inputs_fuzzing_found(capsys, item):
    check(capsys, ["train", "configs/tiny.yaml", "--dry-run", "--set", item])
    check(capsys, ["train", "configs/tiny.yaml", "--dry-run", "--set", "task.name=jsonl", "--set", item])
