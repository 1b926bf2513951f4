"""Attention confined to each packed sequence, registered with transformers' attention interface.

A packed row holds several sequences; `cu_seqlens` marks where each starts. What runs it, by what
the installed stack provides (`packed_attention`; the run's start line in events.log names it):

- CUDA with flash-attn 2 installed: transformers' own `flash_attention_2`, the varlen kernel from
  the same `cu_seq_lens_*` / `max_length_*` keyword arguments;
- CUDA in fp16/bf16 otherwise (the SGLang environment, whose only FlashAttention is version 4,
  which transformers does not count as 2): `colorl_varlen_flash`, torch's own FlashAttention
  varlen kernel (`torch.nn.attention.varlen.varlen_attn`), one call per packed row, no host sync;
- everywhere else (CPU, float32; on a CPU bf16 inputs compute in float32): `colorl_varlen`, one
  causal SDPA call per sequence: a single
  masked SDPA over the whole row would spend T² work on the blocks between sequences. It also runs
  rows whose samples share their prompt (colorl/train/packing.py, `prompt_of`): the prompt causally,
  then all its samples in one SDPA call over the prompt and themselves, each sample causal to itself.
  The varlen kernels on CUDA take only whole sequences: there prompts are not shared
  (`shares_prompts`).

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
                cu_seq_lens_q: torch.Tensor | None = None, prompt_of: list[int] | None = None,
                **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, H, T, d], key/value [1, H_kv, T, d] -> [1, T, H, d], causal within each sequence; with
    `prompt_of` (a segment's shared prompt, -1 for none), the segments continuing a prompt follow it in
    the row and see all of it."""
    if cu_seq_lens_q is None:
        raise ValueError(f"{VARLEN} attention needs cu_seq_lens_q (a packed micro-batch)")
    if query.device.type == "cpu" and query.dtype in FLASH_DTYPES:
        # On a CPU, in float32: torch's CPU flash-attention backward in bf16 took 6.5x its float32 time on an
        # AMX Xeon (15 % of the bf16 train phase, bench/README.md), and the engine's decode attention, whose
        # log-probs the loss compares with, computes in float32 too. The output is rounded back once.
        out, _ = varlen_sdpa(module, query.float(), key.float(), value.float(), attention_mask, dropout, scaling,
                             cu_seq_lens_q, prompt_of, **kwargs)
        return out.to(query.dtype), None
    gqa = query.shape[1] != key.shape[1]
    bounds = cu_seq_lens_q.tolist()

    def attend(s: int, e: int, q_start: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        return F.scaled_dot_product_attention(query[:, :, q_start:e], key[:, :, s:e], value[:, :, s:e],
                                              attn_mask=mask, dropout_p=dropout, scale=scaling,
                                              is_causal=mask is None, enable_gqa=gqa)

    parts, segment = [], 0
    prompt_of = prompt_of or [-1] * (len(bounds) - 1)
    while segment < len(bounds) - 1:
        s, e = bounds[segment], bounds[segment + 1]
        parts.append(attend(s, e, s))  # a sequence, or a shared prompt
        children = segment + 1
        while children < len(prompt_of) and prompt_of[children] == segment:
            children += 1
        if children > segment + 1:  # its samples, one call: [prompt | each sample causal to itself]
            spans = torch.tensor(bounds[segment + 1:children + 1], device=query.device)
            sample = torch.repeat_interleave(torch.arange(len(spans) - 1, device=query.device), spans.diff())
            rows = torch.arange(e, bounds[children], device=query.device)
            own = (sample[:, None] == sample[None, :]) & (rows[:, None] >= rows[None, :])
            mask = torch.cat([torch.ones(len(rows), e - s, dtype=torch.bool, device=query.device), own], dim=1)
            parts.append(attend(s, bounds[children], e, mask))
        segment = children
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
    if kwargs.get("prompt_of") is not None:
        raise ValueError(f"{VARLEN_FLASH} attention takes whole sequences, not shared prompts (shares_prompts)")
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


def shares_prompts(attention: str) -> bool:
    """Whether rows for `attention` (packed_attention's answer) may share a prompt among its samples."""
    return attention == VARLEN
