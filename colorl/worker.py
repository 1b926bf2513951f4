"""One rank of a run: builds the engine, the trainer, the task and the run directory, then runs the mode.

Everything a mode needs is gathered in `RankContext`, so a mode's loop reads as the algorithm.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from colorl import distributed, faults, precision
from colorl.config import Config, dump_config
from colorl.engines import build_engine, engine_class
from colorl.engines.base import Engine
from colorl.engines.engine_log import EngineLog
from colorl.evaluate import EvalResult, evaluate
from colorl.files import write_atomic
from colorl.metrics.display import Display
from colorl.metrics.logger import MetricsWriter, read_metrics
from colorl.modes.cores import CoreShare
from colorl.rollout.episodes import EpisodeSetup
from colorl.models import context_length, eos_token_ids, load_tokenizer, resolve_model_path
from colorl.staleness.live import predicted_staleness_for
from colorl.tasks import Problem, Task, build_task
from colorl.tasks.chat import problem_ids
from colorl.tasks.rewards import RewardCounters, SandboxedReward
from colorl.tasks.weighted_rewards import WeightedRewards, reward_terms
from colorl.threads import pinned
from colorl.train.checkpoint import (
    TrainerState, drop_older_optimizer_states, latest_step, load_checkpoint, prune_checkpoints, read_rank_file,
    save_checkpoint,
)
from colorl.train.policy import PolicyTrainer

ROLLOUT_STATE = "rollout"  # per-rank file of a bounded-lag checkpoint
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RankContext:
    cfg: Config
    rank: int
    world: int
    device: str
    run_dir: Path
    tokenizer: object
    task: Task
    reward_fn: object
    reward_counters: RewardCounters
    engine: Engine
    trainer: PolicyTrainer
    weight_sync: object
    state: TrainerState
    metrics: MetricsWriter | None
    display: Display
    stop_ids: tuple[int, ...]
    nonfinite: faults.NonFiniteGuard
    episodes: EpisodeSetup | None = None  # task.env: samples are multi-turn episodes
    resumed_from: int | None = None  # checkpoint step the run resumed from
    history: list[dict] = field(default_factory=list)
    # this rank's intra-op thread budget, as the launcher set it from the cores the rank may use
    rank_threads: int = field(default_factory=torch.get_num_threads)
    _prompt_cache: dict[Problem, list[int]] = field(default_factory=dict)

    @property
    def groups_per_rank(self) -> int:
        return self.cfg.rollout.batch_groups // self.world

    def prompt_ids(self, problem: Problem) -> list[int]:
        if problem not in self._prompt_cache:
            self._prompt_cache[problem] = problem_ids(self.tokenizer, problem, self.cfg.model.system_prompt)
        return self._prompt_cache[problem]

    def problem_indices(self, step: int) -> range:
        """This rank's slice of step `step`'s problems in the task's one seeded stream."""
        start = step * self.cfg.rollout.batch_groups + self.rank * self.groups_per_rank
        return range(start, start + self.groups_per_rank)

    def sample_seed(self, step: int) -> int:
        """Sampling seeds depend only on (run seed, step, rank), so a resumed run redraws the same samples."""
        return (self.cfg.run.seed * 1_000_003 + step) * 1_009 + self.rank

    def should_save(self) -> bool:
        every, step = self.cfg.run.save_every, self.state.step
        return step == self.cfg.run.steps or (every > 0 and step % every == 0)

    def log_step(self, record: dict, groups=()) -> None:
        """The step's metrics; every `run.log_samples_every` steps also a few of its samples, decoded."""
        if self.rank != 0:
            return
        self.metrics.write(record)
        self.history.append(record)
        self.display.step_done(record)
        every = self.cfg.run.log_samples_every
        if every and groups and (record["step"] % every == 0 or record["step"] == self.cfg.run.steps):
            from colorl.metrics.samples import append_samples, sample_records, screen_lines

            samples = sample_records(record["step"], groups, self.decode)
            append_samples(self.run_dir, samples)
            for line in screen_lines(samples):
                self.display.message(line)

    def predicted_staleness(self, rho: float, m_tail: float) -> float:
        """Forecast from this run's own measured ρ and M_tail (0 in colocated mode, by construction)."""
        return predicted_staleness_for(self.cfg, rho, m_tail)

    def maybe_evaluate(self, run_eval=None) -> dict:
        """Held-out greedy accuracy (`eval_accuracy`; with episodes also `eval_tool_use_frac`) every
        `run.eval_every` steps and after the last one (each rank takes a slice), else None values.

        run_eval: how to run it on this rank's engine (bounded-lag mode hands the eval to its rollout
        thread); by default the engine is woken for it and put back to sleep at level 1.
        """
        every, step = self.cfg.run.eval_every, self.state.step
        if not every or (step % every and step != self.cfg.run.steps):  # the last step always: before → after
            return {"eval_accuracy": None}
        faults.point("eval", self.state.step)
        problems = self.task.eval_problems(self.cfg.run.eval_prompts)[self.rank::self.world]
        if run_eval is None:
            self.wake_engine()
            result = self.evaluate_problems(problems)
            # level 1 whatever the run's sleep level: the weights are current and no sync comes
            # before the next wake to restore them, which level 2 would require
            self.engine.sleep(1)
        else:
            result = run_eval(problems)
        totals = torch.tensor([result.accuracy * result.problems, float(result.problems),
                               (result.tool_use or 0.0) * result.problems], dtype=torch.float64)
        dist.all_reduce(totals)
        if not totals[1]:
            return {"eval_accuracy": None}
        tool_use = {"eval_tool_use_frac": float(totals[2] / totals[1])} if self.episodes else {}
        return {"eval_accuracy": float(totals[0] / totals[1]), **tool_use}

    def close(self) -> None:
        """After the mode's loop, however it ended: the end table, the metrics files, the reward sandbox."""
        self.display.close(self.history)
        if self.metrics is not None:
            from colorl.plot import tracker_charts

            self.metrics.close(lambda folder: tracker_charts(self.run_dir, folder))
        if isinstance(self.reward_fn, (SandboxedReward, WeightedRewards)):
            self.reward_fn.close()

    def hand_off_memory(self) -> None:
        """Give the device memory this process cached back before the engine maps any of it again (an
        engine in another process can only use what this process has returned): before a wake, and
        after training, since a sync at sleep level 2 maps the engine's weights back first."""
        distributed.release_cached_device_memory(self.device)

    def wake_engine(self) -> None:
        """Wake the engine after training or a sync: first the memory hand-off."""
        self.hand_off_memory()
        self.engine.wake()

    def evaluate_problems(self, problems: list) -> EvalResult:
        return evaluate(self.engine, problems, self.reward_fn, self.tokenizer, self.cfg.rollout.max_new_tokens,
                        system_prompt=self.cfg.model.system_prompt, stop_ids=self.stop_ids, episodes=self.episodes)

    def report_initial_eval(self, run_eval=None) -> None:
        """The baseline the periodic evals compare against, shown before the first step."""
        self.display.phase("held-out eval before step 1")
        result = self.maybe_evaluate(run_eval)
        if result["eval_accuracy"] is not None:
            self.event(f"eval_accuracy step=0 {result['eval_accuracy']:.4f}")
            if "eval_tool_use_frac" in result:
                self.event(f"eval_tool_use_frac step=0 {result['eval_tool_use_frac']:.4f}")
            self.display.initial_accuracy(result["eval_accuracy"], result.get("eval_tool_use_frac"))

    def check_numerics(self, train, rollout_state=None) -> None:
        """After a step is logged: the Nth non-finite loss or gradient norm in a row saves the last
        good step as the newest checkpoint and stops the run, saying why.
        rollout_state: bounded-lag mode's snapshot function, for that checkpoint."""
        last_good = self.nonfinite.observe(train.loss, train.grad_norm, self.state)
        if last_good is None:
            return
        first_bad, limit = self.state.step - self.nonfinite.limit + 1, self.nonfinite.limit
        self.state = last_good
        self.save(rollout_state() if rollout_state is not None else None)
        raise faults.RunFault(
            f"stopped: {limit} non-finite losses or gradient norms in a row (steps {first_bad}-{first_bad + limit - 1}, "
            f"train.max_nonfinite_in_a_row={limit}); checkpoint step_{last_good.step} holds the last good step: "
            f"lower train.lr or check the rewards, then --resume")

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def event(self, text: str, all_ranks: bool = False) -> None:
        if self.rank == 0 or all_ranks:
            with open(self.run_dir / "events.log", "a", encoding="utf-8") as handle:
                handle.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {text}\n")

    def save(self, rollout_state: dict | None = None) -> None:
        """A checkpoint; bounded-lag mode adds its rollout state (completed groups, tickets in flight)."""
        rank_files = {ROLLOUT_STATE: json.dumps(rollout_state)} if rollout_state is not None else {}
        path = save_checkpoint(self.run_dir, self.trainer.model, self.trainer.optimizer, self.state, rank_files)
        self.event(f"checkpoint step={self.state.step} path={path}")
        for step in prune_checkpoints(self.run_dir, self.cfg.run.keep_checkpoints):
            self.event(f"checkpoint step={step} deleted (run.keep_checkpoints={self.cfg.run.keep_checkpoints})")
        if self.cfg.run.optimizer_state == "newest":
            for step in drop_older_optimizer_states(self.run_dir):
                self.event(f"checkpoint step={step} optimizer state deleted (run.optimizer_state=newest)")

    def load_rollout_state(self) -> dict | None:
        """This rank's bounded-lag rollout state from the checkpoint the run resumed from, if any."""
        if self.resumed_from is None:
            return None
        text = read_rank_file(self.run_dir, self.resumed_from, ROLLOUT_STATE)
        return json.loads(text) if text is not None else None

    def core_share(self) -> CoreShare:
        """How bounded-lag mode's two loops share this rank's cores while both work."""
        return CoreShare.of_rank(self.cfg.launch, self.rank_threads)


class StopRequest:
    """Ctrl-C / SIGTERM set a flag; ranks agree on it at step boundaries, then save and exit."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def agreed(self) -> bool:
        flag = torch.tensor([1 if self.requested else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def prepare_run_dir(cfg: Config, run_dir: Path, resume: bool) -> None:
    """Rank 0 only. A fresh run never overwrites an existing one; config.yaml is written atomically."""
    has_run = (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists()
    if has_run and not resume:
        hint = ("pass --resume" if latest_step(run_dir) is not None
                else "it has no checkpoint to resume from: delete it")
        raise FileExistsError(f"run directory {run_dir} already holds a run; {hint} or choose another run.name")
    run_dir.mkdir(parents=True, exist_ok=True)
    # config.yaml is the config of the run's steps (export reads it); a resume records its own next to it
    name = f"config.resume-{int(time.time())}.yaml" if resume else "config.yaml"
    write_atomic(run_dir / name, dump_config(cfg))


def build_context(cfg: Config, rank: int, world: int, device: str, run_dir: Path, resume: bool) -> RankContext:
    from colorl.verdicts import record_in_run

    device = distributed.rank_device(device)  # "cuda:N" from here on: threads the rank starts use it too
    engine_cls = engine_class(cfg.rollout.engine)
    for key, value in engine_cls.process_env.items():  # a user's setting wins
        os.environ.setdefault(key, value)
    torch.manual_seed(cfg.run.seed + rank)
    record_in_run(run_dir / "kernels.json")  # every rank, and a resume, compute with the kernels the run chose
    if rank == 0:
        resolve_model_path(cfg.model.path)  # builds a cached alias once, before the others read it
    dist.barrier()
    model_dir = resolve_model_path(cfg.model.path)
    dtype = DTYPES[cfg.model.dtype]
    tokenizer = load_tokenizer(model_dir)
    task = build_task(cfg.task, cfg.run.seed)
    counters = RewardCounters()
    terms = reward_terms(cfg.task)
    if terms:
        reward_fn = WeightedRewards.build(terms, task.reward, cfg.task.reward_timeout_s, counters)
    elif cfg.task.reward:
        reward_fn = SandboxedReward(cfg.task.reward, cfg.task.reward_timeout_s, counters)
    else:
        reward_fn = task.reward
    trainer = PolicyTrainer(model_dir, cfg, device, dtype)
    # the unsharded model went through the device before FSDP2 sharded it; its blocks stay in this
    # process's cache until handed back, and an engine that sizes its KV pool from the free memory
    # (SGLang, in its own process) would lose them: give them back first, as `colorl plan` assumes
    distributed.release_cached_device_memory(device)
    # C = rollout.concurrency counts sequences in flight over all ranks; each engine takes its share
    per_rank_concurrency = -(-cfg.rollout.concurrency // world)
    backup = cfg.engine.weights_cpu_backup or (cfg.model.lora is not None and cfg.sleep_level == 2)
    engine_cfg = cfg.engine.model_copy(update={"max_num_seqs": min(cfg.engine.max_num_seqs, per_rank_concurrency),
                                               "weights_cpu_backup": backup,
                                               "in_flight_updates": cfg.mode == "bounded_lag"})
    engine_dtype = precision.served_dtype(cfg, device)  # the checkpoint engine casts to it
    threads = torch.get_num_threads()
    if cfg.mode == "bounded_lag" and engine_cls.keeps_build_threads:
        threads = CoreShare.of_rank(cfg.launch, threads).rollout  # it keeps the rollout loop's share
    engine_log = EngineLog.of_run(run_dir, rank)
    with pinned(threads), engine_log.capturing() if engine_cls.log_names else contextlib.nullcontext():
        engine = build_engine(cfg.rollout.engine, model_dir, engine_cfg, device, engine_dtype)
    if engine_cls.log_names:
        engine_log.route(engine_cls.log_names)
    from colorl.sync.checkpoint_engine import CheckpointEngine

    weight_sync = CheckpointEngine(trainer.model, engine, cfg.sync, cfg.model.lora)
    state = TrainerState()
    step = latest_step(run_dir) if resume else None
    if step is not None:
        state = load_checkpoint(run_dir, step, trainer.model, trainer.optimizer)
    stop_ids = tuple(sorted(eos_token_ids(model_dir, tokenizer=tokenizer)))
    metrics = MetricsWriter.for_run(run_dir, cfg) if rank == 0 else None
    ranks = f"{world} rank{'s' if world > 1 else ''} × {device}"
    display = Display(cfg.run.steps, state.step, f"{cfg.run.name} · {cfg.mode} · {cfg.rollout.engine} · {ranks}",
                      enabled=rank == 0, eta=cfg.staleness.max if cfg.mode == "bounded_lag" else None,
                      episodes=cfg.task.env is not None, temperature=cfg.rollout.temperature,
                      reward_names=[t.name for t in terms])
    nonfinite = faults.NonFiniteGuard(cfg.train.max_nonfinite_in_a_row, last_good=state)
    ctx = RankContext(cfg, rank, world, device, run_dir, tokenizer, task, reward_fn, counters, engine, trainer,
                      weight_sync, state, metrics, display, stop_ids, nonfinite,
                      episodes=EpisodeSetup.from_config(cfg.task, cfg.rollout, tokenizer, context_length(model_dir),
                                                        device),
                      resumed_from=step)
    if rank == 0:
        ctx.history = [r for r in read_metrics(run_dir) if r["step"] <= state.step]
    ctx.event(f"rank {rank} pid {os.getpid()} start step={state.step} world={world} device={device} "
              f"resume={resume} sync={weight_sync.transport} attention={trainer.attention}", all_ranks=True)
    return ctx


def run_rank(rank: int, world: int, cfg_dict: dict, run_dir: str, resume: bool, device: str) -> None:
    """Entry point of a worker process (the process group is already initialised)."""
    from colorl.config import validate
    from colorl.modes import MODES

    cfg = validate(cfg_dict)
    stop = StopRequest()
    ctx = build_context(cfg, rank, world, device, Path(run_dir), resume)
    ctx.display.message(precision.choose(cfg, ctx.device).line(cfg.model.dtype))  # what `auto` became, and why
    try:
        MODES[cfg.mode](ctx, stop)
    finally:
        ctx.close()
