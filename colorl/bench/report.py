"""bench.json, bench.md and the terminal tables, all from one list of columns."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from colorl.files import write_atomic
from colorl.tables import print_table

TRAINED_DEFINITION = ("trained tok/s = response tokens trained per wall-clock second of a step "
                      "(trained tokens / time_step_s), median over the steps after the warm-up; "
                      "speed-up = trained tok/s / the first variant's; pooled = those steps' trained tokens / "
                      "their summed step time; pred = mean of the run's own per-step staleness_pred; "
                      "formula = colorl.staleness at the run's median ρ and M_tail")


@dataclass(frozen=True)
class Column:
    header: str
    key: str
    fmt: str = "{:.2f}"


EPISODES_TABLE = "episodes (task.env)"
TABLES = {
    "throughput and time": (
        Column("trained tok/s", "trained_tokens_per_s", "{:.1f}"), Column("speed-up", "speedup", "{:.2f}x"),
        Column("pooled tok/s", "trained_tokens_per_s_pooled", "{:.1f}"),
        Column("generated tok/s", "generated_tokens_per_s", "{:.1f}"), Column("step s", "step_time_s"),
        Column("trainer wait", "trainer_wait_frac", "{:.0%}"), Column("engine idle", "engine_idle_frac", "{:.0%}"),
        Column("reward (end)", "reward_final", "{:.3f}"), Column("eval acc", "eval_accuracy_final", "{:.1%}"),
    ),
    "staleness and data": (
        Column("staleness", "staleness_mean"), Column("max", "staleness_max", "{:.0f}"),
        Column("pred", "staleness_pred"), Column("formula", "staleness_formula"),
        Column("ρ", "rho"), Column("M_tail", "m_tail"),
        Column("PQS", "pqs_measured"), Column("PQS pred", "pqs_pred"),
        Column("IQS", "iqs_measured"), Column("IQS pred", "iqs_pred"),
        Column("len sampled", "sampled_len_mean", "{:.1f}"), Column("len trained", "trained_len_mean", "{:.1f}"),
        Column("aborted", "groups_aborted", "{:.0f}"), Column("dropped", "groups_dropped", "{:.0f}"),
        Column("filtered", "groups_filtered", "{:.0f}"),
    ),
    EPISODES_TABLE: (
        Column("turns", "episode_turns_mean", "{:.2f}"), Column("tool use", "tool_use_frac", "{:.0%}"),
        Column("env s/episode", "env_s_per_episode"), Column("engine env-wait", "engine_env_wait_frac", "{:.0%}"),
        Column("env faults", "env_errors", "{:.0f}"), Column("env timeouts", "env_timeouts", "{:.0f}"),
        Column("truncated", "episodes_truncated", "{:.0f}"),
    ),
}


def _shown_tables(bench: dict) -> dict[str, tuple[Column, ...]]:
    """Every table, the episodes one only when a variant has its figures (a multi-turn workload)."""
    return {title: columns for title, columns in TABLES.items()
            if title != EPISODES_TABLE
            or any(cell(c, v.get("figures")) != "–" for c in columns for v in bench["variants"])}


def cell(column: Column, figures: dict | None) -> str:
    value = (figures or {}).get(column.key)
    return "–" if value is None else column.fmt.format(value)


def _rows(variants: list[dict], columns: tuple[Column, ...]) -> list[list[str]]:
    return [[v["spec"], "ok" if v["status"] == "ok" else v["status"].upper()]
            + [cell(c, v.get("figures")) for c in columns] for v in variants]


def write_json(bench: dict, out: Path) -> None:
    write_atomic(out / "bench.json", json.dumps(bench, indent=1) + "\n")


def markdown(bench: dict, charts: list[str]) -> str:
    head = bench["workload"]
    lines = [
        f"# colorl bench · {Path(bench['config']).name}", "",
        f"- date: {bench['date']}", f"- command: `{bench['command']}`",
        f"- machine: {bench['machine']['cpu_count']} CPUs, {bench['machine']['platform']}; "
        f"torch {bench['machine']['torch']}, colorl {bench['machine']['colorl_commit']}",
        f"- workload: {head['steps']} steps, warm-up {bench['warmup']} (figures from the steps after it), "
        f"B = {head['rollouts_per_step']} rollouts per step, model {head['model']}, engine {head['engine']}",
        f"- {TRAINED_DEFINITION}", "",
    ]
    for title, columns in _shown_tables(bench).items():
        headers = ["variant", "status"] + [c.header for c in columns]
        lines += [f"## {title}", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(row) + " |" for row in _rows(bench["variants"], columns)]
        lines.append("")
    failed = [v for v in bench["variants"] if v["status"] != "ok"]
    if failed:
        lines += ["## Failed variants", ""] + [f"- `{v['spec']}` ({v['status']}): {v['error']}" for v in failed] + [""]
    if charts:
        lines += ["## Charts", ""] + [f"![{name}]({name})" for name in charts] + [""]
    return "\n".join(lines)


def print_tables(bench: dict, console: Console) -> None:
    if not console.is_terminal:  # a log file: no reason to squeeze the tables into 80 columns
        console = Console(width=200, force_terminal=False)
    for title, columns in _shown_tables(bench).items():
        rows = _rows(bench["variants"], columns)
        print_table(console, f"colorl bench · {title}", ["variant", "status"] + [c.header for c in columns], rows,
                    [None if row[1] == "ok" else "red" for row in rows])
    console.print(TRAINED_DEFINITION)
    for variant in bench["variants"]:
        if variant["status"] != "ok":
            console.print(f"[red]{variant['spec']} {variant['status']}:[/] {variant['error']}", highlight=False)
