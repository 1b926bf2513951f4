"""Closed-form staleness of asynchronous GRPO (Applied Compute, "Predicting and Controlling
Staleness in Fully Asynchronous RL Training"; see DESIGN.md).

Staleness splits into pre-queue staleness (policy updates while a group is generated) and
in-queue staleness (updates while it waits in the queue):

    PQS = C·M_tail / (B·max(1, ρ))
    IQS = ρ                       for ρ < 1   (rollout-bound: the trainer drains the queue)
          (2q + ρ − 1) / (2ρ)     for ρ ≥ 1   (train-bound: the queue of q·G groups is full)
    t_period = B·E[L] / min(v_R, v_T)

Deviations from the seed, named:
1. The seed leaves ρ = 1 open; here ρ = 1 counts as train-bound, matching its t_period
   formula. IQS jumps from 1 to q there, so for q > 1 the value at exactly ρ = 1 is only an
   upper bound (the simulator shows a smooth transition).
2. IQS is derived for queue-drop. η-bounded buffers (StaleFlow, queue-max) never train a group
   staler than η; `colorl.staleness.live` adjusts the prediction for them.

Pure Python, no torch: this runs before a launch and inside the simulator's tests.
"""

from __future__ import annotations

import functools
import math
import random
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

ROLLOUT_BOUND = "rollout-bound"
TRAIN_BOUND = "train-bound"


@dataclass(frozen=True)
class Workload:
    """The configuration quantities staleness depends on (symbols of DESIGN.md)."""

    concurrency: int  # C: sequences in flight
    batch_groups: int  # G: groups per train batch
    group_size: int  # S: samples per group
    queue_factor: float = 1.0  # q = Q / B

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.batch_groups < 1 or self.group_size < 1:
            raise ValueError("concurrency, batch_groups and group_size must be >= 1")
        if not self.queue_factor >= 1:
            raise ValueError(f"queue_factor must be >= 1 (a queue smaller than a batch never "
                             f"fills one), got {self.queue_factor}")

    @property
    def batch_rollouts(self) -> int:
        """B = G·S."""
        return self.batch_groups * self.group_size

    @classmethod
    def with_queue_capacity(cls, concurrency: int, batch_groups: int, group_size: int,
                            queue_rollouts: int) -> Workload:
        """Build from the queue capacity Q in rollouts instead of q = Q/B."""
        return cls(concurrency, batch_groups, group_size,
                   queue_rollouts / (batch_groups * group_size))


@dataclass(frozen=True)
class Prediction:
    """Formula output; t_period is None when the throughputs or E[L] are unknown."""

    pqs: float
    iqs: float
    staleness: float
    rho: float
    m_tail: float
    regime: str
    t_period: float | None = None


def regime(rho: float) -> str:
    """Which side is the bottleneck: rollout-bound (ρ < 1) or train-bound (ρ >= 1)."""
    return ROLLOUT_BOUND if rho < 1 else TRAIN_BOUND


def _check_rho(rho: float) -> None:
    if not (rho > 0 and math.isfinite(rho)):
        raise ValueError(f"rho must be a positive number, got {rho}")


def pqs(concurrency: int, batch_rollouts: int, rho: float, m_tail: float) -> float:
    """Pre-queue staleness: group generation time over the effective train period."""
    _check_rho(rho)
    return concurrency * m_tail / (batch_rollouts * max(1.0, rho))


def iqs(rho: float, queue_factor: float) -> float:
    """In-queue staleness of queue-drop (with the smooth-arrival +1/2 when train-bound)."""
    _check_rho(rho)
    if rho < 1:
        return rho
    return (2 * queue_factor + rho - 1) / (2 * rho)


def staleness(concurrency: int, batch_rollouts: int, queue_factor: float, rho: float,
              m_tail: float) -> float:
    """Mean total staleness PQS + IQS of queue-drop."""
    return pqs(concurrency, batch_rollouts, rho, m_tail) + iqs(rho, queue_factor)


def t_period(batch_rollouts: int, mean_len: float, v_rollout: float, v_train: float) -> float:
    """Effective train period: a batch's tokens at the slower of the two throughputs."""
    return batch_rollouts * mean_len / min(v_rollout, v_train)


def predict(workload: Workload, rho: float | None = None, m_tail: float | None = None, *,
            v_rollout: float | None = None, v_train: float | None = None,
            lengths: LengthModel | Iterable[int] | None = None,
            mean_len: float | None = None) -> Prediction:
    """Predict staleness from whatever the caller knows.

    ρ comes from `rho` or from v_R / v_T; M_tail from `m_tail` or from `lengths` (a
    `LengthModel`, computed exactly, or observed lengths, treated as the empirical
    distribution). t_period needs E[L] (from `mean_len` or `lengths`) and v_R (v_T follows
    from ρ when only one throughput is given).
    """
    if rho is None:
        if v_rollout is None or v_train is None:
            raise ValueError("give rho or both v_rollout and v_train")
        rho = v_rollout / v_train
    _check_rho(rho)
    if lengths is not None and not isinstance(lengths, LengthModel):
        lengths = list(lengths)
    if m_tail is None:
        if lengths is None:
            raise ValueError("give m_tail or a length distribution")
        m_tail = (lengths.m_tail(workload.group_size) if isinstance(lengths, LengthModel)
                  else m_tail_from_lengths(lengths, workload.group_size))
    if mean_len is None and lengths is not None:
        mean_len = (lengths.expected_length() if isinstance(lengths, LengthModel)
                    else sum(lengths) / len(lengths))
    if v_rollout is None and v_train is not None:
        v_rollout = rho * v_train
    if v_train is None and v_rollout is not None:
        v_train = v_rollout / rho
    period = None
    if mean_len is not None and v_rollout is not None and v_train is not None:
        period = t_period(workload.batch_rollouts, mean_len, v_rollout, v_train)
    p = pqs(workload.concurrency, workload.batch_rollouts, rho, m_tail)
    i = iqs(rho, workload.queue_factor)
    return Prediction(pqs=p, iqs=i, staleness=p + i, rho=rho, m_tail=m_tail,
                      regime=regime(rho), t_period=period)


# --- Train period under a fixed device budget and the rollout- vs train-bound choice -------

def budget_throughputs(rho: float, devices: float, c_rollout: float,
                       c_train: float) -> tuple[float, float]:
    """(v_R, v_T) when N devices are split so that v_R / v_T = ρ, with per-device token
    throughputs c_R (rollout) and c_T (train) constant (the seed's linear-scaling assumption)."""
    _check_rho(rho)
    denom = 1 / c_train + rho / c_rollout
    return rho * devices / denom, devices / denom


def t_period_budget(rho: float, batch_rollouts: int, mean_len: float, devices: float,
                    c_rollout: float, c_train: float) -> float:
    """t_period(ρ) = B·E[L]·(1/c_T + ρ/c_R) / (N·min(1, ρ)); minimal at ρ = 1."""
    v_r, v_t = budget_throughputs(rho, devices, c_rollout, c_train)
    return t_period(batch_rollouts, mean_len, v_r, v_t)


def beta_star(c_rollout: float, c_train: float) -> float:
    """β*: rollout compute over train compute at the balanced point ρ = 1, i.e. c_T / c_R."""
    return c_train / c_rollout


def beta_crit(queue_factor: float) -> float:
    """β_crit(q) = 1 / (6q − 4 + 4·sqrt((q−1)(2q−1))): below it, some train-bound point beats
    the rollout-bound point of equal t_period; above it, rollout-bound always wins."""
    q = queue_factor
    if q < 1:
        raise ValueError(f"queue_factor must be >= 1, got {q}")
    return 1 / (6 * q - 4 + 4 * math.sqrt((q - 1) * (2 * q - 1)))


def rho_minus(rho_plus: float, beta: float) -> float:
    """The rollout-bound ρ with the same t_period as the train-bound ρ+ = 1 + z."""
    return 1 / (1 + beta * (rho_plus - 1))


def frontier_gap(z: float, beta: float, queue_factor: float) -> float:
    """staleness(ρ+) − staleness(ρ−) at equal t_period, ρ+ = 1 + z (PQS cancels; negative
    means the train-bound point is better)."""
    return (z + 2 * queue_factor) / (2 * (1 + z)) - 1 / (1 + beta * z)


def train_bound_can_win(beta: float, queue_factor: float) -> bool:
    """Whether any train-bound operating point improves the frontier: β* < β_crit(q)."""
    return beta < beta_crit(queue_factor)


# --- M_tail from a length distribution ----------------------------------------------------

def _expected_max_from_counts(counts: dict[int, float], group_size: int) -> tuple[float, float]:
    """(E[L], E[max of S draws]) for a discrete distribution given as value -> weight."""
    total = sum(counts.values())
    mean = sum(v * w for v, w in counts.items()) / total
    emax, cdf_prev = 0.0, 0.0
    for value in sorted(counts):
        cdf = min(1.0, cdf_prev + counts[value] / total)
        emax += value * (cdf ** group_size - cdf_prev ** group_size)
        cdf_prev = cdf
    return mean, emax


def m_tail_from_lengths(lengths: Iterable[float], group_size: int) -> float:
    """Exact M_tail of the empirical distribution of observed lengths (i.i.d. draws)."""
    counts = Counter(lengths)
    if not counts:
        raise ValueError("no lengths given")
    mean, emax = _expected_max_from_counts(counts, group_size)
    return emax / mean


def m_tail_monte_carlo(draw: Callable[[random.Random], float], group_size: int,
                       groups: int = 20_000, seed: int = 0) -> float:
    """M_tail by sampling `groups` groups of S lengths from `draw(rng)`."""
    rng = random.Random(seed)
    total, total_max = 0.0, 0.0
    for _ in range(groups):
        group = [draw(rng) for _ in range(group_size)]
        total += sum(group)
        total_max += max(group)
    return total_max / (total / group_size)


@dataclass(frozen=True)
class LengthModel:
    """Capped lognormal response lengths of the simulator and of `rollout.length_override`.

    L = clamp(round(mean·exp(σz − σ²/2)), 1, cap), z ~ N(0, 1), σ = 1.3·tailness/100, so
    `mean` is the uncapped mean; capping makes E[L] a little smaller (`expected_length`).
    tailness 0 gives the constant length `mean`.
    """

    mean: float
    tailness: float = 50.0
    cap: int | None = None

    def __post_init__(self) -> None:
        if not self.mean >= 1:
            raise ValueError(f"mean length must be >= 1, got {self.mean}")
        if not 0 <= self.tailness <= 400:
            raise ValueError(f"tailness must be in [0, 400], got {self.tailness}")
        if self.cap is not None and self.cap < 1:
            raise ValueError(f"length cap must be >= 1, got {self.cap}")

    @property
    def sigma(self) -> float:
        return 1.3 * self.tailness / 100

    @property
    def effective_cap(self) -> int:
        """Cap used for the exact sums; uncapped models are cut where P(L > cap) < 1e-12."""
        if self.cap is not None:
            return self.cap
        tail_z = 7.1  # Φ(−7.1) ≈ 6e-13
        return max(1, math.ceil(self.mean * math.exp(self.sigma * tail_z)))

    def draw(self, rng: random.Random) -> int:
        raw = self.mean * math.exp(self.sigma * rng.gauss(0.0, 1.0) - self.sigma ** 2 / 2)
        return max(1, min(self.effective_cap, round(raw)))

    def _cdf(self, k: int) -> float:
        """P(L <= k) for 1 <= k < cap, σ > 0."""
        z = (math.log((k + 0.5) / self.mean) + self.sigma ** 2 / 2) / self.sigma
        return 0.5 * math.erfc(-z / math.sqrt(2))

    def expected_length(self) -> float:
        """E[L] of the capped, rounded distribution."""
        return _tail_sums(self, 1)[0]

    def m_tail(self, group_size: int) -> float:
        """Exact M_tail = E[max(L_1..L_S)] / E[L]."""
        mean, emax = _tail_sums(self, group_size)
        return emax / mean


@functools.lru_cache(maxsize=256)
def _tail_sums(model: LengthModel, group_size: int) -> tuple[float, float]:
    """(E[L], E[max of S]) as sums of survival functions over k = 0 .. cap−1; cached because
    sweeps and the simulator ask for the same model many times."""
    cap = model.effective_cap
    if model.sigma == 0:
        length = float(max(1, min(cap, round(model.mean))))
        return length, length
    mean = emax = 0.0
    for k in range(cap):
        cdf = 0.0 if k == 0 else model._cdf(k)
        mean += 1 - cdf
        emax += 1 - cdf ** group_size
        if cdf == 1.0:
            break
    return mean, emax
