"""The GRPO objective colorl optimises.

Departures from the GRPO paper (Shao et al. 2024), each on purpose:
1. Decoupled PPO objective: the behaviour policy μ (the engine that sampled) is separate from the
   proximal policy; the importance weight w = min(exp(logp_prox − logp_μ), C) is truncated at C
   (`loss.tis_cap`) and carries no gradient (truncated IS, for engine mismatch and staleness).
2. One optimizer step per batch, so logp_prox = logp_θ detached and the clipped ratio starts at 1;
   clipping only bites if a later change takes several steps per batch. clip_frac is still reported.
3. Token-mean over the whole global batch (default) instead of the per-sequence mean, which
   under-weights long answers; `seq_mean` restores the paper's aggregation.
4. No KL penalty by default (`loss.kl_coef` = 0); when on, the k3 estimator per token
   exp(r) − r − 1 with r = logp_ref − logp_θ (unbiased, non-negative), added to the per-token loss.
5. Asymmetric clip range [1 − ε_low, 1 + ε_high] (DAPO's clip-higher).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, std_norm: bool = True, eps: float = 1e-6,
                     scored: torch.Tensor | None = None) -> torch.Tensor:
    """rewards [G, S] -> advantages [G, S]: (r − mean_group) / (std_group + eps).

    scored [G, S] bool: the samples in the group's statistics (mean and unbiased spread over them
    alone); the others, and a group with fewer than two, get advantage 0. None: every sample."""
    if scored is None:
        centered = rewards - rewards.mean(dim=1, keepdim=True)
        if not std_norm:
            return centered
        return centered / (rewards.std(dim=1, keepdim=True, unbiased=True) + eps)
    advantages = torch.zeros_like(rewards)
    for row, kept in zip(range(rewards.shape[0]), scored):
        if int(kept.sum()) >= 2:
            advantages[row, kept] = group_advantages(rewards[row, kept][None], std_norm, eps)[0]
    return advantages


@dataclass
class LossStats:
    """Sums over tokens (or sequences) so that micro-batches and ranks add up exactly."""

    tokens: float = 0.0
    is_weight_sum: float = 0.0
    is_weight_max: float = 0.0
    truncated: float = 0.0
    clipped: float = 0.0
    kl_mu_theta_sum: float = 0.0


def grpo_token_loss(
    logp: torch.Tensor,  # [...] logp_θ of the sampled tokens (with grad), e.g. [K] trained tokens
    logp_mu: torch.Tensor,  # [...] behaviour log-probs from the engine
    advantages: torch.Tensor,  # broadcastable to logp: each token's sequence advantage
    mask: torch.Tensor,  # [...] 1 on tokens in the loss
    clip_low: float,
    clip_high: float,
    tis_cap: float,
    logp_prox: torch.Tensor | None = None,  # [...]; None: one step per batch, so logp_θ detached
) -> tuple[torch.Tensor, LossStats]:
    """Per-token loss (zero off the mask, same shape as logp) and its stats; aggregation is the caller's."""
    logp_prox = logp.detach() if logp_prox is None else logp_prox
    weight = torch.exp(logp_prox - logp_mu).clamp(max=tis_cap)  # stop-gradient
    ratio = torch.exp(logp - logp_prox)  # value 1, gradient of logp
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    per_token = -weight * torch.minimum(unclipped, clipped) * mask
    with torch.no_grad():
        raw_weight = torch.exp(logp_prox - logp_mu)
        m = mask.bool()
        stats = LossStats(
            tokens=float(mask.sum()),
            is_weight_sum=float(weight[m].sum()),
            is_weight_max=float(raw_weight[m].max()) if m.any() else 0.0,
            truncated=float((raw_weight[m] > tis_cap).sum()),
            clipped=float((clipped < unclipped)[m].sum()),  # the clip is active: no gradient there
            kl_mu_theta_sum=float((logp_mu - logp_prox)[m].sum()),
        )
    return per_token, stats


def kl_to_reference(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(θ‖ref) per token, with gradient through logp_θ."""
    log_ratio = logp_ref - logp
    return torch.exp(log_ratio) - log_ratio - 1


def aggregate(per_token: torch.Tensor, seq_ids: torch.Tensor, mode: str, total_tokens: float,
              total_seqs: float) -> torch.Tensor:
    """Sum this micro-batch's share of the global mean (token-mean or sequence-mean).

    per_token [K] over the micro-batch's trained tokens, seq_ids [K] the sequence of each.
    """
    if mode == "token_mean":
        return per_token.sum() / total_tokens
    n = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
    per_seq = per_token.new_zeros(n).index_add(0, seq_ids, per_token)  # [n]
    return (per_seq / torch.bincount(seq_ids, minlength=n).clamp(min=1)).sum() / total_seqs
