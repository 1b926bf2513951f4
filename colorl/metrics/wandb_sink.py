"""Weights & Biases tracking of a run (`run.wandb`), on rank 0 next to metrics.jsonl.

A tracker is a convenience, never a reason for a run to stop: its first failure (wandb not
installed, `init`, `log` or `finish` raising) is one warning line, and the sink is off from then on.
"""
from __future__ import annotations

import sys
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from colorl.files import write_atomic

if TYPE_CHECKING:
    from colorl.config import Config, WandbConfig

# the W&B run id, kept so that a `--resume` of this run directory continues the same W&B run
RUN_ID_FILE = Path("wandb") / "run-id"
NOT_INSTALLED = "wandb is not installed (pip install 'colorl[wandb]'); not tracking"


class WandbSink:
    """Each metrics record goes to W&B at its step; at the end, the run's `colorl plot` charts."""

    def __init__(self, settings: WandbConfig, run_name: str, run_dir: Path, config: dict, wandb=None) -> None:
        """wandb: the module to call (tests pass a stand-in); None imports the installed one."""
        self._run = None
        self._warned = False
        if wandb is None:
            try:
                import wandb
            except ImportError:
                self._warn(NOT_INSTALLED)
                return
        self._wandb = wandb
        try:
            self._run = self._wandb.init(
                project=settings.project, name=settings.name or run_name, mode=settings.mode,
                id=stored_run_id(Path(run_dir)), resume="allow", dir=str(run_dir), config=config,
                allow_val_change=True,  # a resume may change keys (preflight names them)
                # console off: wandb must not wrap this process's stdout/stderr (the live display)
                settings={"console": "off", "quiet": True},
            )
            # steps redone after a resume from an earlier checkpoint are logged again: a custom step
            # axis takes them, where wandb's own step would drop anything not above the last one
            self._run.define_metric("step")
            self._run.define_metric("*", step_metric="step")
        except Exception as exc:  # wandb raises many types (no login, no network, bad settings)
            self._fail("could not start", exc)

    @classmethod
    def for_run(cls, cfg: Config, run_dir: Path) -> WandbSink | None:
        """The sink `run.wandb` asks for, or None when it is unset or disabled."""
        settings = cfg.run.wandb
        if settings is None or settings.mode == "disabled":
            return None
        return cls(settings, cfg.run.name, run_dir, cfg.model_dump(mode="json"))

    def log(self, record: dict) -> None:
        if self._run is None:
            return
        try:
            self._run.log(scalars(record))
        except Exception as exc:
            self._fail("could not log a step", exc)

    def finish(self, draw_charts: Callable[[Path], list[Path]] | None = None) -> None:
        """Log the charts `draw_charts(folder)` draws (the run's `colorl plot` charts: whoever ends the run
        hands them over, a tracker does not draw), then close the W&B run."""
        if self._run is None:
            return
        run, self._run = self._run, None
        try:
            if draw_charts is not None:
                self._log_charts(run, draw_charts)
        except Exception as exc:  # matplotlib or wandb.Image: the metrics are already logged
            self._warn(f"the charts were not logged ({_reason(exc)})")
        try:
            run.finish()
        except Exception as exc:
            self._warn(f"could not finish the run ({_reason(exc)})")

    def _log_charts(self, run, draw_charts: Callable[[Path], list[Path]]) -> None:
        with tempfile.TemporaryDirectory() as folder:  # wandb copies each image when it is logged
            charts = draw_charts(Path(folder))
            if charts:
                run.log({f"charts/{path.stem}": self._wandb.Image(str(path)) for path in charts})

    def _fail(self, what: str, exc: Exception) -> None:
        self._run = None
        self._warn(f"{what} ({_reason(exc)}); not tracking")

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            print(f"colorl: warning: run.wandb: {message}", file=sys.stderr, flush=True)


def scalars(record: dict) -> dict:
    """The numbers of a metrics record, `step` included; a dict (e.g. staleness_hist) gives one
    `key/bin` curve per bin, as in TensorBoard. `timestamp` is left out: wandb keeps its own."""
    out = {}
    for key, value in record.items():
        if key == "timestamp":
            continue
        if isinstance(value, (int, float)):
            out[key] = value
        elif isinstance(value, dict):
            out.update({f"{key}/{name}": count for name, count in value.items() if isinstance(count, (int, float))})
    return out


def stored_run_id(run_dir: Path) -> str:
    """The run directory's W&B run id: the stored one, else a new one written atomically."""
    path = run_dir / RUN_ID_FILE
    if path.is_file():
        stored = path.read_text(encoding="utf-8").strip()
        if stored:
            return stored
    run_id = uuid.uuid4().hex[:12]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, run_id + "\n")
    return run_id


def _reason(exc: Exception) -> str:
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
