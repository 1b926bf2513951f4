"""Discrete-event simulator of asynchronous GRPO staleness (the seed's appendix simulator).

Model: C rollout slots decode one sample each at s_R tokens/s; sample lengths are capped
lognormal (`LengthModel`); the S samples of a group are queued together and start FIFO as
slots free up; a group is stamped with the policy version at the start of its first sample
(= the minimum over its members, DESIGN.md's V_traj) and enters the buffer when all S are
done. The trainer takes G groups whenever a batch is available, trains for t_step seconds and
publishes version v+1, which rollouts use at once (weight sync costs nothing). The loop jumps
from one sample completion or train end to the next (heapq), so there is no time step.

Buffers: `colorl.buffer` (the same code the bounded-lag mode runs), each with G entries per
step: `queue_drop`, `queue_max` and `staleflow`. A new group starts only when the buffer admits
it (StaleFlow's Reserve); otherwise the slot idles until the next version.

Pure Python (`random`, `heapq`), no torch.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import asdict, dataclass, field

from colorl.buffer import BUFFERS, Slot, make_buffer
from colorl.staleness.formula import LengthModel, Workload


class _Group(Slot):
    """A prompt's S samples: a buffer slot (`v_traj` = version at its first sample's start)
    plus what the simulator measures."""

    __slots__ = ("unfinished", "len_sum", "len_max", "v_done")

    def __init__(self, v_traj: int, size: int) -> None:
        super().__init__(v_traj)
        self.unfinished = size
        self.len_sum = 0
        self.len_max = 0
        self.v_done = v_traj


@dataclass(frozen=True)
class SimConfig:
    """One simulated configuration. Time unit: seconds if `decode_speed` is tokens/s."""

    workload: Workload
    lengths: LengthModel
    train_step_s: float  # t_step
    decode_speed: float = 1.0  # s_R, tokens/s per slot; v_R = C·s_R
    buffer: str = "queue_drop"
    eta: int | None = None
    steps: int = 2000
    warmup: int | None = None  # steps discarded before measuring; default ~steps/10
    seed: int = 0

    def __post_init__(self) -> None:
        if self.buffer not in BUFFERS:
            raise ValueError(f"unknown buffer {self.buffer!r}; one of {', '.join(BUFFERS)}")
        if not (self.train_step_s > 0 and self.decode_speed > 0):
            raise ValueError("train_step_s and decode_speed must be positive")
        if self.steps < 2:
            raise ValueError(f"steps must be >= 2, got {self.steps}")
        if self.warmup is not None and not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup must be in [0, steps), got {self.warmup}")

    @classmethod
    def from_rho(cls, workload: Workload, lengths: LengthModel, rho: float,
                 decode_speed: float = 1.0, **kwargs) -> SimConfig:
        """Set t_step so that v_R / v_T = ρ with v_T = B·E[L] / t_step."""
        if not (rho > 0 and math.isfinite(rho)):
            raise ValueError(f"rho must be a positive number, got {rho}")
        t_step = rho * workload.batch_rollouts * lengths.expected_length() / (
            workload.concurrency * decode_speed)
        return cls(workload, lengths, t_step, decode_speed, **kwargs)

    @property
    def rho(self) -> float:
        v_rollout = self.workload.concurrency * self.decode_speed
        v_train = self.workload.batch_rollouts * self.lengths.expected_length() / self.train_step_s
        return v_rollout / v_train

    @property
    def warmup_steps(self) -> int:
        if self.warmup is not None:
            return self.warmup
        return min(self.steps // 2, max(5, self.steps // 10))


@dataclass(frozen=True)
class SimResult:
    """Measured after warm-up: staleness per trained group, split at queue entry into PQS
    (versions during generation) and IQS (versions while queued)."""

    staleness_mean: float
    staleness_max: int
    pqs: float
    iqs: float
    t_period: float  # mean time between policy updates
    groups_dropped: int
    sampled_len_mean: float  # over all groups completed after warm-up
    sampled_len_max: int
    trained_len_mean: float
    trained_len_max: int
    rho: float
    rollout_utilization: float  # busy fraction of the C slots (below 1 when admission blocks)
    trained_groups: int
    steps: int
    warmup: int
    staleness_hist: dict[int, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _block_sampler(lengths: LengthModel, rng: random.Random, size: int = 4096):
    """A function returning `size` fresh lengths; same law as `LengthModel.draw`."""
    mean, cap, sigma = lengths.mean, lengths.effective_cap, lengths.sigma
    shift = -sigma * sigma / 2
    gauss, exp = rng.gauss, math.exp
    if not sigma:
        constant = max(1, min(cap, round(mean)))
        return lambda: [constant] * size
    return lambda: [max(1, min(cap, round(mean * exp(sigma * gauss(0.0, 1.0) + shift))))
                    for _ in range(size)]


def simulate(cfg: SimConfig) -> SimResult:
    """Run the event loop for `cfg.steps` train steps."""
    rng = random.Random(cfg.seed)
    concurrency = cfg.workload.concurrency
    group_size = cfg.workload.group_size
    buffer = make_buffer(cfg.buffer, cfg.workload.batch_groups, cfg.workload.queue_factor,
                         cfg.eta)
    warmup, steps = cfg.warmup_steps, cfg.steps
    t_step, speed = cfg.train_step_s, cfg.decode_speed
    draw_block = _block_sampler(cfg.lengths, rng)
    heappush, heappop, heapreplace = heapq.heappush, heapq.heappop, heapq.heapreplace

    heap: list[tuple[float, int, _Group]] = []  # (finish time, tie-break, group)
    seq = 0
    version = 0
    train_end = math.inf  # inf while the trainer waits for a batch
    open_group: _Group | None = None  # group whose samples are still being started
    to_start = 0
    idle_slots = 0
    idle_area = 0.0  # slot-seconds spent idle after warm-up (admission blocked)
    t_idle_mark = 0.0
    t = 0.0
    update_times: list[float] = []
    dropped = 0
    hist: dict[int, int] = {}
    pqs_sum = iqs_sum = 0
    trained = trained_tokens = trained_max = 0
    sampled_groups = sampled_tokens = sampled_max = 0

    block: list[int] = []  # lengths drawn ahead in blocks: one comprehension beats a call each

    pending = _Group(0, group_size)  # the next group to admit; kept while admission refuses

    def start_sample(now: float) -> bool:
        nonlocal open_group, to_start, seq, block, pending
        if to_start == 0:
            pending.v_traj = version
            if not buffer.admit(pending):
                return False
            open_group, to_start = pending, group_size
            pending = _Group(version, group_size)
        group = open_group
        to_start -= 1
        if not block:
            block = draw_block()
        length = block.pop()
        group.len_sum += length
        if length > group.len_max:
            group.len_max = length
        heappush(heap, (now + length / speed, seq, group))
        seq += 1
        return True

    def try_train(now: float) -> None:
        nonlocal train_end, dropped, pqs_sum, iqs_sum, trained, trained_tokens, trained_max
        batch, discarded = buffer.take(version)
        if version >= warmup:
            dropped += len(discarded)
        if batch is None:
            return
        train_end = now + t_step
        if version < warmup:
            return
        for group in batch:
            stale = version - group.v_traj
            hist[stale] = hist.get(stale, 0) + 1
            pqs_sum += group.v_done - group.v_traj
            iqs_sum += version - group.v_done
            trained_tokens += group.len_sum
            if group.len_max > trained_max:
                trained_max = group.len_max
        trained += len(batch)

    for _ in range(concurrency):
        if not start_sample(0.0):
            idle_slots += 1

    while len(update_times) < steps:
        if heap and heap[0][0] < train_end:
            t, _, group = heap[0]  # popped below, or replaced by the slot's next sample
            group.unfinished -= 1
            if group.unfinished == 0:
                group.v_done = version
                if version >= warmup:
                    sampled_groups += 1
                    sampled_tokens += group.len_sum
                    if group.len_max > sampled_max:
                        sampled_max = group.len_max
                evicted = buffer.complete(group)
                if evicted and version >= warmup:
                    dropped += len(evicted)
                if train_end == math.inf:
                    try_train(t)
            if to_start == 0:  # the freed slot needs a new group: admission decides
                pending.v_traj = version
                if buffer.admit(pending):
                    open_group, to_start = pending, group_size
                    pending = _Group(version, group_size)
            if to_start:  # start_sample inlined: this is the hot path
                to_start -= 1
                if not block:
                    block = draw_block()
                length = block.pop()
                group = open_group
                group.len_sum += length
                if length > group.len_max:
                    group.len_max = length
                heapreplace(heap, (t + length / speed, seq, group))
                seq += 1
            else:
                heappop(heap)
                if version >= warmup:
                    idle_area += idle_slots * (t - t_idle_mark)
                t_idle_mark = t
                idle_slots += 1
        elif train_end < math.inf:
            t = train_end
            train_end = math.inf
            version += 1
            update_times.append(t)
            if len(update_times) == steps:
                break
            if idle_slots:
                if version > warmup:
                    idle_area += idle_slots * (t - t_idle_mark)
                t_idle_mark = t
                while idle_slots and start_sample(t):
                    idle_slots -= 1
            try_train(t)
        else:
            raise RuntimeError("simulation deadlocked: no sample in flight and no batch ready")

    measured = steps - warmup
    t_from = update_times[warmup - 1] if warmup else 0.0
    return SimResult(
        staleness_mean=sum(k * n for k, n in hist.items()) / trained if trained else math.nan,
        staleness_max=max(hist) if hist else 0,
        pqs=pqs_sum / trained if trained else math.nan,
        iqs=iqs_sum / trained if trained else math.nan,
        t_period=(update_times[-1] - t_from) / measured,
        groups_dropped=dropped,
        sampled_len_mean=sampled_tokens / (sampled_groups * group_size) if sampled_groups
        else math.nan,
        sampled_len_max=sampled_max,
        trained_len_mean=trained_tokens / (trained * group_size) if trained else math.nan,
        trained_len_max=trained_max,
        rho=cfg.rho,
        rollout_utilization=1 - idle_area / (concurrency * (update_times[-1] - t_from)),
        trained_groups=trained,
        steps=steps,
        warmup=warmup,
        staleness_hist=dict(sorted(hist.items())),
    )
