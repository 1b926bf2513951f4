"""Whole runs through the launcher with the checkpoint engine's bit-exact check on (colorl doctor's
rank function or a stand-in's), and what the tests read back from their run directories."""
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from colorl.config import load_config
from colorl.launch import launch
from colorl.worker import prepare_run_dir


def checked_run(rank_fn, overrides: list[str], run_dir: Path, resume: bool = False, name: str = "") -> list[dict]:
    """The ranks' reports (versions checked, steps, memory per phase); any failure fails the test here."""
    cfg = load_config("configs/tiny.yaml", overrides)
    prepare_run_dir(cfg, run_dir, resume)
    report_dir = run_dir / ("doctor-resumed" if resume else "doctor")
    report_dir.mkdir()
    failure = launch(rank_fn, cfg.launch.nproc, "cpu",
                     (cfg.model_dump(mode="json"), str(run_dir), resume, "cpu", str(report_dir)), 120)
    assert failure is None, f"{name} run failed on rank {failure.rank}: {failure.error}"
    return [json.loads((report_dir / f"rank{r}.json").read_text()) for r in range(cfg.launch.nproc)]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in (run_dir / "checkpoints" / f"step_{step}" / "model").glob("*.safetensors"):
        tensors.update(load_file(file))
    return tensors
