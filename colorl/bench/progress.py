"""Terminal progress of a bench: which variant, step k/N, ETA. A live bar on a terminal, one
plain line per step otherwise (logs, CI)."""
from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class BenchProgress:
    def __init__(self, total_variants: int, console: Console | None = None) -> None:
        self.console = console or Console()
        self.total = total_variants
        self.live = self.console.is_terminal
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("steps"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                  console=self.console, disable=not self.live)
        self._task = None
        self._label, self._steps, self._started, self._done = "", 0, 0.0, 0

    def __enter__(self) -> BenchProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()

    def start(self, index: int, name: str, steps: int) -> None:
        self._label, self._steps, self._started, self._done = f"[{index}/{self.total}] {name}", steps, time.time(), 0
        if self.live:
            self._task = self._progress.add_task(self._label, total=steps)
        else:
            print(f"bench {self._label}: starting, {steps} steps", flush=True)

    def step(self, done: int) -> None:
        if done == self._done:
            return
        self._done = done
        if self.live:
            self._progress.update(self._task, completed=done)
            return
        elapsed = time.time() - self._started
        eta = elapsed / done * (self._steps - done) if done else float("nan")
        print(f"bench {self._label}: step {done}/{self._steps} elapsed {elapsed:.0f}s eta {eta:.0f}s", flush=True)

    def finish(self, text: str) -> None:
        if self.live and self._task is not None:
            self._progress.update(self._task, description=f"{self._label} · {text}")
        else:
            print(f"bench {self._label}: {text}", flush=True)
