"""Attention confined to each packed sequence, registered with transformers' attention interface.

A packed row holds several sequences; `cu_seqlens` marks where each starts. On CUDA with
flash-attn installed, transformers' own `flash_attention_2` runs the varlen kernel from the same
`cu_seq_lens_*` / `max_length_*` keyword arguments (written against transformers 5's API; there is
no GPU here to run it). Everywhere else `colorl_varlen` runs one causal SDPA call per sequence: a
single masked SDPA over the whole row would spend T² work on the blocks between sequences.
Being unknown to transformers' mask interface, `colorl_varlen` also makes the model skip building
a [T, T] mask.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

VARLEN = "colorl_varlen"


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


AttentionInterface.register(VARLEN, varlen_sdpa)


def packed_attention(device: str) -> str:
    """The attention implementation the trainer's model runs packed rows with on `device`."""
    if device.startswith("cuda"):
        from transformers.utils import is_flash_attn_2_available

        if is_flash_attn_2_available():
            return "flash_attention_2"
    return VARLEN
