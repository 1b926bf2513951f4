"""Issue 30 defect 6: which attention the trainer runs packed rows with, and torch's varlen kernel's
layout, checked on CPU against the per-sequence path (the kernel itself needs CUDA)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers.utils
from torch.nn.attention import varlen

from colorl.train.attention import VARLEN, VARLEN_FLASH, packed_attention, shares_prompts, varlen_flash, varlen_sdpa


def test_the_attention_follows_what_the_installed_stack_provides(monkeypatch):
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)  # the SGLang environment
    assert packed_attention("cuda:3", torch.bfloat16) == VARLEN_FLASH
    assert packed_attention("cuda:0", torch.float16) == VARLEN_FLASH
    assert packed_attention("cuda:0", torch.float32) == VARLEN  # FlashAttention takes 16-bit only
    assert packed_attention("cpu", torch.bfloat16) == VARLEN
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    assert packed_attention("cuda:0", torch.bfloat16) == "flash_attention_2"
    assert packed_attention("cpu", torch.bfloat16) == VARLEN


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                          enable_gqa=False, **kwargs):
    """torch's varlen_attn as documented: [T, H, d] inputs, int32 bounds, window (-1, 0) causal."""
    assert query.dim() == 3 and query.is_contiguous() and key.is_contiguous() and value.is_contiguous()
    assert cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k
    assert window_size == (-1, 0)
    bounds = cu_seq_q.tolist()
    assert max(e - s for s, e in zip(bounds[:-1], bounds[1:])) == max_q
    parts = [F.scaled_dot_product_attention(query[s:e].transpose(0, 1), key[s:e].transpose(0, 1),
                                            value[s:e].transpose(0, 1), scale=scale, is_causal=True,
                                            enable_gqa=enable_gqa).transpose(0, 1)
             for s, e in zip(bounds[:-1], bounds[1:])]
    return torch.cat(parts)


def test_torchs_varlen_kernel_gets_the_packed_row_in_its_layout(monkeypatch):
    monkeypatch.setattr(varlen, "varlen_attn", reference_varlen_attn)
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9, 3]
    total, heads, kv_heads, dim = sum(lengths), 4, 2, 8
    query = torch.randn(1, heads, total, dim, generator=gen)
    key, value = (torch.randn(1, kv_heads, total, dim, generator=gen) for _ in range(2))
    cu = torch.tensor([0, 5, 6, 15, 18])  # int64, as the packer makes it
    expected, _ = varlen_sdpa(None, query, key, value, None, scaling=0.3, cu_seq_lens_q=cu)
    got, _ = varlen_flash(None, query, key, value, None, scaling=0.3, cu_seq_lens_q=cu, max_length_q=max(lengths))
    assert got.shape == (1, total, heads, dim)
    torch.testing.assert_close(got, expected)


def test_only_the_sdpa_path_runs_shared_prompts():
    """CUDA's varlen kernels take whole sequences: the trainer does not share prompts there, and the kernel's
    wrapper refuses a row that does rather than attend a sample without its prompt."""
    assert shares_prompts(VARLEN) and not shares_prompts(VARLEN_FLASH) and not shares_prompts("flash_attention_2")
    q = torch.randn(1, 4, 9, 8, dtype=torch.bfloat16)
    kv = torch.randn(1, 2, 9, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="whole sequences"):
        varlen_flash(torch.nn.Module(), q, kv, kv, None, cu_seq_lens_q=torch.tensor([0, 3, 9]), max_length_q=6,
                     prompt_of=[-1, 0])


def test_bf16_attention_on_a_cpu_computes_in_float32_and_rounds_once():
    """torch's CPU flash-attention backward is several times slower in bf16 than in float32 (bench/README.md):
    on a CPU the packed attention takes bf16 in and out, computes in float32, and its gradients come back bf16."""
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 6, 15])
    query = torch.randn(1, 4, 15, 8, generator=gen).to(torch.bfloat16).requires_grad_()
    key, value = (torch.randn(1, 2, 15, 8, generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(2))
    got, _ = varlen_sdpa(None, query, key, value, None, scaling=0.3, cu_seq_lens_q=cu, prompt_of=[-1, -1, 1])
    wide = [t.detach().float() for t in (query, key, value)]
    expected, _ = varlen_sdpa(None, *wide, None, scaling=0.3, cu_seq_lens_q=cu, prompt_of=[-1, -1, 1])
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected.to(torch.bfloat16))
    got.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (query, key, value))
