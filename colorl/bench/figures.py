"""Figures of one bench variant from its metrics.jsonl records.

Definitions (stated again in bench.md's header):
- trained tokens/s: response tokens the trainer consumed in a step / the step's wall-clock time
  (`time_step_s`), median over the steps after the warm-up. Not per second of the train phase:
  that is `train_tokens_per_s` in the run's own metrics.
- pooled trained tokens/s: the same steps' trained tokens summed / their step times summed.
- generated tokens/s: response tokens the engine produced in a step / the same step time.
- staleness mean / PQS / IQS / ρ / M_tail / lengths: mean or median over the steps after the
  warm-up; staleness max, histogram and group counts: over every step (the bound holds on all).
- final reward: mean `reward_mean` of the last `FINAL_STEPS` steps (one step's 32 samples are noisy).

A key a run did not write (an older run, or a mode without it) makes its figure None; token
counts then fall back to mean length × B. Colocated trainer-wait and engine-idle fractions
follow from its sequential phase times (source "derived").

Pure Python: no torch.
"""
from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass

FINAL_STEPS = 5


@dataclass(frozen=True)
class Workload:
    """What a variant's records are read against (from its resolved config)."""

    mode: str
    rollouts_per_step: int  # B = G·S over all ranks
    batch_groups: int  # G
    filter_zero_variance: bool = False  # colocated then trains only the groups with a reward signal


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _values(records: list[dict], key: str) -> list[float]:
    return [v for v in (_number(r.get(key)) for r in records) if v is not None]


def _median(records: list[dict], key: str) -> float | None:
    values = _values(records, key)
    return statistics.median(values) if values else None


def _mean(records: list[dict], key: str) -> float | None:
    values = _values(records, key)
    return statistics.fmean(values) if values else None


def _mean_or(records: list[dict], key: str, fallback: str) -> float | None:
    """A mode's own figure, else the one every mode writes (colocated samples and trains the same)."""
    value = _mean(records, key)
    return _mean(records, fallback) if value is None else value


def _total(records: list[dict], key: str) -> int | None:
    values = _values(records, key)
    return int(sum(values)) if values else None


def _tokens(record: dict, key: str, workload: Workload) -> float | None:
    """Response tokens of a step: the mode's own count, else mean length × B (colocated generates
    all B and trains all B, or the fraction of groups with a signal when it filters the rest —
    an estimate that assumes equal lengths across groups)."""
    value = _number(record.get(key))
    if value is not None:
        return value
    mean_len = _number(record.get("response_len_mean"))
    if mean_len is None:
        return None
    kept = 1.0
    if key == "trained_tokens" and workload.filter_zero_variance:
        kept = _number(record.get("groups_mixed_frac"))
    return mean_len * workload.rollouts_per_step * (1.0 if kept is None else kept)


def _per_step_second(records: list[dict], key: str, workload: Workload) -> float | None:
    rates = []
    for record in records:
        tokens, step_s = _tokens(record, key, workload), _number(record.get("time_step_s"))
        if tokens is not None and step_s:
            rates.append(tokens / step_s)
    return statistics.median(rates) if rates else None


def _pooled(records: list[dict], key: str, workload: Workload) -> float | None:
    """All steps' tokens over all steps' time: steadier than the median when a step's token count
    swings with the length tail."""
    pairs = [(_tokens(r, key, workload), _number(r.get("time_step_s"))) for r in records]
    pairs = [(t, s) for t, s in pairs if t is not None and s]
    return sum(t for t, _ in pairs) / sum(s for _, s in pairs) if pairs else None


def _idle_fractions(records: list[dict], workload: Workload) -> tuple[float | None, float | None, str]:
    """(trainer wait, engine idle) as fractions of step time, and where they come from.

    Colocated mode logs 0 for both (it has no rollout window), yet its phases are sequential:
    the trainer waits through the rollout and the engine sleeps through training and sync, so
    the fractions follow from the phase times."""
    step_s = sum(_values(records, "time_step_s"))
    if workload.mode == "colocated":
        rollout = sum(_values(records, "time_rollout_s"))
        if not step_s:
            return None, None, "absent"
        return rollout / step_s, 1.0 - rollout / step_s, "derived from phase times (sequential)"
    wait = _values(records, "trainer_wait_s")
    return (sum(wait) / step_s if wait and step_s else None), _mean(records, "engine_idle_frac"), "measured"


def staleness_histogram(records: list[dict], workload: Workload) -> dict[str, int]:
    """Trained groups per staleness value over all steps. A run that logs no histogram but a
    maximum staleness of 0 trained its G groups of every step at staleness 0."""
    counts: Counter[int] = Counter()
    for record in records:
        hist = record.get("staleness_hist")
        if isinstance(hist, dict):
            for stale, groups in hist.items():
                counts[int(stale)] += int(groups)
        elif _number(record.get("staleness_max")) == 0:
            counts[0] += workload.batch_groups
    return {str(k): counts[k] for k in sorted(counts)}


def summarize(records: list[dict], workload: Workload, warmup: int) -> dict:
    """Every figure of one variant; `records` are its metrics lines in step order."""
    steady = records[warmup:] if len(records) > warmup else []
    trainer_wait, engine_idle, idle_source = _idle_fractions(steady, workload)
    staleness_max = _values(records, "staleness_max")
    last = records[-FINAL_STEPS:]
    evals = _values(records, "eval_accuracy")
    return {
        "steps_done": len(records),
        "steps_measured": len(steady),
        "trained_tokens_per_s": _per_step_second(steady, "trained_tokens", workload),
        "trained_tokens_per_s_pooled": _pooled(steady, "trained_tokens", workload),
        "generated_tokens_per_s": _per_step_second(steady, "generated_tokens", workload),
        "train_phase_tokens_per_s": _median(steady, "train_tokens_per_s"),
        "rollout_phase_tokens_per_s": _median(steady, "rollout_tokens_per_s"),
        "step_time_s": _median(steady, "time_step_s"),
        "time_rollout_s": _median(steady, "time_rollout_s"),
        "time_train_s": _median(steady, "time_train_s"),
        "time_sync_s": _median(steady, "time_sync_s"),
        "trainer_wait_s": _median(steady, "trainer_wait_s"),
        "staleness_mean": _mean(steady, "staleness_mean"),
        "staleness_max": max(staleness_max) if staleness_max else None,
        "staleness_pred": _mean(steady, "staleness_pred"),
        "staleness_formula": None,  # filled by the caller, which knows the config
        "rho": _median(steady, "rho"),
        "m_tail": _median(steady, "m_tail"),
        "pqs_measured": _mean(steady, "pqs_measured"),
        "pqs_pred": _mean(steady, "pqs_pred"),
        "iqs_measured": _mean(steady, "iqs_measured"),
        "iqs_pred": _mean(steady, "iqs_pred"),
        "trainer_wait_frac": trainer_wait,
        "engine_idle_frac": engine_idle,
        "idle_source": idle_source,
        "sampled_len_mean": _mean_or(steady, "sampled_len_mean", "response_len_mean"),
        "trained_len_mean": _mean_or(steady, "trained_len_mean", "response_len_mean"),
        "partial_rollout_token_frac": _mean(steady, "partial_rollout_token_frac"),
        "groups_aborted": _total(records, "groups_aborted"),
        "groups_dropped": _total(records, "groups_dropped"),
        "groups_filtered": _total(records, "groups_filtered"),
        "reward_final": _mean(last, "reward_mean"),
        "eval_accuracy_final": evals[-1] if evals else None,
        "staleness_hist": staleness_histogram(records, workload),
        "episode_turns_mean": _mean(steady, "episode_turns_mean"),  # multi-turn episodes (task.env) only
        "tool_use_frac": _mean(steady, "tool_use_frac"),
        "env_s_per_episode": _mean(steady, "env_s_per_episode"),
        "engine_env_wait_frac": _mean(steady, "engine_env_wait_frac"),
        "env_errors": _total(records, "env_errors"),
        "env_timeouts": _total(records, "env_timeouts"),
        "episodes_truncated": _total(records, "episodes_truncated"),
        "wall_s": sum(_values(records, "time_step_s")),
    }


def series(records: list[dict]) -> dict[str, list]:
    """Per-step curves for the charts; seconds are cumulative step times (start-up excluded)."""
    seconds, clock = [], 0.0
    for record in records:
        clock += _number(record.get("time_step_s")) or 0.0
        seconds.append(round(clock, 4))
    return {
        "step": [r.get("step") for r in records],
        "seconds": seconds,
        "reward_mean": [_number(r.get("reward_mean")) for r in records],
        "staleness_mean": [_number(r.get("staleness_mean")) for r in records],
        "staleness_max": [_number(r.get("staleness_max")) for r in records],
    }


def speedups(summaries: list[dict | None]) -> list[float | None]:
    """Trained tokens/s of each variant over the first variant's (None where either is missing)."""
    base = summaries[0].get("trained_tokens_per_s") if summaries and summaries[0] else None
    return [(s["trained_tokens_per_s"] / base) if s and base and s.get("trained_tokens_per_s") else None
            for s in summaries]
