"""Built-in tasks (registered on import) and the factory the run uses."""
from __future__ import annotations

from colorl.tasks import arithmetic, countdown, hf_dataset, jsonl  # noqa: F401  (registration)
from colorl.tasks.base import TASKS, Problem, Task, TaskOptionError


FILE_TASKS = ("jsonl", "hf_dataset")  # tasks that read task.path / task.eval_path


def build_task(task_cfg, seed: int) -> Task:
    factory = TASKS[task_cfg.name]
    try:
        if task_cfg.name in FILE_TASKS:
            return factory(seed, dict(task_cfg.options), task_cfg.path, task_cfg.eval_path)
        return factory(seed, dict(task_cfg.options))
    except (TaskOptionError, ValueError) as exc:
        raise TaskOptionError(str(exc)) from None


__all__ = ["build_task", "Problem", "Task", "TASKS"]
