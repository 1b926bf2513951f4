"""An episode as one token sequence with a loss mask, grown turn by turn.

The model's sampled ids are appended exactly as sampled (mask 1) and never re-tokenised:
decoding and encoding again can give other ids, and then the trained tokens would not be the
ones whose behaviour log-probs the engine recorded. Everything else (the prompt, tool results,
user turns, the template's glue between turns) is context (mask 0), tokenised as the text the
chat template adds to the conversation so far.

Finding that text: the template renders the whole conversation with and without the new
messages and the difference is taken. The part after the model's message that closes its turn
(ChatML: `<|im_end|>\\n`) is trimmed by the end-of-turn token the model emitted itself; a model
cut off before emitting it (a per-turn token cap) gets the whole closing text, so its turn is
closed. This needs a template that extends a conversation's text as a prefix (ChatML, Llama 3,
Qwen2.5 do); one that rewrites earlier turns (e.g. drops past reasoning) raises ConversationError.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from colorl.envs.base import Message, ToolSpec
from colorl.envs.tools import render_chat


class ConversationError(ValueError):
    """Turns added out of order, or a chat template that cannot be extended turn by turn."""


@dataclass
class Conversation:
    tokenizer: Any = field(repr=False)
    tools: tuple[ToolSpec, ...]
    messages: list[Message]  # the model's turns as decoded text, for the template only
    token_ids: list[int]
    loss_mask: list[int]  # 1 = sampled by the model, 0 = context
    end_of_turn: str = ""  # the special token that ended the last model turn, as text ("" if cut off)

    @classmethod
    def start(cls, tokenizer, messages: Sequence[Message], tools: Sequence[ToolSpec] = ()) -> Conversation:
        """The first prompt, generation prompt included, all context."""
        if not messages:
            raise ConversationError("a conversation starts with at least one message")
        ids = _encode(tokenizer, render_chat(tokenizer, messages, tools, add_generation_prompt=True))
        return cls(tokenizer, tuple(tools), list(messages), ids, [0] * len(ids))

    def add_model_turn(self, ids: Sequence[int]) -> str:
        """Append the sampled ids as they are; returns the message's text (end-of-turn token left out)."""
        if self.messages[-1].role == "assistant":
            raise ConversationError("two model turns in a row: add the environment's messages in between")
        ids = list(ids)
        self.token_ids += ids
        self.loss_mask += [1] * len(ids)
        ended = bool(ids) and ids[-1] in self.tokenizer.all_special_ids
        self.end_of_turn = self.tokenizer.decode(ids[-1:]) if ended else ""
        text = self.tokenizer.decode(ids[:-1] if ended else ids)
        self.messages.append(Message("assistant", text))
        return text

    def add_env_messages(self, messages: Sequence[Message]) -> None:
        """Append the template's rendering of the new messages and the next generation prompt, as context."""
        if self.messages[-1].role != "assistant":
            raise ConversationError("environment messages must follow a model turn")
        *history, reply = self.messages
        opened = render_chat(self.tokenizer, history, self.tools, add_generation_prompt=True)
        closed = render_chat(self.tokenizer, self.messages, self.tools, add_generation_prompt=False)
        extended = render_chat(self.tokenizer, self.messages + list(messages), self.tools, add_generation_prompt=True)
        if not (closed.startswith(opened + reply.content) and extended.startswith(closed)):
            raise ConversationError("the chat template does not extend the conversation's text turn by turn "
                                    "(it rewrites earlier turns); multi-turn episodes need one that does")
        closing = closed[len(opened) + len(reply.content):]
        if self.end_of_turn and closing.startswith(self.end_of_turn):
            closing = closing[len(self.end_of_turn):]
        ids = _encode(self.tokenizer, closing + extended[len(closed):])
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.messages += messages


def check_template(tokenizer, tools: Sequence[ToolSpec] = ()) -> None:
    """Before a run: one model turn and one tool result through the template (ConversationError if it
    rewrites earlier turns), so a template unfit for episodes stops the launch, not every episode."""
    conversation = Conversation.start(tokenizer, [Message("system", "s"), Message("user", "u")], tools)
    end = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    conversation.add_model_turn(_encode(tokenizer, "ok") + end)
    conversation.add_env_messages([Message("tool", "1", name=tools[0].name if tools else None)])


def _encode(tokenizer, text: str) -> list[int]:
    """Template text already holds its special tokens: add none (as apply_chat_template does)."""
    return list(tokenizer.encode(text, add_special_tokens=False))
