"""Bounded-lag mode: the engine keeps decoding while the trainer trains, on the same devices.

    rollout thread (colorl/rollout/producer.py), without pause:
        admit a prompt when Reserve succeeds -> engine.step() -> reward -> Occupy
        at each engine step boundary: apply the newest published version (partial rollout)
    trainer thread (here), for each step:
        wait until this rank's buffer for version v is Ready -> train (v -> v+1)
        publish v+1 through the checkpoint engine (an all-gather; collectives stay on this thread)

No group is trained with staleness above η = `staleness.max` (for the bounded buffers
`staleflow` and `queue_max`; `queue_drop` bounds the queue, not staleness). Ranks train in
lock-step: each step's first collective waits for every rank's buffer. With η = 0 the rollout
thread can only fill buffer v at version v, so the mode trains on exactly colocated mode's data.

Deviations from StaleFlow (seeds/staleflow-paper.txt §4-5), on purpose for one box:
1. One buffer protocol per rank with G/world entries per version (no global coordinator): groups
   stay on the rank that generated them, like colocated mode's data.
2. No trajectory migration between instances and no parameter server: a rank's engine pulls the
   newest published version at its own step boundary.
3. V_traj is reserved with the engine's version at admission and raised to the version of the
   group's first generated token at Occupy (never lower, so the bound still holds).
"""
from __future__ import annotations

import math
import time

from colorl import faults
from colorl.buffer import make_buffer
from colorl.modes.cores import follow_in_training
from colorl.modes.step_metrics import StepTimes, step_record
from colorl.rollout.producer import RolloutProducer
from colorl.threads import set_threads
from colorl.train.batch import build_batch


def run_bounded_lag(ctx, stop) -> None:
    cfg, engine, trainer = ctx.cfg, ctx.engine, ctx.trainer
    if ctx.state.step == 0 or engine.version != ctx.state.version:
        ctx.weight_sync.sync(engine, ctx.state.version)  # engines start from the trainer's weights
    if ctx.state.step == 0:
        ctx.report_initial_eval(ctx.evaluate_problems)  # the engine stays awake: no sleep in this mode
    cores = ctx.core_share()
    producer = RolloutProducer(ctx, _rank_buffer(ctx), cores, saved=ctx.load_rollout_state())
    if producer.dropped_on_resume:
        ctx.event(f"resume: {producer.dropped_on_resume} saved groups no longer fit within eta and were dropped")
    following = follow_in_training(trainer.model, cores)  # the trainer's threads follow the engine's idling
    producer.start()
    try:
        while ctx.state.step < cfg.run.steps:
            times = StepTimes()
            ctx.display.phase("wait")
            groups, window, times.trainer_wait = producer.take_batch(
                ctx.state.version, on_wait=lambda: ctx.display.loops(producer.status))

            times.phase_done("wait")

            ctx.display.phase("train")
            trainer.onload()
            faults.point("train", ctx.state.step + 1)
            started = time.perf_counter()
            batch = build_batch(groups, cfg.loss.std_norm, ctx.tokenizer.pad_token_id)
            set_threads(cores.train_threads())  # then again at each decoder layer
            train_stats = trainer.train_step(batch)
            trainer.offload()
            times.train = time.perf_counter() - started
            times.phase_done("train")

            ctx.display.phase("publish")
            faults.point("sync", ctx.state.step + 1)
            started = time.perf_counter()
            sync_stats = ctx.weight_sync.publish(ctx.state.version + 1).stats
            producer.notify()  # the rollout thread applies it at its next engine step boundary
            times.sync, times.rollout = time.perf_counter() - started, window.busy_s
            times.phase_done("publish")

            ctx.state.step += 1
            ctx.state.version += 1
            ctx.state.data_position += cfg.rollout.batch_groups
            record = step_record(ctx, groups, train_stats, sync_stats, times,
                                 trained_version=ctx.state.version - 1, window=window)
            ctx.log_step({**record, **ctx.maybe_evaluate(producer.evaluate)}, groups)
            ctx.check_numerics(train_stats, producer.snapshot)
            stopping = stop.agreed()
            if stopping or ctx.should_save():
                ctx.save(rollout_state=producer.snapshot())
            if stopping:
                ctx.event(f"stopped by signal after step {ctx.state.step}")
                return
    finally:
        producer.stop()
        for hook in following:
            hook.remove()


def _rank_buffer(ctx):
    """This rank's staleness buffer: G/world groups per version (plus batch-level redundancy's surplus)."""
    cfg = ctx.cfg.staleness
    surplus = math.ceil(ctx.groups_per_rank * cfg.redundancy.ratio) if cfg.redundancy and cfg.redundancy.level == "batch" else 0
    return make_buffer(cfg.buffer, ctx.groups_per_rank, cfg.queue_factor, cfg.max, surplus)
