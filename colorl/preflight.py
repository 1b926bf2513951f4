"""The checks `colorl train` runs before any rank starts; `--dry-run` runs the same ones.

A check that fails on the config, the model or the data raises `ConfigError` (one line, exit 2) in
both. A check that depends on this machine's devices (CUDA present, device count, the CUDA memory
plan) cannot judge a config written for another machine: `--dry-run` reports it as a warning.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from colorl.machine import resolve_device

PROMPTS_CHECKED = 256  # training prompts whose length is checked against the context before launch


class MachineCheckFailed(ValueError):
    """This machine cannot launch the config (no CUDA, too few devices, no SGLang)."""


def check_devices(requested: str, nproc: int, engine: str = "native") -> str:
    """The device the ranks use; `nproc`: ranks on this host. SGLang needs CUDA and its package."""
    import torch

    if engine == "sglang":
        from colorl.engines.sglang import unavailable_reason

        reason = unavailable_reason()
        if reason:
            raise MachineCheckFailed(reason)
    device = resolve_device(requested)
    if device == "cuda" and not torch.cuda.is_available():
        raise MachineCheckFailed("launch.device=cuda: no CUDA device is available here; use --device cpu")
    if device == "cuda" and nproc > torch.cuda.device_count():
        raise MachineCheckFailed(f"launch.nproc={nproc}: only {torch.cuda.device_count()} CUDA devices here")
    return device


def check_resume(cfg, run_dir: Path, step: int, force: bool) -> None:
    """Refuse (ConfigError, one line) a resume whose changed keys alter the data or the shapes, unless
    forced; list the other changes; say at once what is being loaded."""
    from colorl.config import ConfigError
    from colorl.resume import config_changes, last_config
    from colorl.train.checkpoint import checkpoint_dir, has_optimizer_state

    previous = last_config(run_dir)
    refused, warned = config_changes(previous, cfg.model_dump(mode="json")) if previous else ([], [])
    if refused and not force:
        raise ConfigError(f"--resume: these changes alter the data or the shapes of {run_dir}: "
                          f"{'; '.join(map(str, refused))} (pass --force to resume anyway)")
    for change in (refused if force else []) + warned:
        print(f"colorl: warning: --resume with a changed key: {change}", file=sys.stderr)
    if has_optimizer_state(run_dir, step):
        what = "weights, optimizer state, RNG states, data position"
    else:
        what = "weights, RNG states, data position; it kept no optimizer state, so the optimizer starts fresh"
    print(f"resuming from step {step} of {cfg.run.steps}: loading {checkpoint_dir(run_dir, step)} ({what})", flush=True)


def check_user_code(cfg) -> None:
    """The user code a config names imports and fits: the reward function, the environment class and
    its `task.env_options` (ConfigError, one line naming the key)."""
    from colorl.config import ConfigError
    from colorl.envs import EnvError, check_env_options, resolve_env
    from colorl.tasks.rewards import resolve_reward
    from colorl.user_code import UserCodeError

    from colorl.tasks.weighted_rewards import TASK_REWARD

    listed = isinstance(cfg.task.reward, list)
    for i, spec in enumerate(cfg.task.reward if listed else [cfg.task.reward] if cfg.task.reward else []):
        key = f"task.reward[{i}]" if listed else "task.reward"
        if listed and spec == TASK_REWARD:
            continue
        try:
            resolve_reward(spec)
        except UserCodeError as exc:
            also = f" or {TASK_REWARD!r} (the task's own reward)" if listed and str(exc).startswith("expected") else ""
            raise ConfigError(f"{key}={spec!r}: {exc}{also}") from None
    if cfg.task.env:
        try:
            check_env_options(resolve_env(cfg.task.env), cfg.task.env_options)
        except EnvError as exc:
            raise ConfigError(f"task.env: {exc}") from None


def preflight(cfg, device: str = "cpu", here: bool = True) -> list[str]:
    """What would otherwise fail inside the ranks: the user code it names (`check_user_code`); build
    the model folder once (a cached alias),
    load its tokenizer, apply the chat template, draw a problem, fit the context; on CUDA, the
    memory plan. Returns warnings to print (the run goes on).

    `here`: the run would start on this machine. A config for another machine (`--dry-run` of an
    8-GPU config on a laptop) skips the memory plan, and a hub model this machine cannot reach
    skips the model checks, each with a warning."""
    from transformers import AutoConfig

    from colorl.config import ConfigError
    from colorl.engines import engine_class
    from colorl.models import (
        ALIASES, ModelNotFound, cache_root, context_length, is_hub_id, load_tokenizer,
        resolve_model_path,
    )
    from colorl.tasks import build_task
    from colorl.tasks.chat import problem_ids

    check_user_code(cfg)
    cached = cache_root() / "models" / cfg.model.path
    building = cfg.model.path in ALIASES and not (cached / "config.json").is_file()
    if building:
        print(f"preparing {cfg.model.path} once: writing a Hugging Face folder to {cached} ...", flush=True)
    started = time.perf_counter()
    try:
        model_dir = resolve_model_path(cfg.model.path)
    except ModelNotFound as exc:
        if not here and is_hub_id(cfg.model.path):
            return [f"{exc}: the tokenizer, chat template and context checks were skipped"]
        raise ConfigError(str(exc)) from None
    if building:
        print(f"prepared {cfg.model.path} in {time.perf_counter() - started:.0f} s (later runs reuse it)", flush=True)
    refusal = engine_class(cfg.rollout.engine).model_refusal(AutoConfig.from_pretrained(model_dir), device)
    if refusal:
        raise ConfigError(f"model.path={cfg.model.path!r}: {refusal}")
    task = build_task(cfg.task, cfg.run.seed)
    problems = [task.train_problem(i) for i in range(PROMPTS_CHECKED)] + task.eval_problems(cfg.run.eval_prompts)
    tokenizer = load_tokenizer(model_dir)
    try:
        longest = max(len(problem_ids(tokenizer, p, cfg.model.system_prompt)) for p in problems)
    except Exception as exc:  # tokenizer / template errors come in many types
        raise ConfigError(f"model.path={cfg.model.path!r}: cannot build a chat prompt "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    if cfg.task.env:
        _check_episodes(cfg, tokenizer)
    context = context_length(model_dir)
    if context is not None and longest + cfg.rollout.max_new_tokens > context:
        raise ConfigError(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}: with the longest prompt "
                          f"({longest} tokens) it exceeds the model's context of {context} tokens; "
                          f"use at most {context - longest}")
    if device == "cuda" and here:
        import torch

        from colorl.plan import plan_for_run

        plan = plan_for_run(cfg, model_dir, torch.cuda.get_device_properties(0).total_memory)
        if not plan.fits:
            print(plan.render(), file=sys.stderr)
            raise ConfigError(f"{plan.verdict()} (`colorl plan` shows this table before launch)")
    return [note for note in (cpu_bf16_note(cfg, device), truncated_sampling_note(cfg)) if note]


def truncated_sampling_note(cfg) -> str | None:
    """top-p / top-k: the engine samples from a renormalised truncated distribution μ and the trainer
    scores the whole softmax π, so the IS weights π/μ sit below 1 by design (docs/grpo.md)."""
    rollout = cfg.rollout
    if rollout.top_p == 1.0 and rollout.top_k == 0:
        return None
    keys = ", ".join(k for k, on in ((f"rollout.top_p={rollout.top_p:g}", rollout.top_p < 1),
                                     (f"rollout.top_k={rollout.top_k}", rollout.top_k > 0)) if on)
    return (f"{keys}: truncated sampling, so is_weight_mean is the kept probability mass (below 1), not a "
            "sign of engine mismatch (docs/grpo.md)")


def _check_episodes(cfg, tokenizer) -> None:
    """Multi-turn episodes need a chat template that extends a conversation turn by turn."""
    from colorl.config import ConfigError
    from colorl.envs import ConversationError, check_template, resolve_env

    try:
        check_template(tokenizer, resolve_env(cfg.task.env).tools)
    except ConversationError as exc:
        raise ConfigError(f"task.env={cfg.task.env!r} with model.path={cfg.model.path!r}: {exc}") from None


def cpu_bf16_note(cfg, device: str) -> str | None:
    """bf16 on an x86 CPU whose oneDNN has no bf16 products (AVX2-only): it runs, on torch's generic
    kernels, but slower than float32 — say so before the user waits for it."""
    if device != "cpu" or "bfloat16" not in (cfg.model.dtype, cfg.train.mixed_precision):
        return None
    import torch

    from colorl.kernels import bf16_widened, onednn_available, onednn_dtypes

    if not onednn_available() or torch.bfloat16 in onednn_dtypes():
        return None
    key = "model.dtype" if cfg.model.dtype == "bfloat16" else "train.mixed_precision"
    how = ("colorl runs bf16 products as float32 products over the bf16 values, no faster than float32"
           if bf16_widened() else "bf16 runs on torch's generic kernels, several times slower than float32")
    return (f"{key}=bfloat16: this CPU has no bf16 matrix products (they need AVX-512 BF16, AMX or "
            f"AVX-NE-CONVERT), so {how} here; for speed use float32 (unset {key})")


