"""`colorl plot` on a bounded-lag style metrics file: the staleness chart appears when the run has staleness."""
from __future__ import annotations

import json

from colorl.cli import main
from colorl.metrics.logger import METRIC_KEYS, MetricsWriter
from colorl.plot import wall_clock_minutes


def _record(step: int, staleness: float) -> dict:
    record = {key: 0.0 for key in METRIC_KEYS}
    record.update(step=step, version=step, reward_mean=0.1 * step, response_len_mean=20.0, response_len_max=40,
                  time_rollout_s=2.0, time_train_s=5.0, time_sync_s=0.5, time_step_s=8.0, is_weight_mean=1.0,
                  staleness_mean=staleness, staleness_max=1, staleness_pred=0.9, pqs_measured=0.5, iqs_measured=0.4,
                  pqs_pred=0.6, iqs_pred=0.3, eval_accuracy=0.5 if step == 2 else None)
    return record


def test_plot_draws_staleness_measured_vs_predicted(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    writer = MetricsWriter(run)
    for step in (1, 2, 3):
        writer.write(_record(step, staleness=0.5 + 0.1 * step))
    (run / "events.log").write_text("2026-01-01T00:00:00 eval_accuracy step=0 0.2500\n")
    assert main(["plot", str(run)]) == 0
    names = sorted(p.name for p in (run / "plots").iterdir())
    assert names == ["length.png", "policy.png", "reward.png", "staleness.png", "time.png"]
    assert capsys.readouterr().out.count("wrote ") == 5
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(isinstance(r["timestamp"], float) for r in records)  # the writer stamps wall-clock time
    minutes = wall_clock_minutes(records)
    assert minutes == sorted(minutes) and minutes[0] > 0


def test_wall_clock_falls_back_to_summed_step_times():
    assert wall_clock_minutes([{"step": 1, "time_step_s": 60.0}, {"step": 2, "time_step_s": 30.0}]) == [1.0, 1.5]


def _drawn(tmp_path, monkeypatch, records: list[dict]) -> dict:
    from colorl import plot

    figures = {}
    monkeypatch.setattr(plot, "_save", lambda plt, fig, path: figures.setdefault(path.stem, fig) and path)
    run = tmp_path / "run"
    run.mkdir(parents=True)
    writer = MetricsWriter(run)
    for record in records:
        writer.write(record)
    plot.plot_run(run)
    return figures


def test_charts_read_plainly_on_a_short_run(tmp_path, monkeypatch):
    """Whole steps on the step axes (3 steps had given 1.25, 1.5, ...), IS weights near 1 without a
    '1e-5+1' offset, and every legend below its plot, covering no line."""
    records = [{**_record(step, 0.0), "is_weight_mean": 1.0 + 1e-6 * step, "is_weight_max": 1.0 + 3e-6 * step}
               for step in (1, 2, 3)]
    figures = _drawn(tmp_path, monkeypatch, records)
    for name, fig in figures.items():
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            if ax.get_xlabel() == "step":
                low, high = ax.get_xlim()
                assert all(float(t).is_integer() for t in ax.get_xticks() if low <= t <= high), name
            assert ax.yaxis.get_major_formatter().get_offset() == "", name
            legend = ax.get_legend()
            if legend is not None:
                assert legend.get_window_extent(renderer).y1 <= ax.get_window_extent(renderer).y0 + 1, name


def test_a_tool_run_gets_its_episodes_chart(tmp_path, monkeypatch):
    records = [{**_record(step, 0.0), "episode_turns_mean": 2.0, "tool_use_frac": 0.25 * step, "tool_errors": 3 - step,
                "env_errors": 1} for step in (1, 2, 3)]
    figures = _drawn(tmp_path, monkeypatch, records)
    assert "episodes" in figures
    labels = {line.get_label() for ax in figures["episodes"].axes for line in ax.get_lines()}
    assert {"episodes that called a tool", "tool errors", "environment faults"} <= labels
    assert "episodes" not in _drawn(tmp_path / "completions", monkeypatch, [_record(1, 0.0)])
