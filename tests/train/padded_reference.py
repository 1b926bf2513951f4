"""The padded training path colorl ran before packing (commit 8c04575), kept only as the reference
the packed path is checked against: every sequence right-padded to the longest, full-vocabulary
logits at every position, micro-batches of a fixed number of sequences.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from colorl.train.grpo import LossStats, grpo_token_loss, kl_to_reference
from colorl.train.packing import TrainBatch
from colorl.train.policy import StepSums, _all_reduce


def padded(batch: TrainBatch, pad_id: int = 0) -> tuple[torch.Tensor, ...]:
    """input_ids, attention_mask, response_mask, behaviour_logp, each [N, L]."""
    offsets, n = batch.offsets(), len(batch)
    width = int(batch.seq_lens.max())
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    response = torch.zeros((n, width))
    behaviour = torch.zeros((n, width))
    for i in range(n):
        s, e = offsets[i], offsets[i + 1]
        ids[i, : e - s], attention[i, : e - s] = batch.input_ids[s:e], 1
        response[i, : e - s], behaviour[i, : e - s] = batch.response_mask[s:e], batch.behaviour_logp[s:e]
    return ids, attention, response, behaviour


@contextlib.contextmanager
def sdpa(*models):
    """Padded rows need the attention mask the packed path's attention does without."""
    before = [m.config._attn_implementation for m in models]
    for m in models:
        m.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        for m, name in zip(models, before):
            m.set_attn_implementation(name)


def padded_logprobs(model, ids, attention, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logp_θ [N, L] of each token given its prefix (position 0 gets 0) and entropy [N, L]."""
    logits = model(input_ids=ids, attention_mask=attention).logits
    logits = logits[:, :-1].float() / temperature  # [N, L-1, V]
    log_norm = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) - log_norm
    with torch.no_grad():
        entropy = log_norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    pad = torch.zeros_like(picked[:, :1])
    return torch.cat([pad, picked], 1), torch.cat([pad, entropy], 1)


def padded_aggregate(per_token, mask, mode: str, total_tokens: float, total_seqs: float) -> torch.Tensor:
    if mode == "token_mean":
        return per_token.sum() / total_tokens
    return (per_token.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / total_seqs


def padded_accumulate(trainer, batch: TrainBatch, micro_batch: int) -> StepSums:
    """The old train_step up to the optimizer: the same sums, gradients left in .grad."""
    cfg, temperature = trainer.cfg.loss, trainer.temperature
    ids, attention, response, behaviour = padded(batch)
    mask = response.clone()
    mask[:, 0] = 0  # as the packed path: a sequence's first token is never trained
    total_tokens, total_seqs = _all_reduce([float(mask.sum()), float(mask.any(dim=1).sum())])
    token_denom, seq_denom = max(total_tokens, 1.0), max(total_seqs, 1.0)
    world = dist.get_world_size() if dist.is_initialized() else 1
    sums = StepSums(tokens=total_tokens)
    models = [trainer.model] + ([trainer.reference] if trainer.reference not in (None, trainer.model) else [])
    with sdpa(*models):
        for start in range(0, len(batch), micro_batch):
            part = slice(start, start + micro_batch)
            part_mask = mask[part]
            logp, entropy = padded_logprobs(trainer.model, ids[part], attention[part], temperature)
            per_token, stats = grpo_token_loss(logp, behaviour[part], batch.advantages[part].unsqueeze(1), part_mask,
                                               cfg.clip_low, cfg.clip_high, cfg.tis_cap)
            kl_sum = 0.0
            if trainer.reference is not None:
                with torch.no_grad():
                    if trainer.cfg.model.lora is not None:
                        with trainer.model.disable_adapter():
                            ref = padded_logprobs(trainer.model, ids[part], attention[part], temperature)[0]
                    else:
                        ref = padded_logprobs(trainer.reference, ids[part], attention[part], temperature)[0]
                kl = kl_to_reference(logp, ref) * part_mask
                per_token = per_token + cfg.kl_coef * kl
                kl_sum = float(kl.detach().sum())
            loss = padded_aggregate(per_token, part_mask, cfg.aggregation, token_denom, seq_denom)
            (loss * world).backward()
            sums.add(float(loss.detach()), stats if stats.tokens else LossStats(),
                     float((entropy * part_mask).sum()), kl_sum)
    return sums
