"""The model's own words: a few of each logged step's samples, decoded, in RUN_DIR/samples.jsonl and one on
screen, every `run.log_samples_every` steps (TRL's log_completions). Reward functions are debugged by
reading what they scored."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

SAMPLES_FILE = "samples.jsonl"
GROUPS_KEPT = 2  # groups of a logged step written to the file (each with all its samples)
SCREEN_CHARS = 160


@dataclass
class SampleRecord:
    step: int
    problem_index: int
    prompt: str
    answer: str
    completion: str  # the decoded output: an episode's whole exchange after its opening prompt
    reward: float
    finish_reason: str
    tokens: int  # sampled by the model
    version: int | None  # the oldest version that computed any of its state (None: no sampled token)
    turns: int | None = None  # episodes: model messages, tool calls and errors, and how it ended
    tool_calls: int | None = None
    tool_errors: int | None = None
    fault: str | None = None
    truncated: str | None = None  # what cut the episode: "max_turns" or "tokens"


def sample_records(step: int, groups, decode: Callable[[list[int]], str]) -> list[SampleRecord]:
    records = []
    for group in groups[:GROUPS_KEPT]:
        for result, reward in zip(group.results, group.rewards):
            episode = result.episode
            records.append(SampleRecord(
                step, group.problem_index, group.problem.prompt, group.problem.answer, decode(result.output_ids),
                float(reward), result.finish_reason, result.sampled_tokens, result.first_version,
                *((episode.turns, episode.tool_calls, episode.tool_errors, episode.fault, episode.truncated)
                  if episode is not None else ())))
    return records


def append_samples(run_dir: Path, records: list[SampleRecord]) -> None:
    """Appended and flushed to disk, as metrics.jsonl: the file only grows."""
    with open(Path(run_dir) / SAMPLES_FILE, "a", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(asdict(record), ensure_ascii=False) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _short(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= SCREEN_CHARS else flat[:SCREEN_CHARS - 1] + "…"


def screen_lines(records: list[SampleRecord]) -> list[str]:
    """The first group's best and worst sample, one line each, under its prompt and answer."""
    if not records:
        return []
    group = [r for r in records if r.problem_index == records[0].problem_index]
    best, worst = max(group, key=lambda r: r.reward), min(group, key=lambda r: r.reward)
    lines = [f"sample at step {best.step}: {_short(best.prompt)}  (answer {best.answer})"]
    for label, record in (("best", best), ("worst", worst)) if best is not worst else (("sample", best),):
        ended = record.fault or (f"truncated: {record.truncated}" if record.truncated else record.finish_reason)
        lines.append(f"  {label} reward {record.reward:.2f} ({record.tokens} tokens, {ended}): {_short(record.completion)}")
    return lines
