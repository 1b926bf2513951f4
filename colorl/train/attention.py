"""Attention confined to each packed sequence, registered with transformers' attention interface.

A packed row holds several sequences; `cu_seqlens` marks where each starts. What runs it, by what
the installed stack provides (`packed_attention`; the run's start line in events.log names it):

- CUDA with flash-attn 2 installed: transformers' own `flash_attention_2`, the varlen kernel from
  the same `cu_seq_lens_*` / `max_length_*` keyword arguments;
- CUDA in fp16/bf16 otherwise (the SGLang environment, whose only FlashAttention is version 4,
  which transformers does not count as 2): `colorl_varlen_flash`, torch's own FlashAttention
  varlen kernel (`torch.nn.attention.varlen.varlen_attn`), one call per packed row, no host sync;
- everywhere else (CPU, float32): `colorl_varlen`, one causal SDPA call per sequence: a single
  masked SDPA over the whole row would spend T² work on the blocks between sequences.

Being unknown to transformers' mask interface, the colorl ones also make the model skip building
a [T, T] mask. None of the CUDA kernels has run here (no GPU); their layout is checked on CPU
against the per-sequence path (tests/train/test_attention.py).
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

VARLEN = "colorl_varlen"
VARLEN_FLASH = "colorl_varlen_flash"
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def varlen_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                cu_seq_lens_q: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, H, T, d], key/value [1, H_kv, T, d] -> [1, T, H, d], causal within each sequence."""
    if cu_seq_lens_q is None:
        raise ValueError(f"{VARLEN} attention needs cu_seq_lens_q (a packed micro-batch)")
    gqa = query.shape[1] != key.shape[1]
    bounds = cu_seq_lens_q.tolist()
    parts = [
        F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p=dropout,
                                       scale=scaling, is_causal=True, enable_gqa=gqa)
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def varlen_flash(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                 **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, H, T, d], key/value [1, H_kv, T, d] -> [1, T, H, d] through torch's varlen kernel,
    which takes [T, H, d] and int32 sequence bounds; window (-1, 0) is causal."""
    from torch.nn.attention.varlen import varlen_attn

    if cu_seq_lens_q is None or max_length_q is None:
        raise ValueError(f"{VARLEN_FLASH} attention needs cu_seq_lens_q and max_length_q (a packed micro-batch)")
    if dropout:
        raise ValueError(f"{VARLEN_FLASH} attention has no dropout (got {dropout})")
    bounds = cu_seq_lens_q.to(torch.int32)
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [T, H, d]
    out = varlen_attn(q, k, v, bounds, bounds, max_length_q, max_length_q, scale=scaling, window_size=(-1, 0),
                      enable_gqa=query.shape[1] != key.shape[1])
    return out[None], None


AttentionInterface.register(VARLEN, varlen_sdpa)
AttentionInterface.register(VARLEN_FLASH, varlen_flash)


def packed_attention(device: str, dtype: torch.dtype) -> str:
    """The attention implementation the trainer's model runs packed rows with on `device`, computing
    in `dtype` (the mixed-precision dtype, else the model's)."""
    if device.startswith("cuda"):
        from transformers.utils import is_flash_attn_2_available

        if is_flash_attn_2_available():
            return "flash_attention_2"
        if dtype in FLASH_DTYPES and importlib.util.find_spec("torch.nn.attention.varlen") is not None:
            return VARLEN_FLASH
    return VARLEN
