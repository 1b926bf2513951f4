"""Predicted staleness for each training step's metrics line (`staleness_pred`).

The training loop calls `predicted_staleness` with its config values and the step's measured
ρ = v_R / v_T and M_tail, and logs the result next to the measured `staleness_mean`, so a run
shows at once whether reality matches the model.
"""

from __future__ import annotations

import math

from colorl.staleness import formula

BOUNDED_BUFFERS = ("staleflow", "queue_max")


def predicted_staleness(concurrency: int, batch_rollouts: int, queue_factor: float,
                        rho: float, m_tail: float, mode: str = "bounded_lag",
                        buffer: str = "staleflow", eta: int | None = None) -> float:
    """Mean staleness the closed-form model predicts for this step.

    - `colocated` mode trains on-policy: 0.
    - `queue_drop`: the seed's formula PQS + IQS.
    - `queue_max`: the same, capped at η (it never trains a group staler than η; the cap
      overestimates a little because discarding stale groups lowers the mean).
    - `staleflow`: η when train-bound (ρ >= 1): admission blocks instead of dropping, every
      group lands in the latest buffer it may use, so staleness sits at η (the simulator
      agrees to 0.01). Rollout-bound: the formula capped at η; the simulator shows it can be
      low by up to ~1.5 steps when η is large (4) and C ≈ B: stragglers stall a buffer,
      admission backs up and later groups wait in later buffers.

    Returns NaN when ρ or M_tail is not measured yet (zero, negative, NaN): a prediction from
    a missing measurement would look like a real number in the log.
    """
    if mode == "colocated":
        return 0.0
    if not (rho > 0 and math.isfinite(rho) and m_tail > 0 and math.isfinite(m_tail)):
        return math.nan
    value = formula.staleness(concurrency, batch_rollouts, max(1.0, queue_factor), rho,
                              max(1.0, m_tail))
    if buffer in BOUNDED_BUFFERS and eta is not None:
        if buffer == "staleflow" and rho >= 1:
            return float(eta)
        value = min(value, float(eta))
    return value


def predicted_staleness_for(cfg, rho: float, m_tail: float) -> float:
    """`predicted_staleness` with C, B, q, mode, buffer and η read from a `colorl.config.Config`
    (C = `rollout.concurrency`, taken as sequences in flight over all ranks, like G)."""
    return predicted_staleness(
        concurrency=cfg.rollout.concurrency,
        batch_rollouts=cfg.rollout.batch_groups * cfg.rollout.group_size,
        queue_factor=cfg.staleness.queue_factor,
        rho=rho,
        m_tail=m_tail,
        mode=cfg.mode,
        buffer=cfg.staleness.buffer,
        eta=cfg.staleness.max,
    )


def predicted_split_for(cfg, rho: float, m_tail: float) -> tuple[float, float]:
    """The formula's (PQS, IQS) for this step, next to the measured pre-queue / in-queue staleness.

    Colocated mode: (0, 0). Not measured yet: (NaN, NaN). The bounded buffers cap the sum at η,
    which the split does not show; the uncapped terms are what the formula says of the queue.
    """
    if cfg.mode == "colocated":
        return 0.0, 0.0
    if not (rho > 0 and math.isfinite(rho) and m_tail > 0 and math.isfinite(m_tail)):
        return math.nan, math.nan
    batch_rollouts = cfg.rollout.batch_groups * cfg.rollout.group_size
    return (formula.pqs(cfg.rollout.concurrency, batch_rollouts, rho, max(1.0, m_tail)),
            formula.iqs(rho, max(1.0, cfg.staleness.queue_factor)))
