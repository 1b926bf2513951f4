"""What the screen shows: the live panel fits 80 columns, bounded-lag adds η, staleness, the trainer's
wait and the engine's idle share, and the end table says what the overlap gained."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from rich.console import Console

from colorl.metrics.display import Display, overlap_line

RECORD = {"step": 3, "reward_mean": 0.41, "accuracy": 0.375, "eval_accuracy": 0.8, "response_len_mean": 12.5,
          "staleness_mean": 0.5, "staleness_max": 1, "rollout_tokens_per_s": 1234.0, "train_tokens_per_s": 987.0,
          "time_rollout_s": 6.0, "time_train_s": 5.0, "time_sync_s": 0.5, "time_step_s": 8.0, "loss": -0.0123,
          "trainer_wait_s": 1.5, "engine_idle_frac": 0.12}
STATUS = SimpleNamespace(engine_version=123, running=256, waiting=1024, kv_used=123456, kv_total=654321,
                         in_flight_groups=512, buffers="v123: 7/8 ready  v124: 3/8  v125: reserved 5/8")


def _render(display: Display) -> list[str]:
    console = Console(record=True, width=200, force_terminal=False)
    console.print(display._render())
    return console.export_text().splitlines()


def test_panel_fits_80_columns_in_both_modes():
    for eta in (None, 2):
        display = Display(10, 0, "quickstart · bounded_lag · native · 2 ranks × cpu", enabled=False, eta=eta)
        display.initial_accuracy(0.75)
        display.step_done(RECORD)
        display.loops(STATUS)
        lines = _render(display)
        assert max(len(line) for line in lines) <= 80, "\n".join(lines)
        text = "\n".join(lines)
        assert "2 ranks × cpu" in text and "(before training 75.0%)" in text
        assert ("bound η = 2" in text and "trainer wait s" in text and "12%" in text) == (eta == 2)


def test_end_table_and_overlap_line_in_bounded_lag():
    history = [RECORD, {**RECORD, "step": 4, "time_step_s": 10.0}]
    line = overlap_line(history)
    assert line == ("overlap: a step took 9.0 s on average; its own rollout (6.0 s), training and sync back to back "
                    "would take 11.5 s: 1.28x")
    display = Display(4, 2, "t", enabled=True, eta=1)
    display.console = Console(record=True, width=120, force_terminal=False)
    display.close(history)
    text = display.console.export_text()
    assert "η = 1" in text and "stale max" in text and "wait s" in text and line in text
    colocated = Display(4, 2, "t", enabled=True)
    colocated.console = Console(record=True, width=120, force_terminal=False)
    colocated.close(history)
    assert "overlap" not in colocated.console.export_text()


def test_step_lines_give_an_eta_only_once_there_is_one(capsys):
    """A pipe or CI gets one line per step; the first has no interval to go on, so no ETA, not a placeholder."""
    display = Display(3, 0, "t", enabled=True)
    display._live = None
    for step in (1, 2, 3):
        display.step_done({**RECORD, "step": step})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and "eta" not in lines[0] and "after" not in "".join(lines)
    assert all(" eta=" in line for line in lines[2:])


@pytest.mark.parametrize("width", [80, 120])
def test_the_bounded_lag_end_table_shows_every_figure_whole_at_any_width(width):
    """80 columns (a pipe, CI, a narrow terminal) had cut the loss to '+0.0…'; the table splits instead."""
    history = [RECORD, {**RECORD, "step": 4, "time_step_s": 10.0, "loss": -0.01234}]
    display = Display(4, 2, "t", enabled=True, eta=1)
    display.console = Console(record=True, width=width, force_terminal=False)
    display.close(history)
    text = display.console.export_text()
    assert "…" not in text and "-0.0123" in text and "stale max" in text and "idle" in text
    assert all(len(line) <= width for line in text.splitlines())
