"""One metrics line per step, all-reduced over ranks, with the keys DESIGN.md lists.

Both modes write the same keys. Colocated mode has no rollout window (the rollout is a phase of
the step): its queue, wait and idle figures are 0 and its pre-queue / in-queue staleness are 0.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from colorl.envs.base import TRUNCATED_BY_TOKENS, TRUNCATED_BY_TURNS
from colorl.rollout.types import Group, RolloutWindow
from colorl.staleness.live import predicted_split_for


@dataclass
class StepTimes:
    start: float = field(default_factory=time.perf_counter)
    rollout: float = 0.0
    train: float = 0.0
    sync: float = 0.0
    trainer_wait: float = 0.0
    env_wait: float = 0.0  # colocated: rollout time the engine had nothing to decode (episodes on their environments)
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


def _gather(values: list[int]) -> list[int]:
    if not dist.is_initialized():
        return list(values)
    parts: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, list(values))
    return sorted(v for part in parts for v in part)


def staleness_histogram(staleness: list[int]) -> dict[str, int]:
    """Groups per staleness value, all ranks (keys are strings: JSON object keys)."""
    width = int(_reduce([max(staleness, default=0) + 1], dist.ReduceOp.MAX)[0])
    counts = _reduce([float(sum(1 for s in staleness if s == k)) for k in range(width)], dist.ReduceOp.SUM)
    return {str(k): int(n) for k, n in enumerate(counts) if n}


def step_record(ctx, groups: list[Group], train, sync, times: StepTimes, trained_version: int,
                window: RolloutWindow | None = None) -> dict:
    window = window or RolloutWindow()
    lengths = [n for g in groups for n in g.lengths]
    rewards = [x for g in groups for x in g.rewards]
    versioned = [g for g in groups if g.first_version is not None]  # a group whose model sampled nothing has no age
    staleness = [trained_version - g.first_version for g in versioned]
    done = [trained_version if g.done_version is None else g.done_version for g in versioned]
    pre_queue = [d - g.first_version for g, d in zip(versioned, done)]
    in_queue = [trained_version - d for d in done]
    group_max = [max(g.lengths) for g in groups]
    reward_errors, reward_timeouts = ctx.reward_counters.take()
    colocated = window.wall_s == 0.0
    generated = sum(lengths) if colocated else window.generated_tokens
    sums = _reduce([
        sum(lengths), len(lengths), sum(rewards), sum(1 for x in rewards if x >= 1.0), sum(group_max), len(groups),
        sum(staleness), sum(1 for g in groups if g.has_signal), reward_errors, reward_timeouts,
        sum(pre_queue), sum(in_queue), sum(g.mixed_version_tokens for g in groups), generated,
        window.finished_samples if not colocated else len(lengths), window.wall_s, window.idle_s,
        window.groups_aborted, window.groups_filtered, window.groups_dropped, times.trainer_wait,
        window.samples_aborted, len(versioned),
    ], dist.ReduceOp.SUM)
    maxes = _reduce([max(lengths), max(staleness, default=0), times.rollout, times.train, time.perf_counter() - times.start],
                    dist.ReduceOp.MAX)
    (tok, n, reward_sum, correct, group_max_sum, n_groups, stale_sum, mixed, errors, timeouts, pre_sum, in_sum,
     mixed_tokens, gen_tok, gen_n, wall_sum, idle_sum, aborted, filtered, dropped, wait_sum, samples_aborted,
     n_versioned) = sums
    len_max, stale_max, t_rollout, t_train, t_step = maxes
    world = dist.get_world_size() if dist.is_initialized() else 1
    len_mean = tok / max(n, 1)
    v_rollout = gen_tok / t_rollout if t_rollout else 0.0
    v_train = tok / t_train if t_train else 0.0
    rho = v_rollout / v_train if v_train else 0.0
    m_tail = (group_max_sum / max(n_groups, 1)) / len_mean if len_mean else 0.0
    pqs_pred, iqs_pred = predicted_split_for(ctx.cfg, rho, m_tail)
    return {
        "step": ctx.state.step, "version": ctx.state.version, "loss": train.loss,
        "reward_mean": reward_sum / max(n, 1), "accuracy": correct / max(n, 1),
        "response_len_mean": len_mean, "response_len_max": int(len_max), "m_tail": m_tail,
        "staleness_mean": stale_sum / max(n_versioned, 1), "staleness_max": int(stale_max),
        "staleness_pred": ctx.predicted_staleness(rho, m_tail),
        "staleness_hist": staleness_histogram(staleness),
        "pqs_measured": pre_sum / max(n_versioned, 1), "iqs_measured": in_sum / max(n_versioned, 1),
        "pqs_pred": pqs_pred, "iqs_pred": iqs_pred,
        "rollout_tokens_per_s": v_rollout, "train_tokens_per_s": v_train, "rho": rho,
        "time_rollout_s": t_rollout, "time_train_s": t_train, "time_sync_s": sync.time_sync_s,
        "time_step_s": t_step, "trainer_wait_s": wait_sum / world,
        "engine_idle_frac": idle_sum / wall_sum if wall_sum else 0.0,
        "generated_tokens": int(gen_tok), "trained_tokens": int(tok),
        "sampled_len_mean": gen_tok / max(gen_n, 1), "trained_len_mean": len_mean,
        "partial_rollout_token_frac": mixed_tokens / max(tok, 1),
        "is_weight_mean": train.is_weight_mean, "is_weight_max": train.is_weight_max,
        "is_truncated_frac": train.is_truncated_frac, "clip_frac": train.clip_frac,
        "kl_mu_theta": train.kl_mu_theta, "kl_ref": train.kl_ref, "entropy": train.entropy, "grad_norm": train.grad_norm,
        "optimizer_steps_skipped": ctx.trainer.skipped_steps,
        "groups_dropped": int(dropped), "groups_aborted": int(aborted), "groups_filtered": int(filtered),
        "samples_aborted": int(samples_aborted),
        "groups_mixed_frac": mixed / max(n_groups, 1),
        "reward_errors": int(errors), "reward_timeouts": int(timeouts),
        "sync_bytes": sync.bytes_moved, "sync_gb_per_s": sync.gb_per_s,
        "trained_problems": _gather([g.problem_index for g in groups]),
        **reward_part_means(groups, n),
        **(episode_metrics(groups, times.env_wait if colocated else window.env_wait_s,
                           t_rollout if colocated else wall_sum / world) if ctx.episodes else {}),
        **cuda_memory(times),
    }


def reward_part_means(groups: list[Group], samples: float) -> dict:
    """With several reward functions, each one's mean over the step's samples, all ranks: `reward/<name>`
    (their weighted sum is `reward_mean`). Every rank lists the same functions: the config's."""
    names = sorted({name for g in groups for name in g.reward_parts})
    if not names:
        return {}
    sums = _reduce([sum(x for g in groups for x in g.reward_parts.get(name, ())) for name in names], dist.ReduceOp.SUM)
    return {f"reward/{name}": total / max(samples, 1) for name, total in zip(names, sums)}


def episode_metrics(groups: list[Group], env_wait_s: float, rollout_wall_s: float) -> dict:
    """Multi-turn episodes: per episode over all ranks, and the share of the rollout's wall time the
    engine stood idle because every live episode waited on its environment (bounded-lag mode's
    overlap gives that time to other episodes).

    How episodes ended is counted from what happened to each: truncated (split by cause: max turns,
    or the token caps), faulted (raised, invalid or timed out), ended by the environment; so a
    panel never shows healthy tool use while most episodes were cut off."""
    records = [r.episode for g in groups for r in g.results if r.episode is not None]
    (n, tokens, turns, calls, users, tool_errors, env_s, errors, timeouts, by_turns, by_tokens, turns_cut,
     env_wait) = _reduce([
        len(records), sum(len(r.output_ids) for g in groups for r in g.results), sum(e.turns for e in records),
        sum(e.tool_calls for e in records), sum(1 for e in records if e.tool_calls),
        sum(e.tool_errors for e in records), sum(e.env_seconds for e in records),
        sum(1 for e in records if e.fault in ("raised", "invalid")), sum(1 for e in records if e.fault == "timeout"),
        sum(1 for e in records if e.truncated == TRUNCATED_BY_TURNS),
        sum(1 for e in records if e.truncated == TRUNCATED_BY_TOKENS), sum(e.turns_cut for e in records), env_wait_s,
    ], dist.ReduceOp.SUM)
    world = dist.get_world_size() if dist.is_initialized() else 1
    per_episode = lambda total: total / max(n, 1)  # noqa: E731
    return {
        "episodes": int(n),
        "episode_len_mean": per_episode(tokens), "episode_turns_mean": per_episode(turns), "tool_calls_per_episode": per_episode(calls),
        "tool_use_frac": per_episode(users),
        "tool_errors": int(tool_errors), "tool_errors_per_episode": per_episode(tool_errors),
        "env_errors": int(errors), "env_timeouts": int(timeouts), "env_faults": int(errors + timeouts),
        "episodes_truncated": int(by_turns + by_tokens), "episodes_truncated_frac": per_episode(by_turns + by_tokens),
        "truncated_max_turns_frac": per_episode(by_turns), "truncated_tokens_frac": per_episode(by_tokens),
        "turns_cut_frac": turns_cut / max(turns, 1),
        "env_s_per_episode": per_episode(env_s),
        "engine_env_wait_frac": (env_wait / world) / rollout_wall_s if rollout_wall_s else 0.0,
    }
