"""An episode as one token sequence with a loss mask, grown turn by turn.

The model's sampled ids are appended exactly as sampled (mask 1) and never re-tokenised:
decoding and encoding again can give other ids, and then the trained tokens would not be the
ones whose behaviour log-probs the engine recorded. Everything else (the prompt, tool results,
user turns, the template's glue between turns) is context (mask 0), tokenised as the text the
chat template adds to the conversation so far.

Finding that text: the template renders the conversation with and without the new messages and
the difference is taken, with a marker standing for the model's last message (`REPLY_MARK`): a
template may change the message's text (Llama 3's trims its whitespace) and the sampled ids are
kept whatever it does, so only the glue around the message is read from it. The part after the
message that closes its turn (ChatML: `<|im_end|>\\n`) is trimmed by the end-of-turn token the model
emitted itself; a model cut off before emitting it (a per-turn token cap) gets the whole closing
text, so its turn is closed. This needs a template that extends a conversation's text as a prefix
(ChatML, Llama 3, SmolLM2, Qwen2.5 do, BOS per turn or not); one that renders a model message
differently once later turns follow raises ConversationError, and so does one that cannot render
the messages at all (the episode loop ends that episode as an environment fault).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from colorl.envs.base import Message, ToolSpec
from colorl.envs.tools import render_chat


REPLY_MARK = "colorl-reply-5b1e"  # no space nor markup: a template that trims or escapes leaves it as it is


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
        ids = _encode(tokenizer, _render(tokenizer, messages, tools, add_generation_prompt=True))
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
        history = self.messages[:-1]
        marked = [*history, Message("assistant", REPLY_MARK)]
        opened = _render(self.tokenizer, history, self.tools, add_generation_prompt=True)
        closed = _render(self.tokenizer, marked, self.tools, add_generation_prompt=False)
        extended = _render(self.tokenizer, marked + list(messages), self.tools, add_generation_prompt=True)
        mark = closed.find(REPLY_MARK, len(opened))
        # before the message the template may put whitespace the generation prompt leaves out (Llama 2's
        # " "): the model wrote its own, as it did when the template trims the message's text
        if not (closed.startswith(opened) and mark >= 0 and not closed[len(opened):mark].strip()
                and extended.startswith(closed)):
            raise ConversationError("the chat template does not extend the conversation's text turn by turn "
                                    "(it rewrites earlier turns); multi-turn episodes need one that does")
        closing = closed[mark + len(REPLY_MARK):]
        if self.end_of_turn and closing.lstrip().startswith(self.end_of_turn):  # whitespace before it: trimmed text
            closing = closing.lstrip()[len(self.end_of_turn):]
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


def _render(tokenizer, messages: Sequence[Message], tools: Sequence[ToolSpec], add_generation_prompt: bool) -> str:
    """`render_chat`; a template that raises on these messages (e.g. roles that must alternate) is a
    ConversationError, one line."""
    try:
        return render_chat(tokenizer, messages, tools, add_generation_prompt)
    except Exception as exc:  # jinja's and the tokenizer's errors come in many types
        raise ConversationError(f"the chat template cannot render the conversation ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''})") from None


def _encode(tokenizer, text: str) -> list[int]:
    """Template text already holds its special tokens: add none (as apply_chat_template does)."""
    return list(tokenizer.encode(text, add_special_tokens=False))
