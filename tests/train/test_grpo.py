"""The GRPO objective against numbers worked out by hand."""
from __future__ import annotations

import math

import torch

from colorl.train.grpo import aggregate, group_advantages, grpo_token_loss


def test_group_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    adv = group_advantages(rewards)
    # mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert torch.allclose(adv[0], torch.tensor([expected, -expected, -expected, expected]))
    assert torch.equal(adv[1], torch.zeros(4))  # zero-variance group: no signal
    assert torch.equal(group_advantages(rewards, std_norm=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_loss_truncated_is_and_token_mean_by_hand():
    # two sequences, three token slots; the second has one padded slot
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, 0.0]], requires_grad=True)
    logp_mu = torch.tensor([[-1.0, -3.0, -0.4], [-1.0, -0.2, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([2.0, -1.0])
    per_token, stats = grpo_token_loss(logp, logp_mu, adv.unsqueeze(1), mask, clip_low=0.2, clip_high=0.28, tis_cap=2.0)
    # w = min(exp(logp - logp_mu), 2): row 0: [1, min(e, 2) = 2, e^-0.1]; row 1: [e^-0.5, 1, -]
    w = torch.tensor([[1.0, 2.0, math.exp(-0.1)], [math.exp(-0.5), 1.0, 0.0]])
    expected = -w * adv.unsqueeze(1) * mask
    assert torch.allclose(per_token, expected, atol=1e-6)
    loss = aggregate(per_token[mask.bool()], torch.tensor([0, 0, 0, 1, 1]), "token_mean", total_tokens=5.0, total_seqs=2.0)
    assert math.isclose(loss.item(), float(expected.sum() / 5), rel_tol=1e-6)
    loss.backward()
    # ratio = exp(logp - logp_prox) has value 1 and gradient 1 w.r.t. logp: d loss / d logp = -w·A / 5
    assert torch.allclose(logp.grad, expected / 5, atol=1e-6)
    assert stats.tokens == 5 and stats.truncated == 1  # e > 2 only once
    assert math.isclose(stats.is_weight_max, math.e, rel_tol=1e-6)
    assert stats.clipped == 0


def test_ppo_clip_with_a_stale_proximal_policy():
    logp = torch.log(torch.tensor([[0.6, 0.6]])).requires_grad_()
    logp_prox = torch.log(torch.tensor([[0.4, 0.4]]))  # ratio 1.5, outside [0.8, 1.28]
    mask = torch.ones(1, 2)
    for advantage, clipped_expected in ((1.0, True), (-1.0, False)):
        logp.grad = None
        per_token, stats = grpo_token_loss(logp, logp_prox, torch.tensor([[advantage]]), mask, 0.2, 0.28, 10.0,
                                           logp_prox=logp_prox)
        per_token.sum().backward()
        if clipped_expected:  # A > 0 and ratio > 1 + ε_high: clipped, no gradient
            assert torch.allclose(per_token, torch.full((1, 2), -1.28))
            assert torch.equal(logp.grad, torch.zeros(1, 2)) and stats.clipped == 2
        else:  # A < 0: the unclipped (pessimistic) term is kept and carries gradient ratio·|A|
            assert torch.allclose(per_token, torch.full((1, 2), 1.5))
            assert torch.allclose(logp.grad, torch.full((1, 2), 1.5)) and stats.clipped == 0


def test_sequence_mean_weights_each_sequence_equally():
    per_token = torch.tensor([1.0, 1.0, 1.0, 1.0, 4.0])  # the trained tokens of two sequences
    seq_ids = torch.tensor([0, 0, 0, 0, 1])
    assert float(aggregate(per_token, seq_ids, "seq_mean", 5.0, 2.0)) == (1.0 + 4.0) / 2
    assert math.isclose(float(aggregate(per_token, seq_ids, "token_mean", 5.0, 2.0)), 8.0 / 5, rel_tol=1e-6)


def test_kl_to_reference_k3_by_hand():
    from colorl.train.grpo import kl_to_reference

    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    logp_ref = torch.tensor([[-1.5, -2.0]])
    kl = kl_to_reference(logp, logp_ref)
    assert torch.allclose(kl, torch.tensor([[math.exp(-0.5) + 0.5 - 1, 0.0]]))
    kl.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[1 - math.exp(-0.5), 0.0]]))  # pulls θ toward ref
