"""The training engine: an FSDP2-sharded policy with AdamW, micro-batches and grad accumulation."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from colorl.train.fsdp import make_mesh, shard_model
from colorl.train.grpo import LossStats, aggregate, grpo_token_loss, kl_to_reference
from colorl.models import load_model


@dataclass
class TrainBatch:
    """One rank's share of a step's rollouts, right-padded to a common length."""

    input_ids: torch.Tensor  # [N, L] prompt + response
    attention_mask: torch.Tensor  # [N, L]
    response_mask: torch.Tensor  # [N, L] 1 where the token was generated
    behaviour_logp: torch.Tensor  # [N, L] engine log-prob of each generated token (0 elsewhere)
    advantages: torch.Tensor  # [N]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, stop: int) -> "TrainBatch":
        return TrainBatch(*(t[start:stop] for t in (self.input_ids, self.attention_mask, self.response_mask,
                                                    self.behaviour_logp, self.advantages)))


@dataclass
class TrainStats:
    loss: float
    grad_norm: float
    tokens: int
    seconds: float
    is_weight_mean: float
    is_weight_max: float
    is_truncated_frac: float
    clip_frac: float
    kl_mu_theta: float
    entropy: float
    kl_ref: float  # mean per-token KL(θ‖ref) estimate (k3); 0 when loss.kl_coef is 0


def _all_reduce(values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
    if not dist.is_initialized():
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def apply_lora(model, lora_cfg):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                        target_modules=list(lora_cfg.targets))
    return get_peft_model(model, config)


class PolicyTrainer:
    def __init__(self, model_dir: Path, cfg, device: str, dtype: torch.dtype = torch.float32) -> None:
        self.cfg = cfg
        self.device = device
        model = load_model(model_dir, dtype)
        if cfg.model.lora is not None:
            model = apply_lora(model, cfg.model.lora)
        model.to(device)
        model.config.use_cache = False
        self.compute_dtype = getattr(torch, cfg.train.mixed_precision) if cfg.train.mixed_precision else None
        self.model = self._shard(model)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                                           betas=(0.9, 0.999), eps=1e-8)
        self.temperature = cfg.rollout.temperature
        self.skipped_steps = 0  # optimizer steps not taken because the gradient was not finite
        self.reference = self._build_reference(model_dir, dtype) if cfg.loss.kl_coef > 0 else None

    def _build_reference(self, model_dir: Path, dtype: torch.dtype):
        """The frozen initial policy for the KL term. With LoRA it is the same model, adapters off."""
        if self.cfg.model.lora is not None:
            return self.model
        reference = load_model(model_dir, dtype).to(self.device).eval()
        reference.requires_grad_(False)
        return self._shard(reference)

    def _shard(self, model):
        if not dist.is_initialized():
            return model
        return shard_model(model, make_mesh(self.device), compute_dtype=self.compute_dtype)

    @torch.no_grad()
    def reference_logprobs(self, batch: "TrainBatch") -> torch.Tensor:
        """logp_ref [N, L] under the initial policy."""
        if self.cfg.model.lora is not None:
            with self.model.disable_adapter():
                return self._logprobs(self.model, batch)[0]
        return self._logprobs(self.reference, batch)[0]

    # -- phases 4 and 6: training state on / off the device
    def onload(self) -> None:
        self._move_optimizer(self.device)

    def offload(self) -> None:
        if self.cfg.train.offload_optimizer:
            self._move_optimizer("cpu")
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the copies are non-blocking; a checkpoint may read them next

    def _move_optimizer(self, device: str) -> None:
        # AdamW keeps `step` on the CPU on purpose: on CUDA its non-capturable path reads it with
        # .item(), a device sync per parameter per step
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.device.type != torch.device(device).type:
                    state[key] = value.to(device, non_blocking=True)

    # -- log-probs
    def token_logprobs(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """logp_θ [N, L] of each token given its prefix (position 0 gets 0) and entropy [N, L]."""
        return self._logprobs(self.model, batch)

    def _logprobs(self, model, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        ids = batch.input_ids.to(self.device)
        logits = model(input_ids=ids, attention_mask=batch.attention_mask.to(self.device)).logits
        logits = logits[:, :-1].float() / self.temperature  # [N, L-1, V]; same temperature as sampling
        log_norm = torch.logsumexp(logits, dim=-1)  # [N, L-1]
        picked = logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) - log_norm  # [N, L-1]
        with torch.no_grad():
            probs = torch.softmax(logits, dim=-1)
            entropy = log_norm - (probs * logits).sum(-1)  # [N, L-1]
        pad = torch.zeros_like(picked[:, :1])
        return torch.cat([pad, picked], 1), torch.cat([pad, entropy], 1)

    # -- phase 5
    def train_step(self, batch: TrainBatch) -> TrainStats:
        started = time.perf_counter()
        loss_cfg = self.cfg.loss
        mask = batch.response_mask.float()
        kept_rows = float(mask.any(dim=1).sum())  # zero-variance groups masked out do not count
        total_tokens, total_seqs = _all_reduce([float(mask.sum()), kept_rows])
        token_denom, seq_denom = max(total_tokens, 1.0), max(total_seqs, 1.0)  # all masked: loss 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        stats, entropy_sum, loss_sum, kl_ref_sum = LossStats(), 0.0, 0.0, 0.0
        self.optimizer.zero_grad(set_to_none=True)
        micro = self.cfg.train.micro_batch
        for start in range(0, len(batch), micro):
            part = batch.slice(start, start + micro)
            part_mask = part.response_mask.float().to(self.device)
            logp, entropy = self.token_logprobs(part)
            per_token, part_stats = grpo_token_loss(
                logp, part.behaviour_logp.to(self.device), part.advantages.to(self.device), part_mask,
                loss_cfg.clip_low, loss_cfg.clip_high, loss_cfg.tis_cap,
            )
            if self.reference is not None:
                kl = kl_to_reference(logp, self.reference_logprobs(part)) * part_mask  # [n, L]
                per_token = per_token + loss_cfg.kl_coef * kl
                kl_ref_sum += float(kl.detach().sum())
            loss = aggregate(per_token, part_mask, loss_cfg.aggregation, token_denom, seq_denom)
            (loss * world).backward()  # FSDP averages gradients over ranks; undo it for a global mean
            loss_sum += float(loss.detach())
            entropy_sum += float((entropy * part_mask).sum())
            stats = _add(stats, part_stats)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.model.parameters() if p.requires_grad], self.cfg.train.grad_clip)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        if torch.isfinite(grad_norm):  # every rank sees the same global norm, so all skip together
            self.optimizer.step()
        else:
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        summed = _all_reduce([loss_sum, stats.is_weight_sum, stats.truncated, stats.clipped,
                              stats.kl_mu_theta_sum, entropy_sum, kl_ref_sum])
        (weight_max,) = _all_reduce([stats.is_weight_max], op=dist.ReduceOp.MAX)
        loss_total, weight_sum, truncated, clipped, kl_sum, ent_sum, kl_ref_total = summed
        denom = token_denom
        return TrainStats(
            loss=loss_total, grad_norm=float(grad_norm), tokens=int(total_tokens),
            seconds=time.perf_counter() - started, is_weight_mean=weight_sum / denom, is_weight_max=weight_max,
            is_truncated_frac=truncated / denom, clip_frac=clipped / denom, kl_mu_theta=kl_sum / denom,
            entropy=ent_sum / denom, kl_ref=kl_ref_total / denom,
        )


def _add(a: LossStats, b: LossStats) -> LossStats:
    return LossStats(
        tokens=a.tokens + b.tokens, is_weight_sum=a.is_weight_sum + b.is_weight_sum,
        is_weight_max=max(a.is_weight_max, b.is_weight_max), truncated=a.truncated + b.truncated,
        clipped=a.clipped + b.clipped, kl_mu_theta_sum=a.kl_mu_theta_sum + b.kl_mu_theta_sum,
    )
