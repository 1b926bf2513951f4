"""An episode as token ids and a loss mask: the model's ids kept as sampled (mask 1), everything else
the chat template's text (mask 0), equal to the template's rendering of the whole conversation."""
from __future__ import annotations

import pytest

from chat_templates import ALTERNATING, TEMPLATES, template_tokenizer  # tests/helpers
from colorl.envs import Conversation, ConversationError, Message, ToolSpec
from colorl.envs.tools import render_chat
from colorl.models import CHAT_TEMPLATE, build_tokenizer

CALC = ToolSpec("calculator", "Evaluate arithmetic.", {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]})
OPENING = [Message("system", "Use tools."), Message("user", "What is 12 * 7?")]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>'


def sampled(tokenizer, text: str, end_turn: bool = True) -> list[int]:
    """What an engine would hand back: the reply's ids, with the end-of-turn token when the model stopped."""
    return tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if end_turn else [])


def episode(tokenizer, first_turn: list[int], tools=(CALC,)) -> tuple[Conversation, list[list[int]]]:
    """Opening, a tool call, its result, a final answer: the conversation and the model's turns.

    Before the final answer the ids are exactly the template's rendering, generation prompt included.
    """
    conv = Conversation.start(tokenizer, OPENING, tools)
    final = sampled(tokenizer, "It is 84.")
    conv.add_model_turn(first_turn)
    conv.add_env_messages([Message("tool", "84", name="calculator")])
    assert conv.token_ids == whole(tokenizer, conv, add_generation_prompt=True)
    conv.add_model_turn(final)
    return conv, [first_turn, final]


def whole(tokenizer, conv: Conversation, add_generation_prompt: bool, upto: int | None = None) -> list[int]:
    """The template's rendering of the conversation's messages (the first `upto` of them), tokenised."""
    text = render_chat(tokenizer, conv.messages[:upto], conv.tools, add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def expected_mask(tokenizer, conv: Conversation, turns: list[list[int]]) -> list[int]:
    """Built from renderings alone: context up to each generation prompt is 0, each model turn is 1."""
    mask, assistant_turns = [], 0
    for end, message in enumerate(conv.messages):
        if message.role == "assistant":
            prompt = whole(tokenizer, conv, add_generation_prompt=True, upto=end)
            mask += [0] * (len(prompt) - len(mask)) + [1] * len(turns[assistant_turns])
            assistant_turns += 1
    return mask


@pytest.mark.parametrize("end_turn", [True, False], ids=["stopped", "cut-off"])
def test_token_ids_are_the_whole_conversation_and_the_mask_marks_only_the_models_ids(chatml_tokenizer, end_turn):
    tokenizer = chatml_tokenizer
    conv, turns = episode(tokenizer, sampled(tokenizer, CALL, end_turn))
    rendered = whole(tokenizer, conv, add_generation_prompt=False)
    assert rendered[:len(conv.token_ids)] == conv.token_ids  # the episode ends at the model's last token,
    assert tokenizer.decode(rendered[len(conv.token_ids):]) == "\n"  # before the template's glue
    assert conv.loss_mask == expected_mask(tokenizer, conv, turns)
    assert [t for t, m in zip(conv.token_ids, conv.loss_mask) if m] == turns[0] + turns[1]
    context = tokenizer.decode([t for t, m in zip(conv.token_ids, conv.loss_mask) if not m])
    assert "<tool_response>\n84\n</tool_response>" in context and "What is 12 * 7?" in context


def test_a_cut_off_turn_is_closed_by_context_not_by_the_model(chatml_tokenizer):
    tokenizer = chatml_tokenizer
    first = sampled(tokenizer, CALL, end_turn=False)
    conv = Conversation.start(tokenizer, OPENING, (CALC,))
    start = len(conv.token_ids)
    assert conv.add_model_turn(first) == CALL
    conv.add_env_messages([Message("tool", "84")])
    after = start + len(first)
    assert conv.token_ids[after] == tokenizer.eos_token_id and conv.loss_mask[after] == 0
    assert tokenizer.decode(conv.token_ids[after:]) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_a_stopped_turn_keeps_its_own_end_token_and_the_text_leaves_it_out(chatml_tokenizer):
    tokenizer = chatml_tokenizer
    conv = Conversation.start(tokenizer, OPENING, (CALC,))
    start = len(conv.token_ids)
    first = sampled(tokenizer, CALL)
    assert conv.add_model_turn(first) == CALL and conv.end_of_turn == "<|im_end|>"
    conv.add_env_messages([Message("user", "Now say it in words.")])
    assert conv.loss_mask[start + len(first) - 1] == 1  # the model's <|im_end|>
    assert tokenizer.decode(conv.token_ids[start + len(first):]) == (
        "\n<|im_start|>user\nNow say it in words.<|im_end|>\n<|im_start|>assistant\n")


def test_the_models_ids_are_never_retokenised(chatml_tokenizer):
    """Spelled out byte by byte, "<|im_end|>" re-encodes to the special token: the sampled ids must stay."""
    tokenizer = chatml_tokenizer
    spelled = [tokenizer.convert_tokens_to_ids(c) for c in "ok<|im_end|>"] + [tokenizer.eos_token_id]
    assert tokenizer.encode(tokenizer.decode(spelled), add_special_tokens=False) != spelled
    conv = Conversation.start(tokenizer, OPENING)
    start = len(conv.token_ids)
    conv.add_model_turn(spelled)
    conv.add_env_messages([Message("user", "again")])
    assert conv.token_ids[start:start + len(spelled)] == spelled
    assert conv.loss_mask[start:start + len(spelled)] == [1] * len(spelled)
    assert sum(conv.loss_mask) == len(spelled)


def test_a_template_with_a_tools_section_renders_tool_messages_itself(tools_tokenizer):
    tokenizer = tools_tokenizer
    conv, turns = episode(tokenizer, sampled(tokenizer, CALL))
    assert conv.loss_mask == expected_mask(tokenizer, conv, turns)
    assert "<|im_start|>tool\n84<|im_end|>" in tokenizer.decode(conv.token_ids)


def test_turns_out_of_order_are_refused(chatml_tokenizer):
    with pytest.raises(ConversationError, match="at least one message"):
        Conversation.start(chatml_tokenizer, [])
    conv = Conversation.start(chatml_tokenizer, OPENING)
    with pytest.raises(ConversationError, match="must follow a model turn"):
        conv.add_env_messages([Message("user", "x")])
    conv.add_model_turn(sampled(chatml_tokenizer, "hi"))
    with pytest.raises(ConversationError, match="two model turns"):
        conv.add_model_turn(sampled(chatml_tokenizer, "again"))


REWRITING = CHAT_TEMPLATE.replace("{{ message['content'] }}", "{% if message['role'] == 'assistant' and not loop.last %}"
                                  "[earlier]{% else %}{{ message['content'] }}{% endif %}")


@pytest.mark.parametrize("template, error", [(REWRITING, "rewrites earlier turns"),
                                             (ALTERNATING, "cannot render the conversation.*roles must alternate")],
                         ids=["rewrites-earlier-turns", "roles-must-alternate"])
def test_a_template_that_cannot_extend_the_conversation_is_refused(template, error):
    """E.g. one that hides past assistant turns (the text no longer grows as a prefix), or one that
    cannot render the environment's message at all."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = template
    conv = Conversation.start(tokenizer, OPENING)
    conv.add_model_turn(sampled(tokenizer, "thinking... 84"))
    with pytest.raises(ConversationError, match=error):
        conv.add_env_messages([Message("user", "sure?")])


@pytest.mark.slow
@pytest.mark.parametrize("end_turn", [True, False], ids=["stopped", "cut-off"])
def test_smollm2_tokenizer_episode(smollm2_dir, end_turn):
    """The real BPE tokenizer and template (ChatML with a default system turn, no tools section)."""
    from colorl.models import load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    conv, turns = episode(tokenizer, sampled(tokenizer, CALL, end_turn))
    assert conv.loss_mask == expected_mask(tokenizer, conv, turns)
    assert [t for t, m in zip(conv.token_ids, conv.loss_mask) if m] == turns[0] + turns[1]
    assert "<tool_response>\n84\n</tool_response>" in tokenizer.decode(conv.token_ids)


def _context_after_first_turn(tokenizer, reply: str, end_turn: bool) -> tuple[Conversation, list[int], str]:
    conv = Conversation.start(tokenizer, OPENING)
    start = len(conv.token_ids)
    turn = sampled(tokenizer, reply, end_turn)
    conv.add_model_turn(turn)
    conv.add_env_messages([Message("tool", "84", name="calculator")])
    return conv, turn, tokenizer.decode(conv.token_ids[start + len(turn):])


@pytest.mark.parametrize("end_turn", [True, False], ids=["stopped", "cut-off"])
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_templates_that_trim_or_add_a_bos_per_turn_extend_a_reply_with_spaces(name, end_turn):
    """Llama 3's template trims a message's text: a reply " The answer is 4. " no longer renders as sampled.
    The sampled ids stay, and the glue after them is the same as after a reply without spaces."""
    tokenizer = template_tokenizer(name)
    conv, turn, glue = _context_after_first_turn(tokenizer, " The answer is 4. ", end_turn)
    _, _, plain_glue = _context_after_first_turn(tokenizer, "ok", end_turn)
    assert glue == plain_glue and "<tool_response>\n84\n</tool_response>" in glue
    assert [t for t, m in zip(conv.token_ids, conv.loss_mask) if m] == turn
    opening = whole(tokenizer, conv, add_generation_prompt=True, upto=2)
    assert conv.token_ids[:len(opening)] == opening and not any(conv.loss_mask[:len(opening)])
    if name == "llama3":
        close = "" if end_turn else "<|eot_id|>"
        assert glue == (f"{close}<|start_header_id|>user<|end_header_id|>\n\n<tool_response>\n84\n</tool_response>"
                        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")

