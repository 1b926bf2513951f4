"""Sharded checkpoints with torch.distributed.checkpoint, written atomically.

Layout of `checkpoints/step_N/`: `model/` (safetensors through DCP's HuggingFaceStorageWriter, so
HF tools can read it), `optim/` (DCP's own format), `rng_rank{r}.pt`, `manifest.json` (size and
sha256 of every file) and `state.json`, written last. Ranks write into `step_N.partial/` and rank 0
renames it once every rank is done, so a crash never leaves a half checkpoint that `--resume` would
pick; the manifest catches a checkpoint damaged afterwards (truncated or corrupted on disk).

Before writing, the space a checkpoint needs is compared with the space free, so a full disk stops
the run with one line naming both, and the previous checkpoint stays the newest complete one.

Disk: Adam's state is twice the fp32 weights, so by default (`run.optimizer_state: newest`) only the
newest checkpoint keeps `optim/`; older ones keep the weights (for `colorl export` and as a
fall-back) and a resume from one of them starts a fresh optimizer state, saying so.
"""
from __future__ import annotations

import errno
import hashlib
import json
import random
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict,
)

from colorl import faults
from colorl.files import write_atomic

MANIFEST = "manifest.json"


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
    model_sd = _untied_model_state(model)
    optim_sd = {"optim": get_optimizer_state_dict(model, optimizer)}
    if _rank() == 0:
        _clear_leftovers(final.parent)
    _check_space(final.parent, _needed_bytes(model_sd, optim_sd), state.step)
    if _rank() == 0:
        partial.mkdir(parents=True)
    _barrier()
    try:
        dcp.save(model_sd, storage_writer=dcp.HuggingFaceStorageWriter(
            str(partial / "model"), save_distributed=True, enable_consolidation=True))
        faults.point("checkpoint", state.step)
        dcp.save(optim_sd, checkpoint_id=str(partial / "optim"))
        torch.save(_rng_state(), partial / f"rng_rank{_rank()}.pt")
        for name, text in (rank_files or {}).items():
            (partial / f"{name}_rank{_rank()}.json").write_text(text, encoding="utf-8")
    except BaseException as exc:  # DCP wraps a rank's OSError in a CheckpointException (a BaseException)
        if not _disk_full(exc):
            raise
        shutil.rmtree(partial, ignore_errors=True)
        raise faults.RunFault(f"disk full while writing checkpoint {partial}; {_newest_note(run_dir)}") from None
    _barrier()
    if _rank() == 0:
        # the consolidated safetensors are what readers use; the per-rank shards would double the size
        shutil.rmtree(partial / "model" / "sharded", ignore_errors=True)
        _write_manifest(partial)
        (partial / "state.json").write_text(json.dumps(asdict(state)))
        old = final.with_name(final.name + ".old")
        if final.exists():  # re-saving a step (e.g. after a resume): a step always has a whole checkpoint
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        partial.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _clear_leftovers(root: Path) -> None:
    """Folders a crash left half-written or half-deleted: never checkpoints, only lost space."""
    for folder in list(root.glob("step_*.partial")) + list(root.glob("step_*.deleting")):
        shutil.rmtree(folder, ignore_errors=True)


def _needed_bytes(model_sd: dict, optim_sd: dict) -> int:
    """Bytes a save writes at its peak, over all ranks: the model twice (per-rank shards, then the
    consolidated file), the optimizer state, and a tenth more for metadata and RNG files."""
    def local_bytes(tree) -> int:
        if isinstance(tree, dict):
            return sum(local_bytes(v) for v in tree.values())
        if isinstance(tree, torch.Tensor):
            local = tree.to_local() if hasattr(tree, "to_local") else tree
            return local.numel() * local.element_size()
        return 0

    sizes = torch.tensor([local_bytes(model_sd), local_bytes(optim_sd)], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(sizes)
    model_bytes, optim_bytes = sizes.tolist()
    return int(1.1 * (2 * model_bytes + optim_bytes)) + 64 * 1024


def _check_space(root: Path, needed: int, step: int) -> None:
    """Rank 0 looks at the disk; every rank raises the same one-line fault, so none waits on the others."""
    ok = torch.tensor([1])
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(root).free
        ok[0] = int(free >= needed)
    if dist.is_initialized():
        dist.broadcast(ok, src=0)
    if not ok.item():
        free = shutil.disk_usage(root).free
        raise faults.RunFault(
            f"disk full: checkpoint step_{step} needs about {_mb(needed)} in {root} but only {_mb(free)} is free; "
            f"{_newest_note(root.parent)}")


def _mb(count: float) -> str:
    return f"{count / 2**20:.1f} MiB"


def _newest_note(run_dir: Path) -> str:
    step = latest_step(run_dir)
    if step is None:
        return "no checkpoint was written yet"
    return f"step_{step} is the newest complete checkpoint: free some space, then --resume"


def _disk_full(exc: BaseException) -> bool:
    return (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or "No space left on device" in str(exc)


def _write_manifest(folder: Path) -> None:
    entries = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
               for p in sorted(folder.rglob("*")) if p.is_file()}
    (folder / MANIFEST).write_text(json.dumps(entries, indent=1))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_problem(run_dir: Path, step: int) -> str | None:
    """Why checkpoint `step` cannot be loaded (a missing, truncated or altered file), or None if it can."""
    folder = checkpoint_dir(run_dir, step)
    try:
        state = json.loads((folder / "state.json").read_text())
        TrainerState(**{f.name: int(state[f.name]) for f in fields(TrainerState)})
    except (OSError, ValueError, KeyError, TypeError):
        return "state.json is unreadable"
    if not (folder / MANIFEST).exists():
        return None  # written before checkpoints had manifests: nothing to verify against
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"{MANIFEST} is unreadable"
    for name, expected in manifest.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected["bytes"]:
            return f"{name} has {size} bytes, {expected['bytes']} were written"
        if _sha256(path) != expected["sha256"]:
            return f"{name} does not match its checksum"
    return None


class CheckpointUnusable(ValueError):
    """No checkpoint `--resume` may load as asked; one line for the user."""


def resume_step(run_dir: Path, fall_back: bool = False) -> tuple[int, list[str]]:
    """The step `--resume` continues from: the newest complete checkpoint, once verified.

    A damaged newer checkpoint refuses the resume, naming the newest usable step; with `fall_back`
    the damaged ones are moved aside to `step_N.damaged` (kept for inspection, never loaded) and the
    newest usable one is used. Returns the step and one note per checkpoint moved aside.
    """
    steps = complete_steps(run_dir)
    if not steps:
        raise CheckpointUnusable(f"--resume: no complete checkpoint in {Path(run_dir) / 'checkpoints'}")
    damaged, good = [], None
    for step in reversed(steps):
        problem = checkpoint_problem(run_dir, step)
        if problem is None:
            good = step
            break
        damaged.append((step, problem))
    if damaged and (good is None or not fall_back):
        bad, why = damaged[0]
        hint = (f"step_{good} is usable: pass --resume-from-last-good to continue from it" if good is not None
                else "no earlier checkpoint is usable")
        raise CheckpointUnusable(f"--resume: checkpoint step_{bad} is damaged ({why}); {hint}")
    notes = []
    for bad, why in damaged:
        folder = checkpoint_dir(run_dir, bad)
        folder.rename(folder.with_name(folder.name + ".damaged"))
        notes.append(f"checkpoint step_{bad} is damaged ({why}): moved to {folder.name}.damaged")
    return good, notes


def prune_checkpoints(run_dir: Path, keep: int) -> list[int]:
    """Delete all but the newest `keep` complete checkpoints (rank 0 only); returns the steps deleted.

    A checkpoint is renamed out of the `step_N` namespace before its files go, so a crash while
    deleting never leaves a half-deleted folder that looks complete."""
    if keep <= 0 or _rank() != 0:
        return []
    doomed = complete_steps(run_dir)[:-keep]
    for step in doomed:
        folder = checkpoint_dir(run_dir, step)
        gone = folder.with_name(folder.name + ".deleting")
        folder.rename(gone)
        shutil.rmtree(gone)
    return doomed


def drop_older_optimizer_states(run_dir: Path) -> list[int]:
    """Remove `optim/` from every complete checkpoint but the newest (rank 0 only); returns their steps.

    The manifest is rewritten without those files first (atomically), so a crash half-way leaves only
    unlisted files behind, never a checkpoint that fails its own check."""
    if _rank() != 0:
        return []
    dropped = []
    for step in complete_steps(run_dir)[:-1]:
        folder = checkpoint_dir(run_dir, step)
        if not (folder / "optim").exists():
            continue
        manifest_path = folder / MANIFEST
        if manifest_path.exists():
            manifest = json.loads(manifest_path.read_text())
            kept = {name: entry for name, entry in manifest.items() if not name.startswith("optim/")}
            write_atomic(manifest_path, json.dumps(kept, indent=1))
        shutil.rmtree(folder / "optim")
        dropped.append(step)
    return dropped


def has_optimizer_state(run_dir: Path, step: int) -> bool:
    return (checkpoint_dir(run_dir, step) / "optim").is_dir()


def load_checkpoint(run_dir: Path, step: int, model, optimizer) -> TrainerState:
    """Weights, optimizer state (when the checkpoint kept it; else the optimizer starts fresh), RNG."""
    folder = checkpoint_dir(run_dir, step)
    model_sd = _untied_model_state(model)
    dcp.load(model_sd, storage_reader=dcp.HuggingFaceStorageReader(str(folder / "model")))
    set_model_state_dict(model, model_sd, options=StateDictOptions(strict=False))
    if has_optimizer_state(run_dir, step):
        optim = {"optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(optim, checkpoint_id=str(folder / "optim"))
        set_optimizer_state_dict(model, optimizer, optim["optim"])
    rng_file = folder / f"rng_rank{_rank()}.pt"
    if rng_file.exists():
        _set_rng_state(torch.load(rng_file, weights_only=True))
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
