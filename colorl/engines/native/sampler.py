"""Batched sampling with behaviour log-probs taken from the exact distribution sampled from.

For a row with temperature T > 0, the distribution is built from the model's float32 logits z:
1. scale: z / T;
2. top-k (k > 0): keep the k largest scaled logits;
3. top-p (p < 1): of those, keep the smallest set of most likely tokens whose probability (under
   the softmax of the top-k survivors) reaches p; the token that crosses p is kept, so at least
   one token always survives;
4. renormalise over the survivors: pi = softmax(masked z / T).
The token is drawn from pi and its log-prob is log pi(token): the mask and the renormalisation
are part of the behaviour policy, exactly as a trainer's importance weight needs it. A token
outside the kept set has probability 0 and is never drawn.
T == 0 means greedy (argmax); its distribution is a point mass, so the reported log-prob is the
untempered one, log softmax(z)(token), which is what a trainer at temperature 1 compares against.

Randomness is counter-based: the draw for output token i of a request is a uniform number
derived from (seed, i) alone (`uniform`), turned into a token by inverse-CDF over pi (in vocabulary
order, or in descending-probability order when top-k/top-p is on). So the same seed gives the
same tokens whatever else is in the batch, after preemption, and after an interrupt/resume, where
a stateful per-request generator would replay or skip draws.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def uniform(seed: int, index: int) -> float:
    """A uniform number in (0, 1] from splitmix64(seed, index): stateless, device independent."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return ((z >> 11) + 1) / float(1 << 53)


@dataclass(frozen=True)
class SampleRow:
    temperature: float
    top_p: float
    top_k: int
    seed: int
    index: int  # output position of the token being drawn


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow], compiled=None) -> tuple[list[int], list[float]]:
        """logits: [N, V] float32, one row per sequence that samples this step. Returns tokens, log-probs.
        compiled: the native engine's compiled loops (cpu_decode.CpuDecode), which draw the rows without
        top-k/top-p on CPU in one call; None: torch's operators."""
        logits = logits.float()
        # Rows with top-k/top-p walk their CDF in sorted order, the others in vocabulary order;
        # each row's order depends only on its own params, never on its neighbours'.
        plain = [i for i, r in enumerate(rows) if r.temperature > 0 and r.top_k == 0 and r.top_p >= 1.0]
        if len(plain) == len(rows):  # a rollout's usual step: no row to pick out or put back
            if all(r.temperature == 1.0 for r in rows) and self._compiled_draws(logits, compiled):  # z as it is
                return compiled.sample_plain(logits, [uniform(r.seed, r.index) for r in rows])
            chosen, logp = self._sample(logits, rows, False, compiled)
            return chosen.tolist(), logp.tolist()
        greedy = [i for i, r in enumerate(rows) if r.temperature == 0]
        filtered = [i for i, r in enumerate(rows) if r.temperature > 0 and (r.top_k > 0 or r.top_p < 1.0)]
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        logps = torch.empty(len(rows), dtype=torch.float32, device=logits.device)
        if greedy:
            index = torch.tensor(greedy, device=logits.device)
            z = logits.index_select(0, index)  # [G, V]
            best = z.argmax(-1)
            tokens[index] = best
            logps[index] = torch.log_softmax(z, -1).gather(-1, best[:, None]).squeeze(-1)
        for group, use_filters in ((plain, False), (filtered, True)):
            if group:
                index = torch.tensor(group, device=logits.device)
                picked = logits.index_select(0, index)
                chosen, logp = self._sample(picked, [rows[i] for i in group], use_filters, compiled)
                tokens[index] = chosen
                logps[index] = logp
        return tokens.tolist(), logps.tolist()

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow], filtered: bool,
                compiled=None) -> tuple[torch.Tensor, torch.Tensor]:
        device = logits.device
        u = torch.tensor([uniform(r.seed, r.index) for r in rows], dtype=torch.float64, device=device)[:, None]
        temperatures = [r.temperature for r in rows]
        z = logits if all(t == 1.0 for t in temperatures) else logits / torch.tensor(temperatures, device=device)[:, None]
        if not filtered:
            if self._compiled_draws(z, compiled):
                tokens, logps = compiled.sample_plain(z, u.squeeze(-1).tolist())
                return torch.tensor(tokens), torch.tensor(logps)
            return self._inverse_cdf_two_level(z, u)
        z, order = z.sort(dim=-1, descending=True, stable=True)  # [N, V], ranks -> token ids
        z = self._mask_top_k_top_p(z, rows)
        logp = torch.log_softmax(z, dim=-1)  # [N, V]: log pi
        cdf = logp.double().exp().cumsum(-1)  # [N, V]
        pick = torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_(max=z.shape[-1] - 1)  # [N, 1]
        return order.gather(-1, pick).squeeze(-1), logp.gather(-1, pick).squeeze(-1)

    @staticmethod
    def _compiled_draws(z: torch.Tensor, compiled) -> bool:
        """The compiled loops draw plain rows from z here."""
        return compiled is not None and z.device.type == "cpu" and z.is_contiguous()

    @staticmethod
    def _inverse_cdf_two_level(z: torch.Tensor, u: torch.Tensor, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse CDF of softmax(z) in vocabulary order without a full-vocabulary cumsum:
        find the chunk of `chunk` tokens holding u, then the token inside it. z: [N, V], u: [N, 1]."""
        n, vocab = z.shape
        top = z.max(dim=-1, keepdim=True).values  # [N, 1]
        weights = (z - top).exp_()  # [N, V] unnormalised probabilities
        pad = -vocab % chunk
        if pad:
            weights = torch.nn.functional.pad(weights, (0, pad))
        blocks = weights.view(n, -1, chunk)  # [N, C, chunk]
        # Block sums in float32 (256 terms in [0, 1]: relative error ~1e-7), their running total
        # in float64; a float64 copy of all [N, V] weights costs more than the rest of the sampler.
        block_cdf = blocks.sum(-1).double().cumsum(-1)  # [N, C]
        target = u * block_cdf[:, -1:]  # [N, 1]
        block = torch.searchsorted(block_cdf, target).clamp_(max=block_cdf.shape[1] - 1)  # [N, 1]
        before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp_(min=0)), 0.0)
        inner = blocks.gather(1, block[:, :, None].expand(n, 1, chunk)).squeeze(1).double().cumsum(-1)  # [N, chunk]
        offset = torch.searchsorted(inner, target - before).clamp_(max=chunk - 1)  # [N, 1]
        token = (block * chunk + offset).clamp_(max=vocab - 1)  # [N, 1]
        logp = z.gather(-1, token) - top - block_cdf[:, -1:].log().float()  # log softmax(z)[token]
        return token.squeeze(-1), logp.squeeze(-1)

    @staticmethod
    def _mask_top_k_top_p(z_sorted: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Set to -inf the sorted logits outside each row's top-k, then outside its top-p nucleus."""
        vocab = z_sorted.shape[-1]
        device = z_sorted.device
        ranks = torch.arange(vocab, device=device)[None, :]  # [1, V]
        k = torch.tensor([r.top_k if r.top_k > 0 else vocab for r in rows], device=device)[:, None]
        z_sorted = z_sorted.masked_fill(ranks >= k, float("-inf"))
        p = torch.tensor([r.top_p for r in rows], device=device)[:, None]
        probs = torch.softmax(z_sorted, dim=-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each rank
        return z_sorted.masked_fill((before >= p) & (ranks > 0), float("-inf"))
