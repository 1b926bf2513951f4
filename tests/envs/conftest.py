"""Tokenizers for the episode tests: colorl's byte-level test tokenizer (ChatML, no tools section),
and the same behind a tools section of its own, as Qwen2.5's and Hermes' templates have.

colorl.models (and transformers) are imported in the fixtures, not here: `pytest tests/envs` loads
this file before the root conftest has set the test environment (offline hub, no progress bars)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def chatml_tokenizer():
    from colorl.models import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def tools_tokenizer():
    from colorl.models import CHAT_TEMPLATE, build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = ("{% if tools %}<|im_start|>system\n[native tools]{% for tool in tools %} "
                               "{{ tool.function.name }}{% endfor %}<|im_end|>\n{% endif %}" + CHAT_TEMPLATE)
    return tokenizer
