"""Which CPU this is: its name for people (bench tables, CI logs, `colorl doctor --kernels`) and its key for
what colorl measures or compiles per machine (kernel verdicts, the compiled decode loops).

The key must differ wherever code built or raced on one CPU may not hold on another. x86 Linux names the
model and its flags in /proc/cpuinfo; arm64 Linux prints neither (it has `CPU implementer`, `CPU part` and
`Features`: a Graviton2 and a Graviton3 differ there, and -march=native puts SVE into the latter's build);
macOS has no /proc/cpuinfo at all (sysctl names the chip). torch's own ISA detection (the capability ATen
dispatches to) is part of the key on every system, so a CPU whose features we failed to read still gets
a key of its own for each ISA level it runs.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
from dataclasses import dataclass

# the flags that change which kernels run (x86 names as /proc/cpuinfo spells them; arm64 Features)
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "asimd", "sve", "sve2", "bf16")
# environment variables that change which kernels third-party code picks on the same CPU
ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "COLORL_CPU_DECODE_ARCH", "COLORL_CPU_DECODE_TUNE")


@dataclass(frozen=True)
class CpuIdentity:
    """What this system says of its CPU: a model name and the lines that identify it exactly."""

    model: str
    arch: str  # platform.machine(), lower case
    identity: tuple[str, ...]  # the raw lines that name the model and its features
    flags: frozenset[str]


def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return ""


def _sysctl(*names: str) -> list[str]:
    try:
        out = subprocess.run(["sysctl", *names], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


@functools.cache
def cpu_identity() -> CpuIdentity:
    arch = platform.machine().lower()
    info = _read("/proc/cpuinfo")
    lines = info.splitlines()
    if lines:
        keys = ("model name", "flags", "cpu family", "model\t", "stepping", "CPU implementer", "CPU architecture",
                "CPU variant", "CPU part", "CPU revision", "Features", "Hardware")
        identity: list[str] = []
        for key in keys:  # the first processor's line of each kind (every core is the same model)
            identity += [line for line in lines if line.startswith(key)][:1]
        feature_line = next((line for line in lines if line.startswith(("flags", "Features"))), "")
        flags = frozenset(feature_line.split(":", 1)[1].split()) if ":" in feature_line else frozenset()
        model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
        if not model:
            part = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in identity if ":" in line}
            model = (f"{arch} implementer {part.get('CPU implementer', '?')} part {part.get('CPU part', '?')}"
                     if "CPU part" in part else part.get("Hardware", ""))
    else:  # macOS (no /proc): the chip's name and its optional features
        identity = _sysctl("machdep.cpu.brand_string", "hw.optional", "hw.cpufamily", "hw.cpusubfamily")
        model = next((line.split(":", 1)[1].strip() for line in identity if line.startswith("machdep.cpu.brand_string")),
                     "")
        flags = frozenset(line.split(":")[0].rsplit(".", 1)[-1].lower().removeprefix("feat_")
                          for line in identity if line.startswith("hw.optional") and line.endswith(": 1"))
    return CpuIdentity(model or platform.processor() or arch, arch, tuple(identity), flags)


def _cache_size(text: str) -> int | None:
    """sysfs's "32768K", "300M" or "1G"; None for anything else."""
    text = text.strip().upper()
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    try:
        return int(text[:-1]) * units[text[-1]] if text and text[-1] in units else int(text)
    except ValueError:
        return None


@functools.cache
def last_level_cache_bytes(sysfs: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The largest data cache the first core reaches (its last level: a whole socket's L3 on most Xeons, one
    core complex's on AMD), from Linux's sysfs, or macOS's sysctl; None where the system does not say."""
    sizes = {}
    try:
        entries = sorted(os.listdir(sysfs))
    except OSError:
        entries = []
    for entry in entries:
        if entry.startswith("index") and _read(f"{sysfs}/{entry}/type").strip() in ("Data", "Unified"):
            level, size = _read(f"{sysfs}/{entry}/level").strip(), _cache_size(_read(f"{sysfs}/{entry}/size"))
            if level.isdigit() and size:
                sizes[int(level)] = size
    if sizes:
        return sizes[max(sizes)]
    if platform.system() != "Darwin":
        return None
    for line in _sysctl("hw.l3cachesize", "hw.perflevel0.l2cachesize", "hw.l2cachesize"):
        size = _cache_size(line.split(":", 1)[-1]) if ":" in line else None
        if size:
            return size
    return None


def resolve_device(requested: str) -> str:
    """What launch.device (or --device) `requested` means on this machine: "auto" is CUDA if torch sees a
    GPU, else the CPU; anything else stays as given."""
    if requested != "auto":
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_capability() -> str:
    """The ISA torch dispatches its own CPU kernels to here ("AVX512", "AVX2", "DEFAULT", ...)."""
    import torch

    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return "unknown"


def machine_key() -> str:
    """This CPU (its identity, torch's ISA), torch's version and the ISA variables in force: what a measured
    or compiled kernel holds for."""
    import torch

    cpu = cpu_identity()
    digest = hashlib.sha1("\n".join((cpu.arch, *cpu.identity, torch_capability())).encode()).hexdigest()[:12]
    caps = "".join(f" {name}={os.environ[name]}" for name in ISA_VARIABLES if os.environ.get(name))
    return f"{digest} torch {torch.__version__}{caps}"


def cpu_summary() -> str:
    """One line for people: the model, the flags that change which kernels run, torch's ISA and the cores."""
    cpu = cpu_identity()
    present = [flag for flag in ISA_FLAGS if flag in cpu.flags]
    fields = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in cpu.identity if ":" in line}
    model = cpu.model + (f", family {fields['cpu family']} model {fields['model']}"
                         if "cpu family" in fields and "model" in fields else "")
    return (f"{model} ({cpu.arch}; {' '.join(present) or 'none of ' + '/'.join(ISA_FLAGS[:4])}; "
            f"torch ISA {torch_capability()}), {os.cpu_count()} cores")
