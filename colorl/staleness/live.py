"""Predicted staleness for each training step's metrics line (`staleness_pred`), and its
split into pre-queue and in-queue parts for the configured buffer.

The training loop calls `predicted_staleness` with its config values and the step's measured
ρ = v_R / v_T and M_tail, and logs the result next to the measured `staleness_mean`, so a run
shows at once whether reality matches the model.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from colorl.buffer import BOUNDED
from colorl.staleness import formula


class BufferPrediction(NamedTuple):
    """Mean staleness of the configured buffer, split at queue entry: `pqs` (versions that
    pass while a group generates) + `iqs` (versions while it waits) = `staleness`."""

    pqs: float
    iqs: float
    staleness: float


def predicted_split(concurrency: int, batch_rollouts: int, queue_factor: float, rho: float,
                    m_tail: float, mode: str = "bounded_lag", buffer: str = "staleflow",
                    eta: int | None = None) -> BufferPrediction:
    """The closed-form model for this buffer (see `predicted_staleness` for the total).

    queue_drop: the seed's PQS and IQS. η-bounded buffers: the queue-drop split scaled to the
    bounded total. An approximation: when η binds, the simulator shows the split shifting
    toward IQS (StaleFlow admits groups right after a publish, so they finish within fewer
    versions and wait longer); `colorl simulate` gives the measured split.
    """
    if mode == "colocated":
        return BufferPrediction(0.0, 0.0, 0.0)
    if not (rho > 0 and math.isfinite(rho) and m_tail > 0 and math.isfinite(m_tail)):
        return BufferPrediction(math.nan, math.nan, math.nan)
    pqs = formula.pqs(concurrency, batch_rollouts, rho, max(1.0, m_tail))
    iqs = formula.iqs(rho, max(1.0, queue_factor))
    total = pqs + iqs
    if buffer not in BOUNDED or eta is None:
        return BufferPrediction(pqs, iqs, total)
    bounded = float(eta) if rho >= 1 else min(total, float(eta))
    scale = bounded / total
    return BufferPrediction(pqs * scale, iqs * scale, bounded)


def predicted_staleness(concurrency: int, batch_rollouts: int, queue_factor: float,
                        rho: float, m_tail: float, mode: str = "bounded_lag",
                        buffer: str = "staleflow", eta: int | None = None) -> float:
    """Mean staleness the closed-form model predicts for this step.

    - `colocated` mode trains on-policy: 0.
    - `queue_drop`: the seed's formula PQS + IQS.
    - η-bounded buffers (`colorl.buffer.BOUNDED`: staleflow, queue_max): the formula for an
      unbounded queue (q → ∞), capped at η. Rollout-bound (ρ < 1) the queue does not fill
      and IQS = ρ whatever q is, so that is the formula capped at η (queue_max's cap
      overestimates a little: discarding stale groups lowers the mean; staleflow can be low
      by up to ~1.5 steps when η is large (4) and C ≈ B: stragglers stall a buffer, admission
      backs up and later groups wait in later buffers). Train-bound (ρ >= 1) work piles up
      until the bound stops it: StaleFlow blocks admission and every group lands in the
      latest buffer it may use; queue_max's unbounded queue grows until it discards. Both sit
      at η (simulator, η 1-4, C/B 0.5-2: staleflow within 0.01; queue_max within 0.5, except
      1.0 low at η = 4, C = 2B, tailness 90).

    Returns NaN when ρ or M_tail is not measured yet (zero, negative, NaN): a prediction from
    a missing measurement would look like a real number in the log.
    """
    return predicted_split(concurrency, batch_rollouts, queue_factor, rho, m_tail, mode,
                           buffer, eta).staleness


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
