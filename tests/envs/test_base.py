"""The environment interface: validated messages and steps, tool specs, the registry, resolve_env."""
from __future__ import annotations

import subprocess
import sys

import pytest

from colorl.envs import ENVS, Environment, EnvError, EnvStep, InvalidStep, Message, ToolSpec, resolve_env
from colorl.envs.calculator import CalculatorEnv


def test_importing_colorl_envs_does_not_import_torch():
    code = "import sys, colorl.envs; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_message_as_dict_keeps_only_the_keys_that_are_set():
    assert Message("user", "hi").as_dict() == {"role": "user", "content": "hi"}
    assert Message("tool", "5", name="calculator", tool_call_id="c1").as_dict() == {
        "role": "tool", "content": "5", "name": "calculator", "tool_call_id": "c1"}


@pytest.mark.parametrize("kwargs", [dict(role="robot", content="x"), dict(role="user", content=3),
                                    dict(role="tool", content="x", name=7)])
def test_bad_messages_are_refused(kwargs):
    with pytest.raises(InvalidStep):
        Message(**kwargs)


def test_a_done_step_normalises_its_reward_to_float():
    assert EnvStep([], done=True, reward=1).reward == 1.0 and isinstance(EnvStep([], True, 1).reward, float)


@pytest.mark.parametrize("kwargs, why", [
    (dict(messages=[], done=True, reward=None), "numeric reward"),
    (dict(messages=[], done=True, reward=float("nan")), "not finite"),
    (dict(messages=[], done=True, reward=True), "numeric reward"),
    (dict(messages=[Message("user", "more")], done=False, reward=0.5), "only when done"),
    (dict(messages=[], done=False), "no new messages"),
    (dict(messages=[{"role": "user", "content": "x"}], done=False), "list of Message"),
    (dict(messages=[Message("assistant", "x")], done=False), "as the assistant"),
    (dict(messages=[], done=1, reward=0.0), "done"),
    (dict(messages=[], done=True, reward=0.0, tool_errors=-1), "tool_errors"),
])
def test_bad_steps_are_refused_with_the_reason(kwargs, why):
    with pytest.raises(InvalidStep, match=why):
        EnvStep(**kwargs)


def test_tool_spec_schema_is_the_chat_template_function_format():
    spec = ToolSpec("add", "Add two numbers.", {"type": "object", "properties": {"a": {"type": "number"}}})
    assert spec.as_schema() == {"type": "function", "function": {
        "name": "add", "description": "Add two numbers.", "parameters": spec.parameters}}
    with pytest.raises(EnvError, match="identifier"):
        ToolSpec("two words", "", {"type": "object"})
    with pytest.raises(EnvError, match="type 'object'"):
        ToolSpec("add", "", {"type": "string"})


USER_MODULE = '''
from colorl.envs import Environment, EnvStep, Message

class Echo(Environment):
    def reset(self):
        return [Message("user", self.problem.prompt)]

    def step(self, assistant_text):
        return EnvStep([], done=True, reward=1.0)

class Half(Environment):
    def reset(self):
        return []

NOT_A_CLASS = 3

class Plain:
    pass
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(USER_MODULE)
    (tmp_path / "broken_envs.py").write_text("raise RuntimeError('boom\\non two lines')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("my_envs", "broken_envs"):
        sys.modules.pop(name, None)


def test_resolve_env_by_registry_name_and_by_module_class(user_module):
    assert ENVS["calculator"] is CalculatorEnv and resolve_env("calculator") is CalculatorEnv
    echo = resolve_env("my_envs:Echo")
    assert issubclass(echo, Environment) and echo.tools == ()


@pytest.mark.parametrize("spec, why", [
    ("nope", "not one of \\['calculator'"),
    ("my_envs:", "not 'module:Class'"),
    ("no_such_module_xyz:Env", "cannot import 'no_such_module_xyz'"),
    ("broken_envs:Env", "RuntimeError: boom"),
    ("my_envs:Missing", "'Missing' is not a concrete subclass"),
    ("my_envs:NOT_A_CLASS", "not a concrete subclass"),
    ("my_envs:Plain", "not a concrete subclass"),
    ("my_envs:Half", "not a concrete subclass"),  # abstract: step() missing
])
def test_resolve_env_errors_are_one_line(user_module, spec, why):
    with pytest.raises(EnvError, match=why) as caught:
        resolve_env(spec)
    assert str(caught.value).startswith(f"environment {spec!r}: ") and "\n" not in str(caught.value)
