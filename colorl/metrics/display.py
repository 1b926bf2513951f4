"""What the user watches: a rich live panel on a terminal, one plain line per step otherwise."""
from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

_SHOWN = (
    ("reward", "reward_mean", "{:.3f}"), ("accuracy", "accuracy", "{:.1%}"),
    ("resp len", "response_len_mean", "{:.1f}"), ("staleness", "staleness_mean", "{:.2f}"),
    ("rollout tok/s", "rollout_tokens_per_s", "{:.0f}"), ("train tok/s", "train_tokens_per_s", "{:.0f}"),
    ("rollout s", "time_rollout_s", "{:.1f}"), ("train s", "time_train_s", "{:.1f}"),
    ("sync s", "time_sync_s", "{:.2f}"), ("loss", "loss", "{:+.4f}"), ("eval acc", "eval_accuracy", "{:.1%}"),
)


def _fmt(fmt: str, value) -> str:
    return "-" if value is None else fmt.format(value)


class Display:
    def __init__(self, total_steps: int, first_step: int, title: str, enabled: bool = True) -> None:
        self.console = Console(stderr=False)
        self.total, self.first, self.title = total_steps, first_step, title
        self.enabled = enabled
        self.live_mode = enabled and self.console.is_terminal
        self.phase_name, self.step, self.last = "start", first_step, {}
        self.loop_rows: list[tuple[str, str]] = []  # bounded-lag: engine, trainer and buffer status
        self.started = time.perf_counter()
        self._live = Live(self._render(), console=self.console, refresh_per_second=4) if self.live_mode else None
        if self._live is not None:
            self._live.start()

    def _eta(self) -> str:
        done = self.step - self.first
        if done <= 0:
            return "?"
        remaining = (time.perf_counter() - self.started) / done * (self.total - self.step)
        return time.strftime("%M:%S", time.gmtime(remaining)) if remaining < 3600 else f"{remaining / 3600:.1f}h"

    def _render(self) -> Table:
        table = Table(title=f"colorl · {self.title}", show_header=False, expand=False)
        table.add_row("step", f"{self.step}/{self.total}   ETA {self._eta()}   phase: [bold]{self.phase_name}[/]")
        for label, key, fmt in _SHOWN:
            table.add_row(label, _fmt(fmt, self.last.get(key)))
        for label, text in self.loop_rows:
            table.add_row(label, text)
        return table

    def phase(self, name: str) -> None:
        self.phase_name = name
        if self._live is not None:
            self._live.update(self._render())

    def loops(self, status) -> None:
        """Both loops of bounded-lag mode at once, refreshed while the trainer waits."""
        self.loop_rows = [
            ("engine", f"v{status.engine_version}  running {status.running}  waiting {status.waiting}  "
                       f"KV {status.kv_used}/{status.kv_total}  groups in flight {status.in_flight_groups}"),
            ("trainer", self.phase_name),
            ("buffers", status.buffers or "-"),
        ]
        if self._live is not None:
            self._live.update(self._render())

    def step_done(self, record: dict) -> None:
        self.step, self.last = record["step"], record
        if self._live is not None:
            self._live.update(self._render())
        elif self.enabled:
            parts = " ".join(f"{label}={_fmt(fmt, record.get(key))}" for label, key, fmt in _SHOWN)
            print(f"step {self.step}/{self.total} eta={self._eta()} {parts}", flush=True)

    def message(self, text: str) -> None:
        if self.enabled:
            self.console.print(text)
            sys.stdout.flush()

    def close(self, history: list[dict]) -> None:
        if self._live is not None:
            self._live.stop()
        if not self.enabled or not history:
            return
        summary = Table(title="colorl · summary")
        for column in ("step", "reward", "accuracy", "resp len", "loss", "step s"):
            summary.add_column(column, justify="right")
        for record in history:
            summary.add_row(str(record["step"]), _fmt("{:.3f}", record.get("reward_mean")),
                            _fmt("{:.1%}", record.get("accuracy")), _fmt("{:.1f}", record.get("response_len_mean")),
                            _fmt("{:+.4f}", record.get("loss")), _fmt("{:.1f}", record.get("time_step_s")))
        self.console.print(summary)
