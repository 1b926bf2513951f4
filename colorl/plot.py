"""`colorl plot RUN_DIR [--out DIR]`: PNG charts of a run from its metrics.jsonl.

One file per question a user asks of a run:
- reward.png     is it learning? reward, train accuracy and held-out accuracy vs step and vs wall clock
- length.png     how long are the answers? response length mean and max
- time.png       where does a step's time go? rollout / train / sync / other, stacked
- policy.png     is the update sane? IS weight, clipped and truncated fractions, KL(μ‖θ)
- staleness.png  (runs with staleness) measured vs predicted: mean, max, pre-queue / in-queue vs PQS / IQS
"""
from __future__ import annotations

import math
from pathlib import Path

from colorl.metrics.logger import read_metrics
from colorl.metrics.summary import baseline_accuracy


class PlotError(ValueError):
    """One line for the user."""


def _series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) where the value is a finite number."""
    xs, ys = [], []
    for r in records:
        value = r.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            xs.append(r["step"])
            ys.append(float(value))
    return xs, ys


def wall_clock_minutes(records: list[dict]) -> list[float]:
    """Minutes since the run's first step started: from `timestamp` when recorded, else step times summed."""
    if all("timestamp" in r for r in records):
        start = records[0]["timestamp"] - records[0].get("time_step_s", 0.0)
        return [(r["timestamp"] - start) / 60 for r in records]
    total, out = 0.0, []
    for r in records:
        total += r.get("time_step_s", 0.0)
        out.append(total / 60)
    return out


def has_staleness(records: list[dict]) -> bool:
    return any(_series(records, key)[1] and any(_series(records, key)[1])
               for key in ("staleness_mean", "staleness_pred", "staleness_max"))


def _tidy(ax, steps_axis: bool = True) -> None:
    """Figures as they are (no '1e-5+1' offset on an axis of values near 1), whole steps on a step axis (a
    short run had fractional ticks), a grid, and the legend below the plot, where it covers no line."""
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    for axis in (ax.xaxis, ax.yaxis):
        if isinstance(axis.get_major_formatter(), ScalarFormatter):
            axis.get_major_formatter().set_useOffset(False)
    if steps_axis:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)


def _reward(plt, records: list[dict], baseline: float | None = None):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    minutes = dict(zip((r["step"] for r in records), wall_clock_minutes(records)))
    if baseline is not None:  # held-out accuracy measured before step 1 (events.log)
        records = [{"step": 0, "eval_accuracy": baseline}] + records
        minutes[0] = 0.0
    for ax, to_x, xlabel in ((axes[0], lambda s: s, "step"),
                             (axes[1], lambda s: minutes[s], "wall clock [min]")):
        for key, label, style in (("reward_mean", "reward (training samples)", "-"),
                                  ("accuracy", "train accuracy (samples at T)", ":"),
                                  ("eval_accuracy", "held-out accuracy (greedy)", "o-")):
            xs, ys = _series(records, key)
            if ys:
                ax.plot([to_x(x) for x in xs], ys, style, label=label)
        ax.set_xlabel(xlabel)
    axes[0].set_ylabel("reward / accuracy")
    _tidy(axes[0])
    _tidy(axes[1], steps_axis=False)
    axes[1].get_legend().remove()  # the same lines as on the left
    return fig


def _length(plt, records: list[dict]):
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for key, label in (("response_len_mean", "mean"), ("response_len_max", "max")):
        ax.plot(*_series(records, key), label=label)
    for key, label in (("sampled_len_mean", "sampled mean"), ("trained_len_mean", "trained mean")):
        xs, ys = _series(records, key)
        if ys:
            ax.plot(xs, ys, "--", label=label)
    ax.set(xlabel="step", ylabel="response length [tokens]")
    _tidy(ax)
    return fig


def _time(plt, records: list[dict]):
    fig, ax = plt.subplots(figsize=(6.4, 4))
    steps = [r["step"] for r in records]
    bottom = [0.0] * len(records)
    for key, label in (("time_rollout_s", "rollout"), ("time_train_s", "train"), ("time_sync_s", "sync")):
        values = [float(r.get(key) or 0.0) for r in records]
        ax.bar(steps, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    other = [max(0.0, float(r.get("time_step_s") or 0.0) - b) for r, b in zip(records, bottom)]
    ax.bar(steps, other, bottom=bottom, label="other")
    ax.set(xlabel="step", ylabel="seconds")
    _tidy(ax)
    return fig


def _policy(plt, records: list[dict]):
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("is_weight_mean", "IS weight mean"), ("is_weight_max", "IS weight max")):
        left.plot(*_series(records, key), label=label)
    left.set(xlabel="step", ylabel="importance weight")
    for key, label in (("clip_frac", "clipped fraction"), ("is_truncated_frac", "truncated fraction"),
                       ("kl_mu_theta", "KL(μ‖θ) per token"), ("kl_ref", "KL to reference")):
        xs, ys = _series(records, key)
        if ys:
            right.plot(xs, ys, label=label)
    right.set(xlabel="step")
    for ax in (left, right):
        _tidy(ax)
    return fig


def _staleness(plt, records: list[dict]):
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for key, label, style in (("staleness_mean", "measured mean", "o-"), ("staleness_pred", "predicted", "-"),
                              ("staleness_max", "measured max", "x:"),
                              ("pqs_measured", "pre-queue, measured", "--"), ("pqs_pred", "PQS, formula", ":"),
                              ("iqs_measured", "in-queue, measured", "--"), ("iqs_pred", "IQS, formula", ":")):
        xs, ys = _series(records, key)
        if ys:
            ax.plot(xs, ys, style, label=label)
    ax.set(xlabel="step", ylabel="staleness [versions]")
    _tidy(ax)
    return fig


def has_episodes(records: list[dict]) -> bool:
    return any(_series(records, "episode_turns_mean")[1])


def _episodes(plt, records: list[dict]):
    """Multi-turn runs (task.env): how the model uses its tools, and what went wrong."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label, style in (("tool_use_frac", "episodes that called a tool", "o-"),
                              ("episodes_truncated_frac", "episodes truncated", "x-"),
                              ("reward_mean", "reward", "-")):
        xs, ys = _series(records, key)
        if ys:
            left.plot(xs, ys, style, label=label)
    left.set(xlabel="step", ylabel="fraction")
    for key, label in (("episode_turns_mean", "turns per episode"), ("tool_calls_per_episode", "tool calls per episode"),
                       ("tool_errors", "tool errors"), ("env_errors", "environment faults"),
                       ("env_timeouts", "environment time-outs")):
        xs, ys = _series(records, key)
        if ys:
            right.plot(xs, ys, label=label)
    right.set(xlabel="step", ylabel="per step")
    for ax in (left, right):
        _tidy(ax)
    return fig


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def plot_run(run_dir: Path, out: Path | None = None) -> list[Path]:
    """Write the charts; returns the files written."""
    if not run_dir.is_dir():
        raise PlotError(f"{run_dir}: no such run directory")
    records = read_metrics(run_dir)
    if not records:
        raise PlotError(f"{run_dir}: no metrics.jsonl with a complete step to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = out or run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, chart in CHARTS.items():
        if (name == "staleness" and not has_staleness(records)) or (name == "episodes" and not has_episodes(records)):
            continue
        figure = chart(plt, records, baseline_accuracy(run_dir)) if chart is _reward else chart(plt, records)
        written.append(_save(plt, figure, out / f"{name}.png"))
    return written


CHARTS = {"reward": _reward, "length": _length, "time": _time, "policy": _policy, "staleness": _staleness,
          "episodes": _episodes}


def tracker_charts(run_dir: Path, out: Path) -> list[Path]:
    """The run's charts for a tracker that shows images, drawn into `out`; none before a complete step."""
    try:
        return plot_run(run_dir, out)
    except PlotError:
        return []
