"""A problem's opening conversation: one user turn, or the turns of a conversational dataset row.

Datasets in TRL's and Hugging Face's conversational form hold the prompt as a list of
`{"role": ..., "content": ...}` turns (a `messages` column, or `prompt` as such a list) instead
of a string. Such a row keeps its turns on the `Problem`; the model's chat template renders them
with the generation prompt after them, so the model answers the last user turn. The reference
answer stays in the task's answer field, and `Problem.prompt` (what a reward function gets as
`prompt`, what samples.jsonl shows) is the last user turn's text.
"""
from __future__ import annotations

from typing import Any

from colorl.tasks.base import ChatTurn, Problem

ROLES = ("system", "user", "assistant")


class ConversationFormatError(ValueError):
    """A row's turns are not a conversation the model can answer; one line saying what is wrong."""


def turns_of(value: Any, field: str) -> tuple[ChatTurn, ...]:
    """The turns of a conversational field, checked: a non-empty list of {role, content} with text
    content, roles the chat templates know, ending with the user's turn (the one the model answers)."""
    if not isinstance(value, list) or not value:
        raise ConversationFormatError(f"{field!r} must be a non-empty list of {{\"role\", \"content\"}} turns")
    turns = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict) or "role" not in turn:  # other keys (a dataset's empty columns) are ignored
            raise ConversationFormatError(f"{field}[{i}]: expected {{\"role\": ..., \"content\": ...}}, got {turn!r}"[:200])
        if turn["role"] not in ROLES:
            raise ConversationFormatError(f"{field}[{i}]: role {turn['role']!r}; expected one of {ROLES}")
        if not isinstance(turn.get("content"), str):
            raise ConversationFormatError(f"{field}[{i}]: content must be text, got {turn.get('content')!r}"[:200])
        turns.append(ChatTurn(turn["role"], turn["content"]))
    if turns[-1].role != "user" or not turns[-1].content.strip():
        raise ConversationFormatError(f"{field}: the last turn must be the user's, with text (the model answers it); "
                                      f"put the reference answer in the answer field")
    return tuple(turns)


def conversational_problem(value: Any, field: str, answer: str) -> Problem:
    """A problem whose opening is the row's turns; its prompt text is the last user turn."""
    turns = turns_of(value, field)
    return Problem(prompt=turns[-1].content, answer=answer, turns=turns)


def chat_messages(problem: Problem, system_prompt: str | None = None) -> list[dict[str, str]]:
    """What the chat template renders for a problem: its turns, or its prompt as the one user turn;
    `model.system_prompt` first unless the row brings its own system turn."""
    turns = problem.turns or (ChatTurn("user", problem.prompt),)
    messages = [{"role": t.role, "content": t.content} for t in turns]
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def problem_ids(tokenizer, problem: Problem, system_prompt: str | None = None) -> list[int]:
    """Prompt ids of a problem through the model's chat template, ending with the generation prompt."""
    from colorl.models import encode_messages

    return encode_messages(tokenizer, chat_messages(problem, system_prompt))
