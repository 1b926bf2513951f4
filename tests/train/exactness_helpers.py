"""Batches and comparisons for the packed-vs-padded exactness tests (imported by spawned ranks too)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from colorl.config import load_config
from colorl.train.packing import TrainBatch
from colorl.train.policy import PolicyTrainer, StepSums
from padded_reference import padded_accumulate

SUM_FIELDS = ("loss", "entropy", "kl_ref")
STAT_FIELDS = ("tokens", "is_weight_sum", "is_weight_max", "truncated", "clipped", "kl_mu_theta_sum")


def mixed_batch(seed: int, n: int = 7, vocab: int = 200, masked: tuple[int, ...] = (2,), group: int = 1) -> TrainBatch:
    """Prompts of 2-12 tokens, responses of 1-24, behaviour log-probs near the policy's; `masked`
    sequences (a zero-variance group) carry no trained token; each `group` sequences in a row share
    their prompt (a GRPO group, packed with the prompt once)."""
    g = torch.Generator().manual_seed(seed)
    sequences, prompt = [], []
    for i in range(n):
        p, o = int(torch.randint(2, 13, (1,), generator=g)), int(torch.randint(1, 25, (1,), generator=g))
        ids = torch.randint(3, vocab, (p + o,), generator=g).tolist()
        if i % group:  # the group's prompt, then this sample's response
            ids = prompt + ids[p:]
            p = len(prompt)
        prompt = ids[:p]
        keep = 0.0 if i in masked else 1.0
        behaviour = (-5.0 + torch.randn(o, generator=g)).tolist()
        sequences.append((ids, [0.0] * p + [keep] * o, [0.0] * p + behaviour))
    return TrainBatch.from_sequences(sequences, torch.randn(n, generator=g))


def trainer(model_dir: Path, *sets: str) -> PolicyTrainer:
    cfg = load_config("configs/tiny.yaml", ["train.max_tokens_per_micro_batch=40", "train.logits_chunk_tokens=7",
                                            "rollout.temperature=0.7", *sets], check_paths=False)
    return PolicyTrainer(model_dir, cfg, "cpu")


def _grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name] = g.detach().clone().float()
    return out


def _summary(sums: StepSums) -> dict[str, float]:
    return {**{f: getattr(sums, f) for f in SUM_FIELDS}, **{f: getattr(sums.stats, f) for f in STAT_FIELDS},
            "global_tokens": sums.tokens}


def packed_and_padded(t: PolicyTrainer, batch: TrainBatch, micro_batch: int = 3) -> dict:
    """Both paths on the same weights and batch: their sums and their (full) gradients."""
    t.optimizer.zero_grad(set_to_none=True)
    packed = t.accumulate_gradients(batch)
    packed_grads = _grads(t.model)
    t.optimizer.zero_grad(set_to_none=True)
    reference = padded_accumulate(t, batch, micro_batch)
    reference_grads = _grads(t.model)
    t.optimizer.zero_grad(set_to_none=True)
    return {"packed": _summary(packed), "padded": _summary(reference),
            "grad_error": {n: relative_error(packed_grads[n], g) for n, g in reference_grads.items()},
            "grads_missing": sorted(set(reference_grads) ^ set(packed_grads))}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


WORLD_CASES = {
    "fp32_kl": ("loss.kl_coef=0.1",),
    "lora": ("model.lora={r: 4, alpha: 8, targets: [q_proj, v_proj]}", "loss.kl_coef=0.1"),
    "bf16": ("train.mixed_precision=bfloat16",),
}


def world_cases(rank: int, world: int, model_dir: str, out: str) -> None:
    """Every rank: one optimizer step (the policy moves off the KL reference), then both paths on a
    new batch. Rank 1's batch is shorter, so its plan is topped up with placeholder micro-batches."""
    report = {}
    for name, sets in WORLD_CASES.items():
        torch.manual_seed(0)
        t = trainer(Path(model_dir), *sets, "train.lr=1e-3")
        before = _full_params(t.model)
        stats = t.train_step(rank_batch(rank, seed=0))
        after = _full_params(t.model)
        report[name] = packed_and_padded(t, rank_batch(rank, seed=1))
        report[name]["first_step"] = {"loss": stats.loss, "tokens": stats.tokens,
                                      "unchanged": sorted(n for n in before if torch.equal(before[n], after[n]))}
    Path(out, f"{rank}.json").write_text(json.dumps(report))


def rank_batch(rank: int, seed: int) -> TrainBatch:
    if rank == 0:  # groups of three samples, each group's prompt run once where they share a micro-batch
        return mixed_batch(seed=10 + seed, group=3)
    # as many sequences (the reference's micro-batches count sequences), fewer of them trained
    return mixed_batch(seed=20 + seed, masked=(0, 1, 3, 5))


def _full_params(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters() if p.requires_grad}
