"""The training engine: an FSDP2-sharded policy with AdamW, packed micro-batches and grad accumulation."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from colorl import precision
from colorl.config import micro_batch_tokens
from colorl.heap import HeapKeeper
from colorl.kernels import TRAINING, use_onednn_linears
from colorl.models import load_model
from colorl.train.attention import packed_attention, shares_prompts
from colorl.train.fsdp import (
    add_forward_method,
    checkpoint_layers,
    gathered_for_the_step,
    gathers_once,
    make_mesh,
    shard_model,
)
from colorl.train.grpo import LossStats, aggregate, grpo_token_loss, kl_to_reference
from colorl.train.head import sampled_token_logprobs
from colorl.train.lean_layers import use_lean_layers
from colorl.train.packing import MicroBatch, TrainBatch, pack, plan_micro_batches, split_to_count


HEAP_SLACK_BYTES = 256 << 20  # heap growth past its size after one micro-batch, given back (colorl/heap.py)


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
        # a CPU rank's kept heap, bounded; where memory comes first, its largest blocks apart (colorl/heap.py)
        self.heap = (HeapKeeper(HEAP_SLACK_BYTES, large_blocks_apart=cfg.train.activation_checkpointing)
                     if torch.device(device).type == "cpu" else None)
        self.compute_dtype = precision.compute_dtype(cfg, device)
        self.attention = packed_attention(device, self.compute_dtype or dtype)  # what runs the packed rows
        # a group's samples run their prompt once where the attention takes shared prompts (packing.py)
        self.share_prompts = shares_prompts(self.attention)
        model = self._load(model_dir, dtype)
        if cfg.model.lora is not None:
            model = apply_lora(model, cfg.model.lora)
        model.to(device)
        model.config.use_cache = False
        if cfg.train.activation_checkpointing:
            checkpoint_layers(model)
        self.model = self._shard(model)
        self.gather_once = dist.is_initialized() and gathers_once(device, self.compute_dtype)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        # on a CPU torch's default AdamW is a Python loop over the parameters; the fused kernel took 96 against
        # 441 ms a step for SmolLM2-135M at two threads on an AMX Xeon (bench/optimizer.py), and the quickstart
        # learns the same over seeds (bench/README.md, "bf16 where the CPU has it"). CUDA keeps torch's default.
        self.optimizer = torch.optim.AdamW(trainable, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                                           betas=(0.9, 0.999), eps=1e-8,
                                           fused=True if torch.device(device).type == "cpu" else None)
        self.temperature = cfg.rollout.temperature
        self.skipped_steps = 0  # optimizer steps not taken because the gradient was not finite
        self.reference = self._build_reference(model_dir, dtype) if cfg.loss.kl_coef > 0 else None

    def _build_reference(self, model_dir: Path, dtype: torch.dtype):
        """The frozen initial policy for the KL term. With LoRA it is the same model, adapters off."""
        if self.cfg.model.lora is not None:
            return self.model
        reference = self._load(model_dir, dtype).to(self.device).eval()
        reference.requires_grad_(False)
        return self._shard(reference)

    def _load(self, model_dir: Path, dtype: torch.dtype):
        model = load_model(model_dir, dtype)
        model.set_attn_implementation(self.attention)
        use_onednn_linears(model, self.device, TRAINING)  # on CPU: the faster of oneDNN and MKL here (colorl/kernels.py)
        use_lean_layers(model)  # norms and MLPs that save a third less for backward
        return model

    def _shard(self, model):
        """FSDP2 when distributed; either way `model.sampled_token_logprobs` is the forward the trainer runs."""
        if dist.is_initialized():
            model = shard_model(model, make_mesh(self.device), compute_dtype=self.compute_dtype)
        add_forward_method(model, "sampled_token_logprobs", sampled_token_logprobs)
        return model

    def token_logprobs(self, model, micro: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """logp [K] of the micro-batch's trained tokens under `model`, and the entropy [K] there."""
        return model.sampled_token_logprobs(micro, self.temperature, self.cfg.train.logits_chunk_tokens)

    @torch.no_grad()
    def reference_logprobs(self, micro: MicroBatch) -> torch.Tensor:
        """logp_ref [K] under the initial policy."""
        if self.cfg.model.lora is not None:
            with self.model.disable_adapter():
                return self.token_logprobs(self.model, micro)[0]
        return self.token_logprobs(self.reference, micro)[0]

    # -- phases 4 and 6: training state on / off the device
    def onload(self) -> None:
        self._move_optimizer(self.device)

    def offload(self) -> None:
        if self.cfg.train.offload_optimizer:
            self._move_optimizer("cpu")
            if torch.device(self.device).type == "cuda":
                # the copies are non-blocking and a checkpoint may read them next: wait for this
                # stream's work up to here only (a device-wide synchronize would also wait for the
                # rollout thread's stream in bounded-lag mode)
                copied = torch.cuda.Event()
                copied.record()
                copied.synchronize()

    def _move_optimizer(self, device: str) -> None:
        # AdamW keeps `step` on the CPU on purpose: on CUDA its non-capturable path reads it with
        # .item(), a device sync per parameter per step
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.device.type != torch.device(device).type:
                    state[key] = value.to(device, non_blocking=True)

    # -- phase 5
    def train_step(self, batch: TrainBatch) -> TrainStats:
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        sums = self.accumulate_gradients(batch)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.model.parameters() if p.requires_grad], self.cfg.train.grad_clip)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        if torch.isfinite(grad_norm):  # every rank sees the same global norm, so all skip together
            self.optimizer.step()
        else:
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        if self.heap is not None:  # the phase is over: the rollout's engine memory is mapped apart
            self.heap.release()
        summed = _all_reduce([sums.loss, sums.stats.is_weight_sum, sums.stats.truncated, sums.stats.clipped,
                              sums.stats.kl_mu_theta_sum, sums.entropy, sums.kl_ref])
        (weight_max,) = _all_reduce([sums.stats.is_weight_max], op=dist.ReduceOp.MAX)
        loss_total, weight_sum, truncated, clipped, kl_sum, ent_sum, kl_ref_total = summed
        denom = max(sums.tokens, 1.0)
        return TrainStats(
            loss=loss_total, grad_norm=float(grad_norm), tokens=int(sums.tokens),
            seconds=time.perf_counter() - started, is_weight_mean=weight_sum / denom, is_weight_max=weight_max,
            is_truncated_frac=truncated / denom, clip_frac=clipped / denom, kl_mu_theta=kl_sum / denom,
            entropy=ent_sum / denom, kl_ref=kl_ref_total / denom,
        )

    def accumulate_gradients(self, batch: TrainBatch) -> "StepSums":
        """Backward of the global-mean loss over this rank's micro-batches; the gradients stay in .grad.

        Every rank runs the same number of micro-batches (the most any rank needs), padding its
        plan with placeholders that contribute nothing, because each forward gathers FSDP shards.
        """
        loss_cfg = self.cfg.loss
        trained = batch.trained_tokens()  # [N]; sequences with none (masked groups) are never run
        total_tokens, total_seqs = _all_reduce([float(trained.sum()), float((trained > 0).sum())])
        token_denom, seq_denom = max(total_tokens, 1.0), max(total_seqs, 1.0)  # all masked: loss 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        lengths = {i: int(n) for i, n in enumerate(batch.seq_lens.tolist()) if trained[i] > 0}
        prompts = batch.prompts() if self.share_prompts else None  # a group's samples run their prompt once
        plan = plan_micro_batches(lengths, micro_batch_tokens(self.cfg.train, self.device), prompts)
        (count,) = _all_reduce([float(len(plan))], op=dist.ReduceOp.MAX)
        sums = StepSums(tokens=total_tokens)
        # one gather of the blocks serves every micro-batch (fsdp.gathered_for_the_step)
        with gathered_for_the_step(self.model, self.gather_once):
            for indices in split_to_count(plan, lengths, int(count)):
                micro = pack(batch, indices, prompts=prompts)
                logp, entropy = self.token_logprobs(self.model, micro)  # [K]
                per_token, part_stats = grpo_token_loss(
                    logp, micro.behaviour_logp.to(self.device), micro.advantages.to(self.device), torch.ones_like(logp),
                    loss_cfg.clip_low, loss_cfg.clip_high, loss_cfg.tis_cap,
                )
                kl = kl_to_reference(logp, self.reference_logprobs(micro)) if self.reference is not None else None
                if kl is not None:
                    per_token = per_token + loss_cfg.kl_coef * kl
                loss = aggregate(per_token, micro.seq_ids.to(self.device), loss_cfg.aggregation, token_denom, seq_denom)
                if micro.dummy:
                    (loss * 0.0).backward()  # same collectives as the other ranks, no gradient
                    continue
                (loss * world).backward()  # FSDP averages gradients over ranks; undo it for a global mean
                sums.add(float(loss.detach()), part_stats, float(entropy.sum()),
                         float(kl.detach().sum()) if kl is not None else 0.0)
                del logp, entropy, per_token, loss, kl
                if self.heap is not None:  # this micro-batch's activations are free here
                    self.heap.settle()
        return sums


@dataclass
class StepSums:
    """This rank's sums over its micro-batches; `tokens` is already the global count."""

    tokens: float
    loss: float = 0.0
    stats: LossStats = field(default_factory=LossStats)
    entropy: float = 0.0
    kl_ref: float = 0.0

    def add(self, loss: float, stats: LossStats, entropy: float, kl_ref: float) -> None:
        self.loss += loss
        self.stats = _add(self.stats, stats)
        self.entropy += entropy
        self.kl_ref += kl_ref


def _add(a: LossStats, b: LossStats) -> LossStats:
    return LossStats(
        tokens=a.tokens + b.tokens, is_weight_sum=a.is_weight_sum + b.is_weight_sum,
        is_weight_max=max(a.is_weight_max, b.is_weight_max), truncated=a.truncated + b.truncated,
        clipped=a.clipped + b.clipped, kl_mu_theta_sum=a.kl_mu_theta_sum + b.kl_mu_theta_sum,
    )
