"""Declaring tools to the model and reading its calls: one format, Hermes / Qwen style.

A chat template with a tools section (its source mentions `tools`, as Qwen2.5's and Hermes'
do) is given the declarations itself, `apply_chat_template(..., tools=[schema, ...])`, and
renders role "tool" messages its own way. For a template without one (SmolLM2's ChatML),
colorl writes the same format into the conversation:

- The declarations end the system turn (a system turn is added when the episode has none)::

      # Tools

      You may call one or more functions to assist with the user query.

      You are provided with function signatures within <tools></tools> XML tags:
      <tools>
      {"type": "function", "function": {"name": "calculator", "description": "...", "parameters": {...}}}
      </tools>

      For each function call, return a json object with function name and arguments within
      <tool_call></tool_call> XML tags:
      <tool_call>
      {"name": <function-name>, "arguments": <args-json-object>}
      </tool_call>

- A call, anywhere in the model's message, one or more per message::

      <tool_call>
      {"name": "calculator", "arguments": {"expression": "12 * 7"}}
      </tool_call>

- A result is a role "tool" message. Without a template tools section it is rendered as a user
  turn, one per result::

      <tool_response>
      84
      </tool_response>

- A call that cannot run (malformed JSON, unknown tool, arguments that miss a required key, have
  the wrong JSON type or are not allowed by the schema, a `<tool_call>` never closed) parses to a
  `ToolCallError`; its `reply()` is the tool message `error: <why>` that tells the model.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

from colorl.envs.base import Message, ToolSpec

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "number": (int, float), "integer": (int,), "boolean": (bool,),
    "object": (dict,), "array": (list,), "null": (type(None),),
}
DECLARATION = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{schemas}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def reply(self, content: str) -> Message:
        """The tool message carrying this call's result back to the model."""
        return Message("tool", content, name=self.name)


@dataclass(frozen=True)
class ToolCallError:
    """A call that cannot run; reported to the model as the tool's message, never raised."""

    message: str
    name: str | None = None

    def reply(self) -> Message:
        return Message("tool", f"error: {self.message}", name=self.name)


def has_tool_call(text: str) -> bool:
    return CALL_OPEN in text


def parse_tool_calls(text: str, tools: Sequence[ToolSpec]) -> list[ToolCall | ToolCallError]:
    """Every call in a model message, in order; a bad one becomes a ToolCallError in its place."""
    found: list[ToolCall | ToolCallError] = [_parse_call(body, tools) for body in _CALL.findall(text)]
    if CALL_OPEN in _CALL.sub("", text):
        found.append(ToolCallError(f"{CALL_OPEN} without {CALL_CLOSE}"))
    return found


def _parse_call(body: str, tools: Sequence[ToolSpec]) -> ToolCall | ToolCallError:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCallError(f"tool call is not valid JSON ({exc.msg} at char {exc.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCallError('tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name, arguments = call["name"], call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    spec = next((tool for tool in tools if tool.name == name), None)
    if spec is None:
        return ToolCallError(f"unknown tool {name!r}; tools: {[tool.name for tool in tools]}", name)
    if not isinstance(arguments, dict):
        return ToolCallError("arguments must be a JSON object", name)
    problem = _schema_problem(arguments, spec.parameters)
    return ToolCallError(problem, name) if problem else ToolCall(name, arguments)


def _schema_problem(arguments: dict[str, Any], schema: dict[str, Any]) -> str | None:
    """The first way the arguments break the schema's required keys, property types or extra keys."""
    properties = schema.get("properties", {})
    missing = [key for key in schema.get("required", []) if key not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    for key, value in arguments.items():
        if key not in properties:
            if schema.get("additionalProperties") is False:
                return f"unexpected argument {key!r}; allowed: {sorted(properties)}"
            continue
        kinds = properties[key].get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds or []
        if kinds and not any(_is_json_type(value, kind) for kind in kinds):
            return f"argument {key!r} must be {' or '.join(kinds)}, got {type(value).__name__}"
    return None


def _is_json_type(value: Any, kind: str) -> bool:
    if isinstance(value, bool) and kind in ("number", "integer"):
        return False
    return isinstance(value, _JSON_TYPES.get(kind, (object,)))


def declare_tools(tools: Sequence[ToolSpec]) -> str:
    return DECLARATION.format(schemas="\n".join(json.dumps(tool.as_schema()) for tool in tools))


def template_has_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders `tools` itself (then colorl leaves it to it)."""
    template = tokenizer.chat_template
    templates = template.values() if isinstance(template, dict) else [template or ""]
    return any("tools" in text for text in templates)


def chat_messages(messages: Sequence[Message], tools: Sequence[ToolSpec], native: bool) -> list[dict[str, str]]:
    """The dicts given to the chat template; without a native tools section, colorl's format above."""
    if native:
        return [message.as_dict() for message in messages]
    dicts = [{"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"} if m.role == "tool"
             else m.as_dict() for m in messages]
    if tools:
        declaration = declare_tools(tools)
        if dicts and dicts[0]["role"] == "system":
            dicts[0] = {**dicts[0], "content": f"{dicts[0]['content']}\n\n{declaration}"}
        else:
            dicts.insert(0, {"role": "system", "content": declaration})
    return dicts


def render_chat(tokenizer, messages: Sequence[Message], tools: Sequence[ToolSpec], add_generation_prompt: bool) -> str:
    """The conversation's text through the tokenizer's chat template, tools declared one way or the other."""
    native = template_has_tools(tokenizer)
    extra = {"tools": [tool.as_schema() for tool in tools]} if native and tools else {}
    return tokenizer.apply_chat_template(chat_messages(messages, tools, native),
                                         add_generation_prompt=add_generation_prompt, tokenize=False, **extra)
