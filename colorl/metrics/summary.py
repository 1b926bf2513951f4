"""The lines printed when `colorl train` ends: what was learned, how long it took, what to do next.

Read from the run directory (metrics.jsonl and events.log), so a resumed run reports the whole
run, including the held-out accuracy measured before its first step.
"""
from __future__ import annotations

import re
from pathlib import Path

from colorl.metrics.logger import read_metrics

_BASELINE = re.compile(r"eval_accuracy step=0 ([0-9.]+)")
_TOOL_BASELINE = re.compile(r"eval_tool_use_frac step=0 ([0-9.]+)")


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes} min {seconds:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def baseline_accuracy(run_dir: Path, pattern: re.Pattern = _BASELINE) -> float | None:
    """Held-out accuracy (or tool use) measured before step 1 (events.log), if the run evaluates."""
    events = run_dir / "events.log"
    if not events.exists():
        return None
    found = pattern.findall(events.read_text(encoding="utf-8"))
    return float(found[0]) if found else None


def summary_lines(run_dir: Path, wall_s: float, eval_prompts: int) -> list[str]:
    records = read_metrics(run_dir)
    if not records:
        return [f"wall time {format_duration(wall_s)}; no step finished"]
    lines = []
    evals = [(r["step"], r["eval_accuracy"]) for r in records if r.get("eval_accuracy") is not None]
    before = baseline_accuracy(run_dir)
    if evals:
        step, after = evals[-1]
        start = f"{before:.1%} before → " if before is not None else ""
        lines.append(f"held-out accuracy (greedy, {eval_prompts} prompts never trained on): "
                     f"{start}{after:.1%} at step {step}")
    uses = [(r["step"], r["eval_tool_use_frac"]) for r in records if r.get("eval_tool_use_frac") is not None]
    if uses:
        step, after = uses[-1]
        before = baseline_accuracy(run_dir, _TOOL_BASELINE)
        start = f"{before:.1%} before → " if before is not None else ""
        lines.append(f"held-out episodes that called a tool: {start}{after:.1%} at step {step}")
    first, last = records[0], records[-1]
    lines.append(f"training reward (samples at the rollout temperature): {first['reward_mean']:.3f} at step "
                 f"{first['step']} → {last['reward_mean']:.3f} at step {last['step']}")
    steps_s = sum(r.get("time_step_s", 0.0) for r in records)
    lines.append(f"wall time {format_duration(wall_s)} for this command ({len(records)} steps in the run, "
                 f"{format_duration(steps_s)} of them in steps)")
    disk = disk_line(run_dir)
    return lines + ([disk] if disk else [])


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def disk_line(run_dir: Path) -> str | None:
    """Where the run's disk space went: each checkpoint, and how much of it is optimizer state."""
    from colorl.train.checkpoint import checkpoint_dir, complete_steps

    steps = complete_steps(run_dir)
    if not steps:
        return None
    parts, total = [], 0
    for step in reversed(steps):
        folder = checkpoint_dir(run_dir, step)
        size = _bytes(folder)
        optim = _bytes(folder / "optim") if (folder / "optim").is_dir() else 0
        total += size
        parts.append(f"step_{step} {size / 1e9:.2f} GB" + (f" ({optim / 1e9:.2f} GB optimizer state)" if optim
                                                            else " (weights only)"))
    return (f"disk: {total / 1e9:.2f} GB in {run_dir / 'checkpoints'}: {', '.join(parts)}; run.keep_checkpoints "
            f"and run.optimizer_state set what is kept (export needs only the weights)")


def next_commands(run_dir: Path) -> list[str]:
    return [f"export for from_pretrained:  colorl export {run_dir} {run_dir}/hf",
            f"plot the run:                colorl plot {run_dir}"]
