"""Multi-turn episodes with tools (no torch): environments, the tool-call format, token bookkeeping.

- `base`: `Environment` (reset / step), `Message`, `EnvStep`, `ToolSpec`, the registry and `resolve_env`.
- `tools`: declaring tools to the model and parsing its `<tool_call>` blocks (format in its docstring).
- `conversation`: an episode as token ids with a loss mask, grown turn by turn.
- `guard`: `EnvRunner`, environment steps on a thread pool with faults contained.
- `calculator`: the shipped example environment, registered as "calculator".
"""
from __future__ import annotations

from colorl.envs import calculator  # noqa: F401  (registration)
from colorl.envs.base import (ENVS, Environment, EnvError, EnvStep, InvalidStep, Message, ToolSpec,
                              check_env_options, register, resolve_env)
from colorl.envs.conversation import Conversation, ConversationError, check_template
from colorl.envs.guard import FAULT_KINDS, EnvRunner, GuardedStep, PendingStep
from colorl.envs.tools import ToolCall, ToolCallError, has_tool_call, parse_tool_calls, render_chat

__all__ = ["ENVS", "Environment", "EnvError", "EnvStep", "InvalidStep", "Message", "ToolSpec", "check_env_options",
           "register", "resolve_env", "Conversation", "ConversationError", "check_template", "FAULT_KINDS",
           "EnvRunner", "GuardedStep", "PendingStep", "ToolCall", "ToolCallError", "has_tool_call", "parse_tool_calls", "render_chat"]
