"""One metrics line per step, all-reduced over ranks, with the keys DESIGN.md lists."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from colorl.rollout.types import Group


@dataclass
class StepTimes:
    start: float = field(default_factory=time.perf_counter)
    rollout: float = 0.0
    train: float = 0.0
    sync: float = 0.0
    cuda_peaks: dict[str, int] = field(default_factory=dict)  # phase -> peak bytes allocated (CUDA only)

    def phase_done(self, name: str) -> None:
        """On CUDA: note the phase's peak allocation and start the next phase's from zero."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.cuda_peaks[name] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()


def cuda_memory(times: StepTimes) -> dict:
    """Allocated, reserved and per-phase peak memory of the device in GiB (max over ranks); {} on CPU."""
    if not times.cuda_peaks:
        return {}
    names = sorted(times.cuda_peaks)
    values = _reduce([torch.cuda.memory_allocated(), torch.cuda.memory_reserved()]
                     + [times.cuda_peaks[n] for n in names], dist.ReduceOp.MAX)
    gib = [v / 2**30 for v in values]
    return {"cuda_allocated_gb": gib[0], "cuda_reserved_gb": gib[1],
            **{f"cuda_peak_{name}_gb": value for name, value in zip(names, gib[2:])}}


def _reduce(values: list[float], op) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def step_record(ctx, groups: list[Group], train, sync, times: StepTimes, trained_version: int) -> dict:
    lengths = [len(r.output_ids) for g in groups for r in g.results]
    rewards = [x for g in groups for x in g.rewards]
    staleness = [trained_version - g.first_version for g in groups]
    group_max = [max(len(r.output_ids) for r in g.results) for g in groups]
    reward_errors, reward_timeouts = ctx.reward_counters.take()
    sums = _reduce([
        sum(lengths), len(lengths), sum(rewards), sum(1 for x in rewards if x >= 1.0), sum(group_max), len(groups),
        sum(staleness), sum(1 for g in groups if g.has_signal), reward_errors, reward_timeouts,
    ], dist.ReduceOp.SUM)
    maxes = _reduce([max(lengths), max(staleness), times.rollout, times.train, time.perf_counter() - times.start],
                    dist.ReduceOp.MAX)
    (tok, n, reward_sum, correct, group_max_sum, n_groups, stale_sum, mixed, errors, timeouts) = sums
    len_max, stale_max, t_rollout, t_train, t_step = maxes
    len_mean = tok / max(n, 1)
    v_rollout = tok / t_rollout if t_rollout else 0.0
    v_train = tok / t_train if t_train else 0.0
    rho = v_rollout / v_train if v_train else 0.0
    m_tail = (group_max_sum / max(n_groups, 1)) / len_mean if len_mean else 0.0
    return {
        "step": ctx.state.step, "version": ctx.state.version, "loss": train.loss,
        "reward_mean": reward_sum / max(n, 1), "accuracy": correct / max(n, 1),
        "response_len_mean": len_mean, "response_len_max": int(len_max), "m_tail": m_tail,
        "staleness_mean": stale_sum / max(n_groups, 1), "staleness_max": int(stale_max),
        "staleness_pred": ctx.predicted_staleness(rho, m_tail),
        "rollout_tokens_per_s": v_rollout, "train_tokens_per_s": v_train, "rho": rho,
        "time_rollout_s": t_rollout, "time_train_s": t_train, "time_sync_s": sync.time_sync_s,
        "time_step_s": t_step, "is_weight_mean": train.is_weight_mean, "is_weight_max": train.is_weight_max,
        "is_truncated_frac": train.is_truncated_frac, "clip_frac": train.clip_frac,
        "kl_mu_theta": train.kl_mu_theta, "kl_ref": train.kl_ref, "entropy": train.entropy, "grad_norm": train.grad_norm,
        "optimizer_steps_skipped": ctx.trainer.skipped_steps,
        "groups_dropped": 0, "groups_mixed_frac": mixed / max(n_groups, 1),
        "reward_errors": int(errors), "reward_timeouts": int(timeouts),
        "sync_bytes": sync.bytes_moved, "sync_gb_per_s": sync.gb_per_s,
        **cuda_memory(times),
    }
