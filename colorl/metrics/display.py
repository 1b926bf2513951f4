"""What the user watches: a rich live panel on a terminal, one plain line per step otherwise.

Two accuracies are shown and labelled apart: `train acc (T=t)` is the share of this step's
training samples (drawn at the rollout temperature) that were right; `held-out (greedy)` is the
periodic evaluation on prompts never trained on. The ETA uses the median wall time of the
steps after the first one this process ran (which carries warm-up and the initial evaluation).
In bounded-lag mode the panel and the end table add η, the staleness, the trainer's wait and the
engine's idle share, and the end says what the overlap gained. The panel fits 80 columns.
"""
from __future__ import annotations

import statistics
import sys
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

from colorl.tables import print_table

_SHOWN = (
    ("reward", "reward_mean", "{:.3f}"), ("train acc (T={temperature:g})", "accuracy", "{:.1%}"),
    ("held-out (greedy)", "eval_accuracy", "{:.1%}"),
    ("resp len", "response_len_mean", "{:.1f}"), ("staleness", "staleness_mean", "{:.2f}"),
    ("rollout tok/s", "rollout_tokens_per_s", "{:.0f}"), ("train tok/s", "train_tokens_per_s", "{:.0f}"),
    ("rollout s", "time_rollout_s", "{:.1f}"), ("train s", "time_train_s", "{:.1f}"),
    ("sync s", "time_sync_s", "{:.2f}"), ("loss", "loss", "{:+.4f}"),
)
_SHOWN_BOUNDED_LAG = (
    ("staleness max", "staleness_max", "{:d}"), ("trainer wait s", "trainer_wait_s", "{:.1f}"),
    ("engine idle", "engine_idle_frac", "{:.0%}"),
)
# A row may show several keys of the record in one format (a tuple of keys): how episodes ended
# reads as one sentence, its parts side by side, so tool use is never shown without what went wrong.
_SHOWN_EPISODES = (
    ("turns/episode", ("episode_turns_mean", "turns_cut_frac"), "{:.1f} ({:.0%} cut at their token cap)"),
    ("tool use", ("tool_use_frac", "tool_calls_per_episode"), "{:.0%} of episodes, {:.1f} calls/episode"),
    ("tool errors", ("tool_errors", "tool_errors_per_episode"), "{:d} ({:.1f}/episode)"),
    ("truncated", ("episodes_truncated_frac", "truncated_max_turns_frac", "truncated_tokens_frac"),
     "{:.0%} (max turns {:.0%}, tokens {:.0%})"),
    ("env faults", ("env_faults", "env_errors", "env_timeouts"), "{:d} (errors {:d}, timeouts {:d})"),
    ("held-out tool use", "eval_tool_use_frac", "{:.0%}"),
)
LABEL_WIDTH, VALUE_WIDTH = 18, 52  # fixed, so the panel does not change width; with borders 77 columns


def overlap_line(history: list[dict]) -> str | None:
    """Bounded-lag: the steps' wall time against their own rollout, training and sync back to back."""
    if not history:
        return None
    step_s = sum(r.get("time_step_s", 0.0) for r in history)
    rollout_s = sum(r.get("time_rollout_s", 0.0) for r in history)
    back_to_back = rollout_s + sum(r.get("time_train_s", 0.0) + r.get("time_sync_s", 0.0) for r in history)
    if not step_s:
        return None
    n = len(history)
    return (f"overlap: a step took {step_s / n:.1f} s on average; its own rollout ({rollout_s / n:.1f} s), training "
            f"and sync back to back would take {back_to_back / n:.1f} s: {back_to_back / step_s:.2f}x")


def _fmt(fmt: str, value) -> str:
    return "-" if value is None else fmt.format(value)


def _shown(record: dict, key: str | tuple[str, ...], fmt: str) -> str:
    """One row's value: a key's, or several keys' in one format; "-" while any is missing."""
    if isinstance(key, str):
        return _fmt(fmt, record.get(key))
    values = [record.get(k) for k in key]
    return "-" if any(v is None for v in values) else fmt.format(*values)


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
    def __init__(self, total_steps: int, first_step: int, title: str, enabled: bool = True,
                 eta: int | None = None, episodes: bool = False, temperature: float = 1.0,
                 reward_names: list[str] | tuple[str, ...] = ()) -> None:
        """eta: bounded-lag mode's staleness bound η (None in colocated mode); episodes: task.env is set;
        temperature: the rollout's, which the training accuracy is sampled at; reward_names: the functions
        of a weighted task.reward list, each mean shown under the total."""
        self.console = Console(stderr=False)
        self.total, self.first, self.title, self.eta, self.episodes = total_steps, first_step, title, eta, episodes
        self.temperature = temperature
        self.reward_parts = tuple((f"reward/{name}", f"reward/{name}", "{:.3f}") for name in reward_names)
        shown = (_SHOWN[:1] + self.reward_parts + _SHOWN[1:] + (_SHOWN_BOUNDED_LAG if eta is not None else ())
                 + (_SHOWN_EPISODES if episodes else ()))
        self.shown = tuple((label.format(temperature=temperature), key, fmt) for label, key, fmt in shown)
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
        for label, key, fmt in self.shown:
            value = _shown(self.last, key, fmt)
            if key == "eval_accuracy" and self.baseline is not None:
                value = f"{value}  (before training {self.baseline:.1%})"
            if key == "staleness_max":
                value = f"{value}  (bound η = {self.eta})"
            if key.startswith("reward/"):  # indented under the total by its bare name: the label column is narrow
                label = "  " + label.removeprefix("reward/")
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
            ("engine", f"v{status.engine_version} run {status.running} wait {status.waiting} "
                       f"KV {status.kv_used}/{status.kv_total} groups {status.in_flight_groups}"),
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
            parts = " ".join(f"{label.replace(' ', '_')}={_shown(record, key, fmt)}" for label, key, fmt in self.shown)
            remaining = eta_seconds(self.step_ends, self.step, self.total)  # none before the second step
            eta = "" if remaining is None else f" eta={_clock(remaining)}"
            print(f"step {self.step}/{self.total}{eta} {parts}", flush=True)

    def initial_accuracy(self, accuracy: float, tool_use: float | None = None) -> None:
        """Held-out greedy accuracy before step 1: shown now, and next to every later evaluation."""
        self.baseline = accuracy
        uses = "" if tool_use is None else f" (episodes that called a tool: {tool_use:.1%})"
        self.message(f"held-out accuracy (greedy) before training: {accuracy:.1%}{uses}")

    def message(self, text: str) -> None:
        if self.enabled:
            self.console.print(text)
            sys.stdout.flush()

    def close(self, history: list[dict]) -> None:
        if self._live is not None:
            self._live.stop()
        if not self.enabled or not history:
            return
        columns = [("step", "step", "{}"), ("reward", "reward_mean", "{:.3f}"), *self.reward_parts,
                   ("train acc", "accuracy", "{:.1%}"),
                   ("held-out", "eval_accuracy", "{:.1%}"), ("resp len", "response_len_mean", "{:.1f}"),
                   ("loss", "loss", "{:+.4f}"), ("step s", "time_step_s", "{:.1f}")]
        if self.eta is not None:
            columns += [("stale max", "staleness_max", "{:d}"), ("wait s", "trainer_wait_s", "{:.1f}"),
                        ("idle", "engine_idle_frac", "{:.0%}")]
        if self.episodes:
            columns += [("turns", "episode_turns_mean", "{:.1f}"), ("tool use", "tool_use_frac", "{:.0%}"),
                        ("tool err", "tool_errors", "{:d}"), ("truncated", "episodes_truncated_frac", "{:.0%}"),
                        ("faults", "env_faults", "{:d}")]
        title = (f"colorl · steps (train acc at T={self.temperature:g}, held-out greedy"
                 f"{'' if self.eta is None else f'; η = {self.eta}'})")
        print_table(self.console, title, [name for name, _, _ in columns],
                    [[_fmt(fmt, record.get(key)) for _, key, fmt in columns] for record in history])
        line = overlap_line(history) if self.eta is not None else None
        if line:
            self.console.print(line)
