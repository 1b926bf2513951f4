"""The rollout thread of bounded-lag mode: keeps the engine decoding while the trainer trains.

    loop (rollout thread; it never issues a collective):
        apply the newest published weights at this step boundary (recompute: re-prefill in-flight)
        serve the trainer's eval request, if any (rollouts parked meanwhile)
        admit groups while Reserve succeeds and fewer than C/world sequences are in flight
        engine.step(); reward each group whose S samples are done; Occupy (release if filtered)

The trainer thread blocks in `take_batch(version)` until this rank's buffer for `version` is
Ready. The buffer is shared between the two threads under one condition variable; everything
else here belongs to the rollout thread.

Data: a rank admits groups in ticket order (0, 1, 2, ...); ticket k is the (k mod G/world)-th
group of step k div (G/world) on this rank, with the problem and sampling seeds colocated mode
uses for that step, so η = 0 trains on exactly colocated mode's data. A checkpoint keeps the
completed groups and the tickets in flight; a resume re-issues those tickets first.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from colorl import distributed, faults
from colorl.buffer import Slot
from colorl.engines.base import GenerationRequest, GenerationResult
from colorl.envs.base import EpisodeRecord
from colorl.rollout.collect import step_requests
from colorl.rollout.episodes import Rollouts, score_samples
from colorl.rollout.types import Group, RolloutWindow
from colorl.tasks.base import Problem
from colorl.threads import set_threads

if TYPE_CHECKING:
    from colorl.modes.cores import CoreShare

WAIT_TICK_S = 0.25  # how often a waiting trainer refreshes the display and checks the rollout thread


class RolloutThreadError(RuntimeError):
    """The rollout thread failed. `thread_traceback` is that thread's traceback: the launcher
    shows it instead of the trainer thread's, which only says where the trainer noticed."""

    def __init__(self, thread_traceback: str) -> None:
        last = thread_traceback.strip().splitlines()[-1] if thread_traceback.strip() else "unknown error"
        super().__init__(f"the rollout thread failed: {last}")
        self.thread_traceback = thread_traceback


@dataclass
class _Flight:
    """A group being generated: its buffer slot and its samples still running / done."""

    slot: Slot
    ticket: int
    problem_index: int
    problem: Problem
    running: dict[str, GenerationRequest]  # by request id
    done: list[tuple[int, GenerationResult]] = field(default_factory=list)  # (sample index, result)


@dataclass(frozen=True)
class LoopStatus:
    """A snapshot for the live display: both loops and the buffer."""

    engine_version: int
    running: int
    waiting: int
    kv_used: int
    kv_total: int
    in_flight_groups: int
    buffers: str


class RolloutProducer:
    def __init__(self, ctx, buffer, cores: CoreShare, saved: dict | None = None) -> None:
        """cores: how this loop and the trainer share the rank's cores (colorl/modes/cores.py)."""
        cfg = ctx.cfg
        self.ctx, self.engine, self.buffer, self.cores = ctx, ctx.engine, buffer, cores
        self.rollouts = Rollouts(ctx.engine, ctx.episodes)  # completions, or episodes with an environment
        self.group_size = cfg.rollout.group_size
        redundancy = cfg.staleness.redundancy
        extra = math.ceil(self.group_size * redundancy.ratio) if redundancy and redundancy.level == "group" else 0
        self.samples_per_group = self.group_size + extra
        per_rank = -(-cfg.rollout.concurrency // ctx.world)  # C counts sequences in flight over all ranks
        self.max_in_flight = max(per_rank, self.samples_per_group)
        self.recompute = cfg.staleness.partial_rollout == "recompute"
        self.drop_zero_variance = cfg.filter.zero_variance
        self.env_faults = cfg.filter.env_faults
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._error: str | None = None
        self._window = RolloutWindow()
        self._window_start = time.perf_counter()
        self._eval_problems: list[Problem] | None = None
        self._eval_result = None
        self._flights: dict[int, _Flight] = {}
        self._next_ticket = ctx.state.step * ctx.groups_per_rank  # a resumed colocated run's data position
        self._reissue: deque[int] = deque()
        self._step_cache: dict[int, tuple[list[int], list[list[GenerationRequest]]]] = {}
        self.status = LoopStatus(self.engine.version, 0, 0, 0, 0, 0, "")
        restored = self._restore(saved) if saved else []
        self.dropped_on_resume = len(self.buffer.restore(restored, ctx.state.version))
        self._thread = threading.Thread(target=self._run, name="colorl-rollout", daemon=True)

    # ---------------------------------------------------------------- trainer thread
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.notify()
        self._thread.join(timeout=30)
        self.rollouts.close()

    def notify(self) -> None:
        """Wake the rollout thread (a version was published, or it should stop)."""
        with self._cv:
            self._cv.notify_all()

    def take_batch(self, version: int, on_wait: Callable[[], None] = lambda: None
                   ) -> tuple[list[Group], RolloutWindow, float]:
        """Block until this rank's buffer for `version` is Ready; its groups in ticket order."""
        started = time.perf_counter()
        dropped = 0
        while True:
            with self._cv:
                self._raise_if_failed()
                taken = self.buffer.take(version)
                dropped += len(taken.dropped)
                self.cores.trainer_idle = taken.batch is None
                if taken.batch is None:
                    self._cv.wait(WAIT_TICK_S)
                else:
                    window, self._window = self._window, RolloutWindow()
                    now = time.perf_counter()
                    window.wall_s, self._window_start = now - self._window_start, now
                    window.groups_dropped += dropped
                    self._cv.notify_all()  # a consumed buffer frees entries: admission may go on
                    groups = sorted((slot.payload for slot in taken.batch), key=lambda g: g.ticket)
                    return groups, window, now - started
            on_wait()

    def evaluate(self, problems: list[Problem]):
        """Run a held-out eval on this rank's engine, at its newest version (blocks the caller)."""
        with self._cv:
            self._eval_problems, self._eval_result = problems, None
            self._cv.notify_all()
            while self._eval_result is None:
                self._raise_if_failed()
                self._cv.wait(WAIT_TICK_S)
            result, self._eval_result = self._eval_result, None
            return result

    def snapshot(self) -> dict:
        """What a checkpoint keeps: completed groups (with their V_traj) and the tickets to re-issue."""
        with self._cv:
            completed = [{"v_traj": slot.v_traj, "group": _group_to_json(slot.payload)}
                         for slot in self.buffer.completed()]
            reissue = sorted([*self._reissue, *self._flights])
            return {"next_ticket": self._next_ticket, "reissue": reissue, "completed": completed}

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RolloutThreadError(self._error)

    # ---------------------------------------------------------------- rollout thread
    def _run(self) -> None:
        distributed.use_device(self.ctx.device)
        # an engine in this process decodes on its own stream; SGLang and vLLM run on their own
        in_process = getattr(self.engine, "device", None) is not None
        stream = torch.cuda.Stream(self.ctx.device) if in_process and self.ctx.device.startswith("cuda") else None
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                while not self._stop.is_set():
                    self._apply_newest_weights()
                    self._serve_eval()
                    self._admit()
                    self._step()
        except BaseException:  # reported to the trainer thread, which stops the run
            with self._cv:
                self._error = traceback.format_exc()
                self._cv.notify_all()

    def _apply_newest_weights(self) -> None:
        pending = self.ctx.weight_sync.pending_version
        if pending is None:
            return
        faults.point("apply_weights", pending)  # step `pending` published the version applied here
        stats = self.ctx.weight_sync.apply_pending(self.engine)  # orders itself after the publish (an event)
        if stats is None:
            return
        self._window.apply_s += stats.time_sync_s
        if self.recompute and self._flights:  # AReaL style: in-flight samples continue under the new weights
            self.rollouts.resume(self.rollouts.interrupt([rid for f in self._flights.values() for rid in f.running]))

    def _serve_eval(self) -> None:
        if self._eval_problems is None:
            return
        parked = self.rollouts.interrupt([rid for f in self._flights.values() for rid in f.running], keep_kv=True)
        result = self.ctx.evaluate_problems(self._eval_problems)
        self.rollouts.resume(parked)  # on their kept KV
        with self._cv:
            self._eval_problems, self._eval_result = None, result
            self._cv.notify_all()

    def _admit(self) -> None:
        while not self._stop.is_set():
            running = sum(len(f.running) for f in self._flights.values())
            if running + self.samples_per_group > self.max_in_flight:
                return
            ticket = self._reissue[0] if self._reissue else self._next_ticket
            slot = Slot(self.engine.version, ticket)  # payload: the ticket until the group is complete
            with self._cv:
                if not self.buffer.admit(slot):
                    return
                if self._reissue:
                    self._reissue.popleft()
                else:
                    self._next_ticket += 1
                index, requests = self._requests(ticket)
                problem = self.ctx.task.train_problem(index)
                self._flights[ticket] = _Flight(slot, ticket, index, problem, {r.request_id: r for r in requests})
            for request in requests:
                self.rollouts.start(request, problem)

    def _requests(self, ticket: int) -> tuple[int, list[GenerationRequest]]:
        """Problem index and requests of a ticket: step `ticket div G/world`, exactly as colocated draws them."""
        per_step = self.ctx.groups_per_rank
        step, position = divmod(ticket, per_step)
        if step not in self._step_cache:
            indices = list(self.ctx.problem_indices(step))
            prompts = [self.ctx.prompt_ids(self.ctx.task.train_problem(i)) for i in indices]
            tickets = [str(step * per_step + j) for j in range(per_step)]
            self._step_cache = {s: v for s, v in self._step_cache.items() if s >= step - 1}
            self._step_cache[step] = (indices, step_requests(
                self.ctx.cfg.rollout, prompts, tickets, self.ctx.sample_seed(step), self.ctx.stop_ids,
                self.samples_per_group))
        indices, requests = self._step_cache[step]
        return indices[position], requests[position]

    def _step(self) -> None:
        started = time.perf_counter()
        self.cores.rollout_idle = not self.rollouts.has_unfinished()
        if self.cores.rollout_idle:
            with self._cv:
                self._cv.wait(0.05)  # woken by a publish, a consume, an eval request or stop
                # only the part inside the current window: the trainer may have closed the window
                # (take_batch) while this thread waited, and idle_s must never exceed wall_s
                self._window.idle_s += time.perf_counter() - max(started, self._window_start)
            self._publish_status()
            return
        faults.point("rollout", self.ctx.state.step + 1)
        set_threads(self.cores.rollout_threads())  # per thread: the trainer sets its own
        results = self.rollouts.step()
        env_wait = self.rollouts.take_env_wait_s()  # the engine had nothing to decode: episodes on their tools
        self._window.env_wait_s += env_wait
        self._window.busy_s += time.perf_counter() - started - env_wait
        for result in results:
            self._finished(result)
        self._publish_status()

    def _finished(self, result: GenerationResult) -> None:
        flight = self._flights.get(int(result.request_id.split(":")[0]))
        if flight is None or result.request_id not in flight.running:
            return  # a surplus sample that finished in the step its group (or buffer) became full
        del flight.running[result.request_id]
        flight.done.append((int(result.request_id.split(":")[1]), result))
        self._window.generated_tokens += result.sampled_tokens
        self._window.finished_samples += 1
        if len(flight.done) < self.group_size:
            return
        if flight.running:  # group-level redundancy: the group is full, abort its slowest samples
            self.rollouts.abort(list(flight.running))
            self._window.samples_aborted += len(flight.running)
            flight.running.clear()
        results = [r for _, r in sorted(flight.done, key=lambda d: d[0])]
        rewards, parts = score_samples(flight.problem, results, self.ctx.reward_fn, self.ctx.decode)
        group = Group(flight.problem, results, rewards, problem_index=flight.problem_index, ticket=flight.ticket,
                      done_version=self.engine.version, env_faults=self.env_faults, reward_parts=parts)
        slot = flight.slot
        slot.payload = group
        if group.first_version is not None:  # never lower than the admission version it was reserved at
            slot.v_traj = max(slot.v_traj, group.first_version)
        with self._cv:
            del self._flights[flight.ticket]
            if self.drop_zero_variance and not group.has_signal:
                evicted = self.buffer.release(slot)  # frees the entry: a new prompt takes it
                self._window.groups_filtered += 1
            else:
                evicted = self.buffer.complete(slot)
            for other in evicted:
                self._evicted(other)
            self._cv.notify_all()

    def _evicted(self, slot: Slot) -> None:
        """A completed group dropped by the queue, or (batch-level redundancy) a surplus group in flight."""
        if isinstance(slot.payload, Group):
            self._window.groups_dropped += 1
            return
        flight = self._flights.pop(slot.payload)
        self.rollouts.abort(list(flight.running))
        self._window.groups_aborted += 1

    def _publish_status(self) -> None:
        stats = self.engine.stats()
        with self._cv:
            states = self.buffer.states(self.ctx.state.version)
        self.status = LoopStatus(self.engine.version, stats.running, stats.waiting, stats.kv_blocks_used,
                                 stats.kv_blocks_total, len(self._flights),
                                 " ".join(f"v{s.vbuf}:{s.state}" for s in states))

    # ---------------------------------------------------------------- resume
    def _restore(self, saved: dict) -> list[Slot]:
        """Tickets to re-issue and the completed groups of a checkpoint (the buffer takes them back)."""
        self._next_ticket = saved["next_ticket"]
        self._reissue = deque(saved["reissue"])
        return [Slot(item["v_traj"], _group_from_json(item["group"], self.env_faults)) for item in saved["completed"]]


def _group_to_json(group: Group) -> dict:
    return {
        "prompt": group.problem.prompt, "answer": group.problem.answer, "rewards": group.rewards,
        "problem_index": group.problem_index, "ticket": group.ticket, "done_version": group.done_version,
        "reward_parts": group.reward_parts,
        "results": [{"request_id": r.request_id, "prompt_ids": r.prompt_ids, "output_ids": r.output_ids,
                     "logprobs": r.logprobs, "versions": r.versions, "finish_reason": r.finish_reason,
                     "loss_mask": r.loss_mask, "episode": dataclasses.asdict(r.episode) if r.episode else None,
                     "state_version": r.state_version}
                    for r in group.results],
    }


def _group_from_json(data: dict, env_faults: str) -> Group:
    results = [GenerationResult(**{**r, "episode": EpisodeRecord(**r["episode"]) if r.get("episode") else None})
               for r in data["results"]]
    return Group(Problem(data["prompt"], data["answer"]), results,
                 data["rewards"], problem_index=data["problem_index"], ticket=data["ticket"],
                 done_version=data["done_version"], env_faults=env_faults,
                 reward_parts=data.get("reward_parts", {}))  # a checkpoint from before the list form has none
