"""What the user watches: a rich live panel on a terminal, one plain line per step otherwise.

Two accuracies are shown and labelled apart: `train acc (T=1)` is the share of this step's
training samples (drawn at the rollout temperature) that were right; `held-out (greedy)` is the
periodic evaluation on prompts never trained on. The ETA uses the median wall time of the
steps after the first one this process ran (which carries warm-up and the initial evaluation).
"""
from __future__ import annotations

import statistics
import sys
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

_SHOWN = (
    ("reward", "reward_mean", "{:.3f}"), ("train acc (T=1)", "accuracy", "{:.1%}"),
    ("held-out (greedy)", "eval_accuracy", "{:.1%}"),
    ("resp len", "response_len_mean", "{:.1f}"), ("staleness", "staleness_mean", "{:.2f}"),
    ("rollout tok/s", "rollout_tokens_per_s", "{:.0f}"), ("train tok/s", "train_tokens_per_s", "{:.0f}"),
    ("rollout s", "time_rollout_s", "{:.1f}"), ("train s", "time_train_s", "{:.1f}"),
    ("sync s", "time_sync_s", "{:.2f}"), ("loss", "loss", "{:+.4f}"),
)
LABEL_WIDTH, VALUE_WIDTH = 18, 64  # fixed, so the panel does not change width as values change


def _fmt(fmt: str, value) -> str:
    return "-" if value is None else fmt.format(value)


def eta_seconds(step_ends: list[float], done: int, total: int) -> float | None:
    """Remaining time from the median interval between step ends, never from the first step alone.

    `step_ends[0]` is when this process started stepping; the first interval (warm-up, initial
    evaluation) is left out, so the ETA appears from the second step on.
    """
    intervals = [b - a for a, b in zip(step_ends[1:], step_ends[2:])]
    if not intervals:
        return None
    return statistics.median(intervals) * max(0, total - done)


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "after step 2"
    return time.strftime("%M:%S", time.gmtime(seconds)) if seconds < 3600 else f"{seconds / 3600:.1f}h"


class Display:
    def __init__(self, total_steps: int, first_step: int, title: str, enabled: bool = True) -> None:
        self.console = Console(stderr=False)
        self.total, self.first, self.title = total_steps, first_step, title
        self.enabled = enabled
        self.live_mode = enabled and self.console.is_terminal
        self.phase_name, self.step, self.last = "start", first_step, {}
        self.loop_rows: list[tuple[str, str]] = []  # bounded-lag: engine, trainer and buffer status
        self.step_ends = [time.perf_counter()]
        self.baseline: float | None = None
        self._live = Live(self._render(), console=self.console, refresh_per_second=4) if self.live_mode else None
        if self._live is not None:
            self._live.start()

    def _eta(self) -> str:
        return _clock(eta_seconds(self.step_ends, self.step, self.total))

    def _render(self) -> Table:
        table = Table(title=f"colorl · {self.title}", show_header=False, expand=False)
        table.add_column(width=LABEL_WIDTH, no_wrap=True)
        table.add_column(width=VALUE_WIDTH, no_wrap=True)
        table.add_row("step", f"{self.step}/{self.total}   ETA {self._eta()}   phase: [bold]{self.phase_name}[/]")
        for label, key, fmt in _SHOWN:
            value = _fmt(fmt, self.last.get(key))
            if key == "eval_accuracy" and self.baseline is not None:
                value = f"{value}  (before training {self.baseline:.1%})"
            table.add_row(label, value)
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
        self.step, self.last = record["step"], {**self.last, **{k: v for k, v in record.items() if v is not None}}
        self.step_ends.append(time.perf_counter())
        if self._live is not None:
            self._live.update(self._render())
        elif self.enabled:
            parts = " ".join(f"{label.replace(' ', '_')}={_fmt(fmt, record.get(key))}" for label, key, fmt in _SHOWN)
            print(f"step {self.step}/{self.total} eta={self._eta().replace(' ', '_')} {parts}", flush=True)

    def initial_accuracy(self, accuracy: float) -> None:
        """Held-out greedy accuracy before step 1: shown now, and next to every later evaluation."""
        self.baseline = accuracy
        self.message(f"held-out accuracy (greedy) before training: {accuracy:.1%}")

    def message(self, text: str) -> None:
        if self.enabled:
            self.console.print(text)
            sys.stdout.flush()

    def close(self, history: list[dict]) -> None:
        if self._live is not None:
            self._live.stop()
        if not self.enabled or not history:
            return
        summary = Table(title="colorl · steps")
        for column in ("step", "reward", "train acc (T=1)", "held-out (greedy)", "resp len", "loss", "step s"):
            summary.add_column(column, justify="right")
        for record in history:
            summary.add_row(str(record["step"]), _fmt("{:.3f}", record.get("reward_mean")),
                            _fmt("{:.1%}", record.get("accuracy")), _fmt("{:.1%}", record.get("eval_accuracy")),
                            _fmt("{:.1f}", record.get("response_len_mean")),
                            _fmt("{:+.4f}", record.get("loss")), _fmt("{:.1f}", record.get("time_step_s")))
        self.console.print(summary)
