"""Colocated sync mode: the engine and the trainer take turns on the same device (DESIGN.md, 7 phases).

    for each step:
        wake engine -> rollout on version v -> sleep engine
        onload trainer -> train (v -> v+1) -> offload trainer
        checkpoint engine publishes v+1 into every rank's engine
"""
from __future__ import annotations

import time

from colorl import faults
from colorl.modes.step_metrics import StepTimes, step_record
from colorl.rollout.collect import collect_groups
from colorl.rollout.episodes import Rollouts
from colorl.train.batch import build_batch


def run_colocated(ctx, stop) -> None:
    cfg, engine, trainer = ctx.cfg, ctx.engine, ctx.trainer
    if ctx.state.step == 0 or ctx.engine.version != ctx.state.version:
        ctx.weight_sync.sync(engine, ctx.state.version)  # engines start from the trainer's weights
    if ctx.state.step == 0:
        ctx.report_initial_eval()
    rollouts = Rollouts(engine, ctx.episodes)  # completions, or episodes with an environment (task.env)
    while ctx.state.step < cfg.run.steps:
        times = StepTimes()
        ctx.display.phase("rollout")
        ctx.wake_engine()  # after the memory hand-off
        faults.point("rollout", ctx.state.step + 1)
        indices = list(ctx.problem_indices(ctx.state.step))
        problems = [ctx.task.train_problem(i) for i in indices]
        groups = collect_groups(rollouts, problems, [ctx.prompt_ids(p) for p in problems], cfg.rollout,
                                ctx.reward_fn, ctx.decode, ctx.sample_seed(ctx.state.step), ctx.stop_ids, indices,
                                cfg.filter.env_faults)
        engine.sleep(cfg.sleep_level)
        times.rollout, times.env_wait = time.perf_counter() - times.start, rollouts.take_env_wait_s()
        times.phase_done("rollout")

        ctx.display.phase("train")
        trainer.onload()
        faults.point("train", ctx.state.step + 1)
        batch = build_batch(groups, cfg.loss.std_norm, ctx.tokenizer.pad_token_id,
                            drop_zero_variance=cfg.filter.zero_variance)
        train_stats = trainer.train_step(batch)
        trainer.offload()
        ctx.hand_off_memory()  # at sleep level 2 the sync maps the engine's weights back first
        times.train = time.perf_counter() - times.start - times.rollout
        times.phase_done("train")

        ctx.display.phase("sync")
        faults.point("sync", ctx.state.step + 1)
        sync_stats = ctx.weight_sync.sync(engine, ctx.state.version + 1)
        times.sync = time.perf_counter() - times.start - times.rollout - times.train
        times.phase_done("sync")

        ctx.state.step += 1
        ctx.state.version += 1
        ctx.state.data_position += cfg.rollout.batch_groups
        record = step_record(ctx, groups, train_stats, sync_stats, times, trained_version=ctx.state.version - 1)
        ctx.log_step({**record, **ctx.maybe_evaluate()}, groups)
        ctx.check_numerics(train_stats)
        stopping = stop.agreed()
        if stopping or ctx.should_save():
            ctx.save()
        if stopping:
            ctx.event(f"stopped by signal after step {ctx.state.step}")
            return
