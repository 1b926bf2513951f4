"""Builds the native engine's decode loops (cpu_decode.c) for this machine and loads them, as safely as a
library's own build: a damaged, planted or foreign library is never run, a failure is said once and
remembered, and the loops join torch's own OpenMP runtime.

Why at run time (docs/cpu.md, "How the loops are built"): `-march=native` tunes the loops to the exact CPU
(vector width, bf16 dot products where present) and a build takes 2-3 s once per machine, while a wheel
would need one variant per ISA level and a dispatcher. What makes it safe:
- the cache folder is the user's own, 0700 (colorl.files.private_dir);
- the library's name hashes everything it is built from (sources, flags, compiler and its version, the
  CPU's identity and torch's ISA, torch's OpenMP runtime): another CPU or compiler never loads it;
- builds are locked per library (the ranks of a run start together: one compiles, the others wait) and
  written under an unpredictable temporary name, flushed to disk before the rename;
- a manifest beside the library records its size and SHA-256 after a child process loaded it and ran
  each kernel once (a SIGILL or SIGBUS ends the child, not colorl); a library that does not match its
  manifest is rebuilt, never loaded;
- a failed build or check is remembered (`<hash>.failed`, with the reason) and said in one line, so a
  machine without a working compiler does not compile again at every start; a changed source, flag or
  compiler tries again;
- it links torch's own OpenMP runtime by path and rpath (compiled with `-fopenmp`, linked without the
  compiler's runtime), so a conda or Intel torch (libiomp5) or clang (libomp) never brings a second
  runtime into the process.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("cpu_decode.c")
HEADERS = tuple(SOURCE.with_name(name) for name in ("cpu_decode_team.h", "cpu_decode_loops.h", "cpu_decode_kpairs.h"))  # included by SOURCE
COMPILE_FLAGS = ("-O3", "-ffp-contract=fast", "-fPIC", "-std=gnu11")
# GCC's tuning for some CPUs (a Zen 2 or 3: -march=native there tunes for znver2 or 3) leaves a loop's a * b + c unfused
# where it sees a chain of FMAs, and fuses the same sum in another loop: two loops that add the same products in the
# same order then differ in their last bits, and with them the engine's tokens by row count (on a Zen 3 the 20-row
# product's rows differed from the same rows alone). Fused everywhere, the bits are the same under any tuning.
GCC_EXACT_FLAGS = ("--param=avoid-fma-max-bits=0",)
ARCHES = ("x86_64", "amd64", "aarch64", "arm64")
OPENMP_NAMES = ("libgomp", "libiomp5", "libomp")

# Run in a child process on a new library: load it and run each kernel once on tiny inputs, so that an
# instruction this CPU lacks (SIGILL) or a damaged file (SIGBUS) ends the child, not colorl.
_CHECK = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
f = (ctypes.c_float * 64)(*[0.01 * i for i in range(64)])
out = (ctypes.c_float * 64)()
h = (ctypes.c_uint16 * 64)(*[0x3f80] * 64)
hout = (ctypes.c_uint16 * 64)()
i64, p = ctypes.c_int64, ctypes.c_void_p
for name, x, y in (("colorl_linear_f32", f, out), ("colorl_linear_bf16", h, hout)):
    fn = getattr(lib, name)
    fn.argtypes = [p, p, p, p, i64, i64, i64, ctypes.c_int]
    for rows in (1, 3, 8):
        if fn(x, x, None, y, rows, 4, 8, 1) != 0:
            sys.exit(3)
for name, x, y in (("colorl_silu_mul_f32", f, out), ("colorl_silu_mul_bf16", h, hout)):
    fn = getattr(lib, name)
    fn.argtypes = [p, p, i64, i64]
    fn(x, y, 2, 16)
fn = lib.colorl_sample_plain
fn.argtypes = [p, i64, i64, p, p, p, ctypes.c_int]
u = (ctypes.c_double * 2)(0.5, 1.0)
tokens = (ctypes.c_int64 * 2)()
if fn(f, 2, 32, u, tokens, out, 1) != 0 or not all(0 <= t < 32 for t in tokens):
    sys.exit(3)
print("ok")
"""


class LoopsUnavailable(Exception):
    """Why the compiled loops are not used here: one line for the user."""


@dataclass(frozen=True)
class Built:
    path: Path
    build: str  # the library's hash: names the source, flags, compiler, CPU and OpenMP runtime


def compiler() -> list[str]:
    command = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    if not command or shutil.which(command[0]) is None:
        command = ["cc"]
    if shutil.which(command[0]) is None:
        raise LoopsUnavailable("no C compiler found (install gcc, or set CC)")
    return command


def march() -> str:
    """`COLORL_CPU_DECODE_ARCH` (a -march value, e.g. x86-64-v3 for AVX2) builds for an older CPU than this
    one: `make test-avx2` runs the loops as an AVX2-only machine would."""
    return os.environ.get("COLORL_CPU_DECODE_ARCH") or "native"


def tune_flags() -> tuple[str, ...]:
    """`COLORL_CPU_DECODE_TUNE` (a -mtune value, e.g. znver3) tunes the loops for another CPU than -march's: `make
    test-avx2` builds for an AVX2-only Zen 3 on any x86 CPU, tuning included (GCC's tuning once changed the bits)."""
    tune = os.environ.get("COLORL_CPU_DECODE_TUNE")
    return (f"-mtune={tune}",) if tune else ()


def exact_flags(version: str) -> tuple[str, ...]:
    """The flags that keep every loop's sums fused (GCC_EXACT_FLAGS) where the compiler is GCC; clang fuses them all
    under -ffp-contract=fast and knows no such parameter."""
    return GCC_EXACT_FLAGS if "Free Software Foundation" in version and "clang" not in version.lower() else ()


def openmp_runtime() -> Path:
    """torch's own OpenMP runtime: in torch's lib folder (pip wheels), else whichever this process loaded."""
    import torch

    lib = Path(torch.__file__).parent / "lib"
    for name in OPENMP_NAMES:
        found = sorted(lib.glob(f"{name}[.-]*so*")) + sorted(lib.glob(f"{name}*.dylib"))
        if found:
            return found[0]
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if re.search(r"/(libgomp|libiomp5|libomp)[.-][^/]*so", path):
                    return Path(path)
    except OSError:
        pass
    raise LoopsUnavailable("torch's OpenMP runtime was not found, and a second runtime would fight torch's threads")


def _openmp_compile_flags(version: str) -> tuple[str, ...]:
    if "Apple" in version or platform.system() == "Darwin":  # Apple clang takes OpenMP only through the preprocessor
        return ("-Xpreprocessor", "-fopenmp")
    return ("-fopenmp",)


def _digest(parts: list[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _first_error(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["no output"])[0][:200]


class Builder:
    """One library of the loops in `folder` for this machine."""

    def __init__(self, folder: Path) -> None:
        from colorl.files import UnsafeFolder, private_dir
        from colorl.machine import machine_key

        try:
            self.folder = private_dir(folder)
        except (UnsafeFolder, OSError) as exc:
            raise LoopsUnavailable(f"the cache folder cannot be trusted or made ({exc})") from None
        self.command = compiler()
        try:
            self.version = subprocess.run([*self.command, "--version"], capture_output=True, text=True,
                                          timeout=30).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            raise LoopsUnavailable(f"the C compiler {self.command[0]} does not run ({exc})") from None
        self.runtime = openmp_runtime()
        self.compile_flags = (f"-march={march()}", *tune_flags(), *COMPILE_FLAGS, *exact_flags(self.version),
                              *_openmp_compile_flags(self.version))
        self.build = _digest([SOURCE.read_text(), *(header.read_text() for header in HEADERS), " ".join(self.compile_flags),
                              " ".join(self.command), self.version, machine_key(), str(self.runtime)])
        self.library = self.folder / f"{self.build}.so"
        self.manifest = self.folder / f"{self.build}.json"
        self.failed = self.folder / f"{self.build}.failed"

    def ensure(self) -> Built:
        """The checked library, built (or rebuilt over a damaged one) under a lock if need be."""
        if self._intact():
            return Built(self.library, self.build)
        with open(self.folder / f"{self.build}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self._intact():  # another rank built it while this one waited
                return Built(self.library, self.build)
            self._build_and_check()
        return Built(self.library, self.build)

    def _intact(self) -> bool:
        if self.failed.is_file():
            reason = self.failed.read_text(errors="replace").strip() or "an earlier build failed"
            raise LoopsUnavailable(f"{reason} (remembered in {self.failed}; delete it to try again)")
        try:
            manifest = json.loads(self.manifest.read_text())
            size = self.library.stat().st_size
        except (OSError, ValueError):
            return False
        return (isinstance(manifest, dict) and manifest.get("size") == size
                and manifest.get("sha256") == _sha256(self.library))

    def _build_and_check(self) -> None:
        from colorl.files import write_atomic

        handle, partial = tempfile.mkstemp(prefix=f".{self.build}.", suffix=".so", dir=self.folder)
        os.close(handle)
        obj = Path(partial).with_suffix(".o")
        link = ["-shared", str(obj), "-o", partial, str(self.runtime), f"-Wl,-rpath,{self.runtime.parent}", "-lm"]
        if platform.system() == "Linux":
            link.append("-Wl,--no-undefined")  # an OpenMP call the linked runtime lacks fails here, not at load
        try:
            for args in ([*self.compile_flags, "-c", str(SOURCE), "-o", str(obj)], link):
                done = subprocess.run([*self.command, *args], capture_output=True, text=True, timeout=300)
                if done.returncode:
                    self._fail(f"the C compiler failed: {_first_error(done.stderr + done.stdout)}")
            with open(partial, "rb+") as built:
                os.fsync(built.fileno())
            check = subprocess.run([sys.executable, "-c", _CHECK, partial], capture_output=True, text=True, timeout=120)
            if check.returncode or check.stdout.strip() != "ok":
                what = (f"signal {-check.returncode}" if check.returncode < 0
                        else _first_error(check.stderr) if check.stderr.strip() else f"exit {check.returncode}")
                self._fail(f"the built library failed its check in a child process ({what})")
            os.replace(partial, self.library)
            write_atomic(self.manifest, json.dumps({"size": self.library.stat().st_size,
                                                    "sha256": _sha256(self.library), "flags": self.compile_flags,
                                                    "compiler": self.command, "openmp": str(self.runtime)}))
        except subprocess.TimeoutExpired:
            raise LoopsUnavailable("the C compiler timed out") from None
        finally:
            for leftover in (obj, Path(partial)):
                leftover.unlink(missing_ok=True)

    def _fail(self, reason: str):
        from colorl.files import write_atomic

        write_atomic(self.failed, reason + "\n")
        raise LoopsUnavailable(reason)


def build_library() -> Built:
    """The checked library for this machine, built on first use; raises LoopsUnavailable with the reason."""
    from colorl.models import cache_root

    if os.environ.get("COLORL_CPU_DECODE", "1") == "0":
        raise LoopsUnavailable("switched off by COLORL_CPU_DECODE=0")
    if platform.machine().lower() not in ARCHES:
        raise LoopsUnavailable(f"no compiled loops for {platform.machine()} CPUs")
    return Builder(cache_root() / "cpu_decode").ensure()


def open_library(built: Built) -> ctypes.CDLL:
    """Loads the library checked by `Builder`: its size and hash are compared again just before, so a file
    damaged since its check is refused, not run."""
    manifest = json.loads(built.path.with_suffix(".json").read_text())
    if manifest.get("size") != built.path.stat().st_size or manifest.get("sha256") != _sha256(built.path):
        raise LoopsUnavailable(f"{built.path} changed after its check")
    return ctypes.CDLL(str(built.path))
