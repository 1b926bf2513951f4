"""Per-step metrics: an append-only metrics.jsonl (fsync'd per line), optional TensorBoard and W&B."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from colorl.config import Config
    from colorl.metrics.wandb_sink import WandbSink

# Keys every metrics line carries (DESIGN.md); modes fill the ones that do not apply with 0 / null.
METRIC_KEYS = (
    "step", "version", "loss", "reward_mean", "response_len_mean", "response_len_max", "m_tail",
    "staleness_mean", "staleness_max", "staleness_pred", "rollout_tokens_per_s", "train_tokens_per_s",
    "rho", "time_rollout_s", "time_train_s", "time_sync_s", "time_step_s", "is_weight_mean",
    "is_truncated_frac", "clip_frac", "groups_dropped",
)


class MetricsWriter:
    def __init__(self, run_dir: Path, tensorboard: bool = False, wandb: WandbSink | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._wandb = wandb
        _end_torn_line(self.path)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    @classmethod
    def for_run(cls, run_dir: Path, cfg: Config) -> MetricsWriter:
        """Rank 0's writer, with the trackers `run.tensorboard` and `run.wandb` ask for."""
        from colorl.metrics.wandb_sink import WandbSink

        return cls(run_dir, cfg.run.tensorboard, WandbSink.for_run(cfg, run_dir))

    def write(self, record: dict) -> None:
        missing = [k for k in METRIC_KEYS if k not in record]
        if missing:
            raise KeyError(f"metrics line lacks {missing}")
        record = {**record, "timestamp": record.get("timestamp", time.time())}  # wall clock for `colorl plot`
        line = json.dumps(record, sort_keys=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as handle:  # append-only: a crash loses at most this line
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "timestamp"):
                    self._tb.add_scalar(key, value, record["step"])
                elif isinstance(value, dict):  # e.g. staleness_hist: one curve per bin
                    for bin_name, count in value.items():
                        self._tb.add_scalar(f"{key}/{bin_name}", count, record["step"])
            self._tb.flush()
        if self._wandb is not None:  # after the file: a tracker never costs a line of metrics.jsonl
            self._wandb.log(record)

    def close(self, draw_charts: Callable[[Path], list[Path]] | None = None) -> None:
        """draw_charts(folder): the run's charts for the trackers that show images (W&B)."""
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish(draw_charts)


def _end_torn_line(path: Path) -> None:
    """A crash mid-write leaves a last line without its newline; end it, so the next record starts
    a line of its own instead of being glued to the torn one (the file stays append-only)."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb") as handle:
        handle.seek(-1, os.SEEK_END)
        torn = handle.read(1) != b"\n"
    if torn:
        with open(path, "ab") as handle:
            handle.write(b"\n")
            handle.flush()
            os.fsync(handle.fileno())


def read_metrics(run_dir: Path) -> list[dict]:
    """One record per step, in step order; the last line for a step wins.

    The file is never rewritten: steps redone after a resume from an earlier checkpoint are
    appended again. Lines a crash tore (cut JSON, cut UTF-8, no integer `step`) are skipped.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    by_step: dict[int, dict] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and type(record.get("step")) is int:
            by_step[record["step"]] = record
    return [by_step[k] for k in sorted(by_step)]
