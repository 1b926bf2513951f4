"""What a bench's figures hold for: the CPU model and its widest vector ISA (figures differ by CPU)."""
from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.processor() or platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    family, model = (next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith(key)), "?")
                     for key in ("cpu family", "model\t"))
    name = f"{name}, family {family} model {model}"
    extras = "".join(f", {label}" for flag, label in (("avx512_bf16", "bf16"), ("amx_tile", "AMX")) if flag in flags)
    return f"{name} ({isa}{extras}), {os.cpu_count()} threads"
