"""`colorl export`: a run's checkpoint -> a Hugging Face folder (safetensors) for `from_pretrained`."""
from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import yaml


class ExportError(ValueError):
    """One line for the user."""


def export_run(run_dir: Path, out: Path, step: int | None = None) -> Path:
    from colorl.config import ConfigError, validate
    from colorl.models import load_model, load_tokenizer, resolve_model_path
    from colorl.train.checkpoint import checkpoint_dir, latest_step, load_model_weights
    from colorl.train.policy import apply_lora

    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise ExportError(f"{run_dir}: not a run directory (no config.yaml)")
    step = latest_step(run_dir) if step is None else step
    if step is None or not (checkpoint_dir(run_dir, step) / "state.json").is_file():
        raise ExportError(f"{run_dir}: no complete checkpoint" + (f" at step {step}" if step is not None else ""))
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out}: exists and is not empty")
    try:
        cfg = validate(yaml.safe_load(config_file.read_text()))
    except ConfigError as exc:
        raise ExportError(f"{config_file}: {exc}") from None
    model_dir = resolve_model_path(cfg.model.path)
    model = load_model(model_dir)
    if cfg.model.lora is not None:
        model = apply_lora(model, cfg.model.lora)
    with warnings.catch_warnings():  # DCP notes that it loads without a process group: intended here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_model_weights(checkpoint_dir(run_dir, step), model)
    if cfg.model.lora is not None:
        model = model.merge_and_unload()
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    load_tokenizer(model_dir).save_pretrained(tmp)
    apply_umask(tmp)
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)
    return out


def apply_umask(folder: Path) -> None:
    """Give the folder and its files the modes the user's umask gives new files.

    Some writers (safetensors, temp-file-then-rename savers) create files 0600 whatever the umask,
    which leaves an exported model unreadable to the group or to a serving process.
    """
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
