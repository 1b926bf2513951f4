"""Log-probs of the sampled tokens straight from hidden states, the LM head only where the loss reads.

The loss needs logp_θ of each trained token (and the entropy for the log), so the vocabulary-wide
logits are computed only at the K positions that predict a trained token, `chunk` rows at a time:
the [K, V] logits and their softmax never exist whole. Backward recomputes each chunk's logits from
the saved hidden states (one extra [chunk, H] x [H, V] matmul) instead of keeping them alive.
"""
from __future__ import annotations

import torch

from colorl.kernels import training_linear
from colorl.train.packing import MicroBatch


class SampledTokenHead(torch.autograd.Function):
    """(hidden [K, H], weight [V, H], targets [K]) -> logp [K] (differentiable), entropy [K] (not)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int):
        k = hidden.shape[0]
        logp = hidden.new_empty(k, dtype=torch.float32)
        entropy = torch.empty_like(logp)
        log_norm = torch.empty_like(logp)
        for s in range(0, k, chunk):
            logits = training_linear(hidden[s:s + chunk], weight).float().div_(temperature)  # [c, V]
            lse = torch.logsumexp(logits, dim=-1)  # [c]
            logp[s:s + chunk] = logits.gather(1, targets[s:s + chunk, None]).squeeze(1) - lse
            entropy[s:s + chunk] = lse - torch.softmax(logits, dim=-1).mul_(logits).sum(-1)
            log_norm[s:s + chunk] = lse
        ctx.save_for_backward(hidden, weight, targets, log_norm)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, targets, log_norm = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = None  # float32, summed over chunks
        for s in range(0, hidden.shape[0], ctx.chunk):
            h, g = hidden[s:s + ctx.chunk], grad_logp[s:s + ctx.chunk]
            logits = training_linear(h, weight).float().div_(ctx.temperature)  # [c, V]
            # d logp / d logits = onehot(target) − softmax; then through the 1/temperature
            grad_logits = logits.sub_(log_norm[s:s + ctx.chunk, None]).exp_().mul_(-g[:, None])
            grad_logits.scatter_add_(1, targets[s:s + ctx.chunk, None], g[:, None])
            grad_logits = grad_logits.div_(ctx.temperature).to(hidden.dtype)
            if need_hidden:
                grad_hidden[s:s + ctx.chunk] = training_linear(grad_logits, weight.t())  # dlogits W
            if need_weight:
                part = training_linear(grad_logits.t().float(), h.float().t())  # dlogits^T h: [V, H]
                grad_weight = part if grad_weight is None else grad_weight.add_(part)
        if need_weight:
            if grad_weight is None:  # no trained token here
                grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def sampled_token_logprobs(model: torch.nn.Module, micro: MicroBatch, temperature: float,
                           chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logp_θ [K] of the micro-batch's trained tokens and the policy's entropy [K] at them.

    Bound to the policy (and reference) model as an FSDP forward method, so FSDP gathers the root's
    parameters (embeddings, final norm, LM head) around it as it does around `forward`.
    """
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        raise ValueError(f"the LM head must be a plain bias-free nn.Linear, got {type(head).__name__}")
    device = head.weight.device
    cu = micro.cu_seqlens.to(device)
    hidden = model.get_decoder()(
        input_ids=micro.input_ids.to(device), position_ids=micro.position_ids.to(device),
        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=micro.max_seqlen, max_length_k=micro.max_seqlen,
        **({"prompt_of": micro.prompt_of} if micro.prompt_of is not None else {}),
    ).last_hidden_state  # [1, T', H]
    picked = hidden[0].index_select(0, micro.predict_at.to(device))  # [K, H]
    return SampledTokenHead.apply(picked, head.weight, micro.targets.to(device), temperature, chunk)
