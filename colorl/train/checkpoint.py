"""Sharded checkpoints with torch.distributed.checkpoint, written atomically.

Layout of `checkpoints/step_N/`: `model/` (safetensors through DCP's HuggingFaceStorageWriter, so
HF tools can read it), `optim/` (DCP's own format), `rng_rank{r}.pt`, `state.json`. Ranks write
into `step_N.partial/` and rank 0 renames it once every rank is done, so a crash never leaves a
half checkpoint that `--resume` would pick.
"""
from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict,
)


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps done
    version: int = 0  # policy version the engines hold
    data_position: int = 0  # problems consumed from this rank's stream


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step}"


def complete_steps(run_dir: Path) -> list[int]:
    """Steps with a whole checkpoint, oldest first (`.partial` and `.old` folders are not)."""
    root = Path(run_dir) / "checkpoints"
    return sorted(int(p.name.split("_")[1]) for p in root.glob("step_*")
                  if p.name.split("_")[1].isdigit() and (p / "state.json").is_file())


def latest_step(run_dir: Path) -> int | None:
    steps = complete_steps(run_dir)
    return steps[-1] if steps else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(run_dir: Path, model, optimizer, state: TrainerState,
                    rank_files: dict[str, str] | None = None) -> Path:
    """rank_files: name -> text each rank writes as `NAME_rank{r}.json` (e.g. bounded-lag rollout state)."""
    final = checkpoint_dir(run_dir, state.step)
    partial = final.with_name(final.name + ".partial")
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier()
    dcp.save(_untied_model_state(model), storage_writer=dcp.HuggingFaceStorageWriter(
        str(partial / "model"), save_distributed=True, enable_consolidation=True))
    dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(partial / "optim"))
    torch.save(_rng_state(), partial / f"rng_rank{_rank()}.pt")
    for name, text in (rank_files or {}).items():
        (partial / f"{name}_rank{_rank()}.json").write_text(text, encoding="utf-8")
    _barrier()
    if _rank() == 0:
        # the consolidated safetensors are what readers use; the per-rank shards would double the size
        shutil.rmtree(partial / "model" / "sharded", ignore_errors=True)
        (partial / "state.json").write_text(json.dumps(asdict(state)))
        old = final.with_name(final.name + ".old")
        if final.exists():  # re-saving a step (e.g. after a resume): a step always has a whole checkpoint
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        partial.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def prune_checkpoints(run_dir: Path, keep: int) -> list[int]:
    """Delete all but the newest `keep` complete checkpoints (rank 0 only); returns the steps deleted."""
    if keep <= 0 or _rank() != 0:
        return []
    doomed = complete_steps(run_dir)[:-keep]
    for step in doomed:
        shutil.rmtree(checkpoint_dir(run_dir, step))
    return doomed


def load_checkpoint(run_dir: Path, step: int, model, optimizer) -> TrainerState:
    folder = checkpoint_dir(run_dir, step)
    model_sd = _untied_model_state(model)
    dcp.load(model_sd, storage_reader=dcp.HuggingFaceStorageReader(str(folder / "model")))
    set_model_state_dict(model, model_sd, options=StateDictOptions(strict=False))
    optim = {"optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(optim, checkpoint_id=str(folder / "optim"))
    set_optimizer_state_dict(model, optimizer, optim["optim"])
    rng_file = folder / f"rng_rank{_rank()}.pt"
    if rng_file.exists():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return TrainerState(**json.loads((folder / "state.json").read_text()))


def read_rank_file(run_dir: Path, step: int, name: str) -> str | None:
    """This rank's `NAME_rank{r}.json` of a checkpoint, or None if that checkpoint has none."""
    path = checkpoint_dir(run_dir, step) / f"{name}_rank{_rank()}.json"
    return path.read_text(encoding="utf-8") if path.is_file() else None


def load_model_weights(folder: Path, model) -> None:
    """Load a checkpoint's model weights into a plain (unsharded) model, e.g. for export."""
    model_sd = _untied_model_state(model)
    dcp.load(model_sd, storage_reader=dcp.HuggingFaceStorageReader(str(Path(folder) / "model")), no_dist=True)
    set_model_state_dict(model, model_sd, options=StateDictOptions(strict=False))


def _untied_model_state(model) -> dict:
    """The model state without the second name of a tied tensor (safetensors refuses shared storage)."""
    seen: set[int] = set()
    state = {}
    for name, tensor in get_model_state_dict(model).items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        key = local.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        state[name] = tensor
    return state


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
