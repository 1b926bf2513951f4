"""The dtype a run computes and serves in where its config leaves that to colorl.

`train.mixed_precision: auto` and `engine.dtype: auto` (the defaults) become bf16 compute and bf16 serving over
float32 master weights and optimizer state — the usual set-up on GPUs; issue 31 measured 1.35x the float32 step
on an AMX Xeon — only where all of these hold:

- the model's weights are float32 (bf16 or fp16 weights already compute in their own dtype);
- the ranks run on a CPU whose oneDNN runs bf16 products (AVX512-BF16, AMX, AVX-NE-CONVERT;
  `colorl.kernels.onednn_dtypes`): elsewhere bf16 products are float32 products (`kernels.bf16_widened`) or
  torch's generic kernels, no faster than float32;
- this machine's race, a training layer's forward and backward at the rank's thread count, ran clearly faster
  in bf16 in every pass (colorl/verdicts.py: kept per machine and thread count, raced again after a busy or
  stale verdict, and kept in the run directory, so a resume computes in the dtype its run started in).

Elsewhere, and on CUDA (not measured here: set `train.mixed_precision: bfloat16` and `engine.dtype: bfloat16`
there), the run computes and serves in `model.dtype`, as before. Whether bf16 learns as float32 does on the
quickstart task: bench/mixed_precision.py. `COLORL_BF16=1` / `=0` skips the race and takes / refuses bf16.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

AUTO = "auto"


@dataclass(frozen=True)
class Precision:
    """What `auto` became for one run: the compute dtype (None: model.dtype), the served dtype (None: model.dtype)
    and the reason, shown on screen."""
    compute: str | None
    served: str | None
    why: str

    def line(self, model_dtype: str) -> str:
        return f"precision: compute {self.compute or model_dtype}, serving {self.served or model_dtype} ({self.why})"


def verdict_name(threads: int) -> str:
    return f"bf16 training layer at {threads} threads"


def forced_bf16() -> bool | None:
    return {"1": True, "0": False}.get(os.environ.get("COLORL_BF16", ""))


def race_bf16_layer() -> dict:
    """A training layer's forward and backward in bf16 against float32, through the products the trainer runs
    (colorl.kernels: oneDNN where chosen for training in that dtype)."""
    from colorl.kernels import TRAINING, differentiable_linear, training_layer
    from colorl.verdicts import stable_race

    def product(x, weight):
        return differentiable_linear(x, weight, None, TRAINING)

    return stable_race({"bfloat16": (training_layer(torch.bfloat16, product), training_layer(torch.float32, product))})


def bf16_wins_here() -> tuple[bool, str]:
    """Whether this CPU computes a training layer faster in bf16, and why, at this process's thread count."""
    from colorl.kernels import TRAINING, onednn_chosen, onednn_dtypes, onednn_enabled
    from colorl.verdicts import measured_verdict

    if not onednn_enabled():
        return False, "oneDNN is off here (COLORL_ONEDNN=0, not x86, or not in this torch): no fast bf16 products"
    if torch.bfloat16 not in onednn_dtypes():
        return False, "this CPU has no bf16 matrix products: no AVX512-BF16, AMX or AVX-NE-CONVERT"
    threads = torch.get_num_threads()
    for dtype in (torch.float32, torch.bfloat16):
        onednn_chosen(dtype, TRAINING)  # the products the race runs are chosen before it starts
    verdict = measured_verdict(verdict_name(threads), race_bf16_layer, keys=("won",))
    if verdict.get("busy"):
        return False, "the bf16 race ran on a busy machine: float32 until a quiet start races again"
    passes = verdict.get("seconds", {}).get("bfloat16")  # each pass: (bf16, float32) best seconds
    ratio = f" ({min(p[1] for p in passes) / min(p[0] for p in passes):.2f}x float32)" if passes else ""
    if "bfloat16" in verdict.get("won", []):
        return True, f"this machine's race ran a training layer faster in bf16{ratio} at {threads} threads"
    return False, f"bf16 was not clearly faster in this machine's race{ratio} at {threads} threads"


def auto_bf16() -> tuple[bool, str]:
    """What `auto` picks for float32 weights on this CPU at this thread count, and why."""
    forced = forced_bf16()
    if forced is not None:
        return forced, f"forced by COLORL_BF16={os.environ['COLORL_BF16']}"
    return bf16_wins_here()


def choose(cfg, device: str) -> Precision:
    """The dtypes for `cfg` on `device` (a rank's own, with its thread count set): an explicit setting is kept."""
    compute, served = cfg.train.mixed_precision, cfg.engine.dtype
    if compute != AUTO:  # an explicit compute dtype: the engine serves the weights' own unless told otherwise
        return Precision(compute, None if served == AUTO else served, "as configured")
    if cfg.model.dtype != "float32":
        bf16, why = False, f"model.dtype={cfg.model.dtype} computes in its own dtype"
    elif torch.device(device).type != "cpu" and forced_bf16() is None:
        bf16, why = False, "auto keeps the model's dtype on CUDA; set train.mixed_precision and engine.dtype to bfloat16"
    else:
        bf16, why = auto_bf16()
    picked = "bfloat16" if bf16 else None
    return Precision(picked, picked if served == AUTO else served, f"auto: {why}")


def compute_dtype(cfg, device: str) -> torch.dtype | None:
    """The trainer's forward/backward dtype (None: the weights' own)."""
    chosen = choose(cfg, device).compute
    return getattr(torch, chosen) if chosen else None


def served_dtype(cfg, device: str) -> torch.dtype:
    """The dtype the engine serves (the checkpoint engine casts the trained weights to it)."""
    return getattr(torch, choose(cfg, device).served or cfg.model.dtype)
