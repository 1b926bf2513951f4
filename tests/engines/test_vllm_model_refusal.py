"""Engine/model pairs vLLM cannot serve are refused before launch, in one line that names what vLLM
takes and the model that works (no vLLM needed: the check reads the model's config only; the
`--dry-run` through the CLI is in test_vllm_runs.py, where vLLM is installed)."""
from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig

from colorl.engines import engine_class
from colorl.models import ALIASES, TINY_HD32_ALIAS, ModelNotFound, resolve_model_path, save_tiny_model

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    return {size: AutoConfig.from_pretrained(save_tiny_model(root / f"hd{size}", head_dim=size)) for size in (16, 32)}


def test_vllm_on_cpu_refuses_head_dim_16_naming_what_it_takes_and_the_model_that_works(configs):
    refusal = engine_class("vllm").model_refusal(configs[16], "cpu")
    assert refusal is not None and "\n" not in refusal
    assert "head_dim 16" in refusal and "32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512" in refusal
    assert f"model.path={TINY_HD32_ALIAS}" in refusal


def test_vllm_serves_head_dim_32_on_cpu_and_cuda_takes_16(configs):
    vllm = engine_class("vllm")
    assert vllm.model_refusal(configs[32], "cpu") is None
    assert vllm.model_refusal(configs[16], "cuda") is None  # FlashAttention: multiples of 8 up to 256
    assert engine_class("native").model_refusal(configs[16], "cpu") is None


def test_every_shipped_alias_is_named_in_the_model_path_error_and_in_docs_config():
    with pytest.raises(ModelNotFound) as caught:
        resolve_model_path("no-such-model")
    documented = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert all(repr(alias) in str(caught.value) and f"`{alias}`" in documented for alias in ALIASES)


def test_building_an_alias_leaves_the_callers_random_state(tmp_path):
    """A rank seeds, then builds the alias it runs on if no other run has: the build must not reseed
    the rank (it did: the vLLM lane's first run then drew other LoRA weights than its resumed twin)."""
    import torch

    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    save_tiny_model(tmp_path / "alias", head_dim=32)
    assert torch.equal(torch.rand(4), expected)
