"""The tool-call format: declared in the system turn or through a template's tools section; calls parsed
into ToolCall or ToolCallError, never an exception."""
from __future__ import annotations

import json
import re

import pytest

from colorl.envs import Message, ToolCall, ToolCallError, ToolSpec, has_tool_call, parse_tool_calls, render_chat
from colorl.envs import tools as tools_module
from colorl.envs.tools import declare_tools, template_has_tools

ADD = ToolSpec("add", "Add two numbers.", {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]})
SEARCH = ToolSpec("search", "Search the notes.", {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": ["integer", "null"]}},
    "required": ["query"], "additionalProperties": False})
TOOLS = (ADD, SEARCH)

def call(name: str, arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_template_tools_section_is_detected(chatml_tokenizer, tools_tokenizer):
    assert not template_has_tools(chatml_tokenizer)
    assert template_has_tools(tools_tokenizer)


def test_without_a_tools_section_colorl_declares_tools_in_the_system_turn_and_wraps_results(chatml_tokenizer):
    messages = [Message("system", "Be brief."), Message("user", "2+3?"),
                Message("assistant", call("add", {"a": 2, "b": 3})), Message("tool", "5", name="add")]
    text = render_chat(chatml_tokenizer, messages, TOOLS, add_generation_prompt=True)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(ADD.as_schema()) in system and json.dumps(SEARCH.as_schema()) in system
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n" in text
    assert "<|im_start|>tool" not in text and text.endswith("<|im_start|>assistant\n")


def test_a_system_turn_is_added_for_the_declarations_only_when_there_are_tools(chatml_tokenizer):
    user = [Message("user", "hi")]
    assert render_chat(chatml_tokenizer, user, TOOLS, True).startswith("<|im_start|>system\n# Tools\n")
    assert render_chat(chatml_tokenizer, user, (), True) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_with_a_tools_section_gets_the_schemas_and_the_tool_role(tools_tokenizer):
    messages = [Message("user", "2+3?"), Message("assistant", call("add", {"a": 2, "b": 3})), Message("tool", "5")]
    text = render_chat(tools_tokenizer, messages, TOOLS, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n[native tools] add search<|im_end|>\n")
    assert "# Tools" not in text and "<|im_start|>tool\n5<|im_end|>\n" in text


def test_the_module_docstring_quotes_the_declaration_it_writes():
    """The docstring is quoted in the docs: it must stay the format the model is actually shown."""
    doc_lines = {line.strip() for line in tools_module.__doc__.splitlines()}
    written = declare_tools([ToolSpec("calculator", "...", {"type": "object"})]).splitlines()
    assert [line for line in written if line.strip() and line.strip() not in doc_lines] == [
        json.dumps({"type": "function", "function": {"name": "calculator", "description": "...",
                                                     "parameters": {"type": "object"}}}),
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:",
    ]  # the schema line is elided there, and the long line wrapped


def test_good_and_multiple_calls_are_parsed_in_order():
    text = (f"Let me add. {call('add', {'a': 2, 'b': 3.5})} and look up "
            '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"pi\\", \\"limit\\": null}"}</tool_call> done')
    assert has_tool_call(text)
    assert parse_tool_calls(text, TOOLS) == [ToolCall("add", {"a": 2, "b": 3.5}),
                                             ToolCall("search", {"query": "pi", "limit": None})]
    assert parse_tool_calls("The answer is 5.", TOOLS) == [] and not has_tool_call("The answer is 5.")


@pytest.mark.parametrize("text, why, name", [
    ("<tool_call>{'name': 'add'}</tool_call>", "not valid JSON", None),
    ("<tool_call>[1, 2]</tool_call>", "must be a JSON object", None),
    ('<tool_call>{"arguments": {}}</tool_call>', "must be a JSON object", None),
    (call("multiply", {"a": 1}), "unknown tool 'multiply'; tools: \\['add', 'search'\\]", "multiply"),
    (call("add", [1, 2]), "arguments must be a JSON object", "add"),
    (call("add", {"a": 1}), "missing required argument\\(s\\) \\['b'\\]", "add"),
    (call("add", {"a": "1", "b": 2}), "'a' must be number, got str", "add"),
    (call("add", {"a": True, "b": 2}), "'a' must be number, got bool", "add"),
    (call("search", {"query": "x", "limit": 2.5}), "'limit' must be integer or null", "search"),
    (call("search", {"query": "x", "page": 2}), "unexpected argument 'page'", "search"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', "<tool_call> without </tool_call>", None),
])
def test_bad_calls_become_tool_call_errors(text, why, name):
    [found] = parse_tool_calls(text, TOOLS)
    assert isinstance(found, ToolCallError) and found.name == name
    assert re.search(why, found.message), found.message


def test_extra_arguments_pass_when_the_schema_allows_them():
    assert parse_tool_calls(call("add", {"a": 1, "b": 2, "note": "x"}), TOOLS) == [
        ToolCall("add", {"a": 1, "b": 2, "note": "x"})]


def test_one_bad_call_does_not_spoil_the_others():
    text = call("add", {"a": 1, "b": 2}) + "<tool_call>{oops</tool_call>" + call("search", {"query": "q"})
    good, bad, other = parse_tool_calls(text, TOOLS)
    assert good == ToolCall("add", {"a": 1, "b": 2}) and other == ToolCall("search", {"query": "q"})
    assert bad.reply().role == "tool" and bad.reply().content.startswith("error: tool call is not valid JSON")


def test_replies_are_tool_messages_named_after_the_tool():
    assert ToolCall("add", {}).reply("3") == Message("tool", "3", name="add")
    assert ToolCallError("bad", "add").reply() == Message("tool", "error: bad", name="add")
