"""colorl from Python (a notebook, a script): the same run as `colorl train`, with the config as a path or a
dict and overrides as keyword sections, returning where the run is and what it measured. The CLI stays
the main door; this drives it, so every check, message and exit code is the CLI's."""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml


class RunFailed(RuntimeError):
    """`colorl train` ended without finishing; what went wrong was printed above, as on the command line."""

    def __init__(self, exit_code: int, run_dir: Path | None) -> None:
        super().__init__(f"colorl train exited with code {exit_code} (run directory: {run_dir}); see the messages above")
        self.exit_code, self.run_dir = exit_code, run_dir


@dataclass
class RunResult:
    run_dir: Path
    metrics: list[dict] = field(default_factory=list)  # one record per step (docs/run-directory.md)

    @property
    def last(self) -> dict:
        """The last step's record: reward_mean, accuracy, eval_accuracy, loss, staleness, times."""
        return self.metrics[-1] if self.metrics else {}


def _flatten(prefix: str, value: Any, into: dict[str, Any]) -> None:
    if isinstance(value, Mapping) and value and prefix.count(".") < 1:  # a section: its keys one by one
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}", inner, into)
    else:
        into[prefix] = value


def run(config: str | Path | Mapping[str, Any], overrides: Mapping[str, Any] | None = None, *,
          run_dir: str | Path | None = None, nproc: int | None = None, device: str | None = None,
          resume: bool = False, **sections: Mapping[str, Any] | Any) -> RunResult:
    """Train as `colorl train` does and return the run directory with its per-step metrics.

    config: a YAML path, or the config itself as a dict (the same keys as the YAML).
    overrides: dotted keys, as `--set` takes them: `{"run.steps": 3, "model.lora": {"r": 8}}`.
    sections: the same by section: `run={"steps": 3}, rollout={"temperature": 0.7}`, `mode="bounded_lag"`.
    Raises RunFailed when the run does not finish (bad input, a failed rank, an interruption).
    """
    from colorl.cli import main
    from colorl.config import ConfigError, load_config
    from colorl.metrics.logger import read_metrics

    dotted: dict[str, Any] = {}
    for name, value in sections.items():
        _flatten(name, value, dotted)
    dotted.update(overrides or {})
    sets = [f"{key}={yaml.safe_dump(value, default_flow_style=True).removesuffix(chr(10)).removesuffix('...').strip()}"
            for key, value in dotted.items()]
    with tempfile.TemporaryDirectory() as folder:
        if isinstance(config, Mapping):
            path = Path(folder) / "config.yaml"
            path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
        else:
            path = Path(config)
        if run_dir is None:  # where `colorl train` would put it; a config it refuses is reported by it below
            try:
                cfg = load_config(str(path), sets)
                run_dir = Path(cfg.run.dir) / cfg.run.name
            except (ConfigError, ValueError, OSError):
                pass
        argv = ["train", str(path), *(a for s in sets for a in ("--set", s))]
        argv += ["--run-dir", str(run_dir)] if run_dir is not None else []
        argv += ["--nproc", str(nproc)] if nproc is not None else []
        argv += ["--device", device] if device is not None else []
        argv += ["--resume"] if resume else []
        code = main(argv)
    if code != 0:
        raise RunFailed(code, Path(run_dir) if run_dir is not None else None)
    return RunResult(Path(run_dir), read_metrics(Path(run_dir)))
