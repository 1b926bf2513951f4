"""Chat templates of the model families whose multi-turn episodes colorl must extend turn by turn, on
colorl's byte-level test tokenizer (so the tiny model can serve them: see `template_tokenizer`)."""
from __future__ import annotations

# Llama 3's and SmolLM2's are the shipped templates verbatim; Llama 2's style is reduced to what
# matters here (a BOS before every user turn, each message stripped, " " before the model's message
# that the generation prompt leaves out).
TEMPLATES = {
    "chatml": None,  # colorl.models.CHAT_TEMPLATE
    "chatml-trim": ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}"
                    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "llama3": ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
               "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
               "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
               "{{ content }}{% endfor %}{% if add_generation_prompt %}"
               "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
    "smollm2": ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
                "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "llama2-bos-per-turn": ("{% for message in messages %}{% if message['role'] == 'assistant' %}"
                            "{{ ' ' + message['content'] | trim + ' </s>' }}{% else %}"
                            "{{ '<s>[INST] ' + message['content'] | trim + ' [/INST]' }}{% endif %}{% endfor %}"),
}
# ChatML that refuses a user turn after the opening two messages, as templates whose roles must alternate do
ALTERNATING = ("{% for m in messages %}{% if m['role'] == 'user' and loop.index0 > 1 %}"
               "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
               "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# the special tokens those templates use, beyond colorl's test tokenizer's own
EXTRA_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>"]
END_OF_TURN = {"chatml": "<|im_end|>", "chatml-trim": "<|im_end|>", "llama3": "<|eot_id|>", "smollm2": "<|im_end|>",
               "llama2-bos-per-turn": "</s>"}


def template_tokenizer(name: str):
    """colorl's byte-level test tokenizer with the extra special tokens and template `name`; its
    eos is that template's end of turn (what a model of that family ends its message with)."""
    from colorl.models import SPECIAL_TOKENS, build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [*SPECIAL_TOKENS, *EXTRA_SPECIAL]})
    tokenizer.eos_token = END_OF_TURN[name]
    if name == "llama3":
        tokenizer.bos_token = "<|begin_of_text|>"
    if TEMPLATES[name] is not None:
        tokenizer.chat_template = TEMPLATES[name]
    return tokenizer


def save_template_model(out, name: str):
    """A tiny Llama (head size 32, which vLLM's CPU attention takes) saved with template `name`'s tokenizer:
    a `model.path` for whole runs. It ends its messages with the template's end of turn."""
    import torch
    from transformers import AutoModelForCausalLM

    from colorl.models import tiny_config

    tokenizer = template_tokenizer(name)
    config = tiny_config(len(tokenizer), head_dim=32)
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = tokenizer.bos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
