"""Sampler: the log-prob is that of the distribution actually sampled from; draws are per-seed."""
from __future__ import annotations

import math

import torch

from colorl.engines.native.sampler import SampleRow, Sampler, uniform

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()[None, :]  # [1, 4]


def row(seed=0, index=0, temperature=1.0, top_p=1.0, top_k=0) -> SampleRow:
    return SampleRow(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, index=index)


def draw_many(n=4000, **kw):
    sampler = Sampler()
    rows = [row(seed=s, **kw) for s in range(n)]
    return sampler(LOGITS.expand(n, -1), rows)


def test_uniform_is_deterministic_and_in_range():
    values = [uniform(s, i) for s in range(50) for i in range(50)]
    assert all(0 < v <= 1 for v in values)
    assert uniform(3, 4) == uniform(3, 4) and uniform(3, 4) != uniform(3, 5) and uniform(3, 4) != uniform(4, 4)
    assert abs(sum(values) / len(values) - 0.5) < 0.02


def test_greedy_reports_untempered_logprob():
    tokens, logps = Sampler()(LOGITS, [row(temperature=0.0)])
    assert tokens == [0] and math.isclose(logps[0], math.log(0.5), rel_tol=1e-5)


def test_plain_sampling_frequencies_and_logprobs():
    tokens, logps = draw_many()
    counts = torch.bincount(torch.tensor(tokens), minlength=4).float() / len(tokens)
    assert torch.allclose(counts, PROBS, atol=0.03)
    for t, lp in zip(tokens, logps):
        assert math.isclose(lp, math.log(PROBS[t].item()), rel_tol=1e-5)


def test_top_p_keeps_the_nucleus_and_renormalises():
    tokens, logps = draw_many(top_p=0.7)  # 0.5 < 0.7 -> keep 0 and 1 (0.8 mass)
    assert set(tokens) == {0, 1}
    for t, lp in zip(tokens, logps):
        assert math.isclose(lp, math.log(PROBS[t].item() / 0.8), rel_tol=1e-5)
    counts = torch.bincount(torch.tensor(tokens), minlength=4).float() / len(tokens)
    assert abs(counts[0].item() - 0.5 / 0.8) < 0.03


def test_top_k_and_temperature_enter_the_logprob():
    tokens, logps = draw_many(top_k=3, temperature=0.5)
    scaled = torch.softmax(LOGITS[0, :3] / 0.5, -1)
    assert set(tokens) <= {0, 1, 2}
    for t, lp in zip(tokens, logps):
        assert math.isclose(lp, math.log(scaled[t].item()), rel_tol=1e-4)
    tokens, logps = draw_many(n=50, top_k=1)
    assert set(tokens) == {0} and all(abs(lp) < 1e-6 for lp in logps)


def test_a_row_does_not_depend_on_its_neighbours():
    sampler = Sampler()
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    rows = [row(seed=7, index=i, top_p=0.9 if i % 2 else 1.0, top_k=5 * (i % 3)) for i in range(6)]
    together = sampler(logits, rows)
    alone = [sampler(logits[i:i + 1], [rows[i]]) for i in range(6)]
    assert together[0] == [a[0][0] for a in alone]
    assert all(math.isclose(x, a[1][0], rel_tol=1e-6) for x, a in zip(together[1], alone))


def test_two_level_inverse_cdf_matches_a_full_cdf():
    generator = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(200, 1000, generator=generator)  # vocab not a multiple of the chunk
    u = torch.rand(200, 1, generator=generator, dtype=torch.float64)
    tokens, logps = Sampler._inverse_cdf_two_level(logits, u)
    probs = torch.softmax(logits.double(), -1)
    cdf = probs.cumsum(-1)
    expected = torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(-1)
    assert (tokens == expected).float().mean() > 0.99  # ties only at float rounding of the boundary
    assert torch.allclose(logps.double(), probs.log().gather(-1, tokens[:, None]).squeeze(-1), atol=1e-5)
