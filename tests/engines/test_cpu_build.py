"""colorl/engines/native/cpu_build.py: the compiled loops' library is built, cached and loaded like a library's
own build: a damaged, planted or foreign library never runs, a failure is said once and remembered, and the
loops join torch's OpenMP runtime."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from colorl.engines.native import cpu_build
from colorl.machine import cpu_identity

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or shutil.which(os.environ.get("CC") or "cc") is None,
    reason="the build checks run where Linux and a C compiler are (CI's machines)")

# a fresh process: `load()` and `why_not()` are per process, as they are for a user's run
PROBE = ("import sys, colorl.engines.native.cpu_decode as c; lib = c.load(); "
         "print('loaded' if lib is not None else 'none'); print(c.why_not() or '')")


def probe(cache: Path, **env) -> subprocess.CompletedProcess:
    run_env = {**os.environ, "COLORL_CACHE": str(cache), **env}
    run_env.pop("COLORL_CPU_DECODE", None)
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=run_env, timeout=300)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A cache holding one good build, copied into each test's own cache."""
    cache = tmp_path_factory.mktemp("built")
    result = probe(cache)
    assert result.stdout.split()[0] == "loaded", result.stderr
    return cache


@pytest.fixture
def cache(built, tmp_path):
    copy = tmp_path / "cache"
    shutil.copytree(built, copy)
    (copy / "cpu_decode").chmod(0o700)
    return copy


def library(cache: Path) -> Path:
    (found,) = (cache / "cpu_decode").glob("*.so")
    return found


def test_a_good_build_loads_and_is_recorded_by_size_and_hash(cache):
    import json

    lib = library(cache)
    manifest = json.loads(lib.with_suffix(".json").read_text())
    assert manifest["size"] == lib.stat().st_size and len(manifest["sha256"]) == 64
    assert (cache / "cpu_decode").stat().st_mode & 0o777 == 0o700
    assert probe(cache).stdout.split()[0] == "loaded"


@pytest.mark.parametrize("damage", ["truncated", "zero-length", "planted"])
def test_a_damaged_or_planted_library_is_rebuilt_never_run(cache, damage):
    """A library truncated to 30 KB had killed every start with SIGBUS; a zero-length one disabled the loops
    for good; a planted one ran its constructor inside colorl."""
    lib = library(cache)
    good = lib.read_bytes()
    if damage == "truncated":
        lib.write_bytes(good[:30_000])
    elif damage == "zero-length":
        lib.write_bytes(b"")
    else:
        marker = cache / "planted-ran"
        source = cache / "planted.c"
        source.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void run(void) '
                          f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
        subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(lib)], check=True)
    result = probe(cache)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "loaded"
    assert lib.read_bytes() == good  # rebuilt from the sources: the same bytes as a good build
    if damage == "planted":
        assert not marker.exists()


def test_a_library_that_crashes_its_check_is_not_loaded_and_remembered(tmp_path):
    """A library built for instructions this CPU lacks dies with SIGILL (a Graviton3 build on a Graviton2, an
    AVX-512 build on an AVX2 CPU): in the child that checks it, not in colorl; the reason is said once and
    remembered, so the next start does not build again. Here a compiler wrapper adds an illegal instruction
    that runs when the library loads, the same on every CPU."""
    cache = tmp_path / "cache"
    trap = tmp_path / "trap.h"
    trap.write_text("__attribute__((constructor)) static void colorl_test_trap(void) { __builtin_trap(); }\n")
    wrapper = tmp_path / "bin" / "cc"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = -c ] && exec cc \"$@\" -include {trap}; done\n"
                       "exec cc \"$@\"\n")
    wrapper.chmod(0o755)
    first = probe(cache, CC=str(wrapper))
    assert first.returncode == 0, first.stderr
    assert first.stdout.split()[0] == "none" and "check in a child process (signal 4)" in first.stdout
    said = [line for line in first.stderr.splitlines() if "decode loops are not used" in line]
    assert len(said) == 1
    assert list((cache / "cpu_decode").glob("*.failed")) and not list((cache / "cpu_decode").glob("*.so"))
    second = probe(cache, CC=str(wrapper))
    assert second.stdout.split()[0] == "none" and "remembered" in second.stdout


def test_a_compile_error_is_said_once_and_remembered(tmp_path):
    cache = tmp_path / "cache"
    fake = tmp_path / "bin" / "cc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fakecc 1.0; exit 0; fi\n"
                    "echo 'fatal error: omp.h: No such file or directory' >&2; exit 1\n")
    fake.chmod(0o755)
    first = probe(cache, CC=str(fake))
    assert first.stdout.split()[0] == "none" and "omp.h" in first.stdout
    assert sum("decode loops are not used" in line for line in first.stderr.splitlines()) == 1
    second = probe(cache, CC=str(fake))
    assert "remembered" in second.stdout and "delete it to try again" in second.stdout


def test_a_cache_folder_of_another_user_is_not_used(cache):
    if os.geteuid() != 0:
        pytest.skip("giving a folder away needs root")
    os.chown(cache / "cpu_decode", 12345, -1)
    result = probe(cache)
    assert result.stdout.split()[0] == "none" and "another user" in result.stdout


def test_the_loops_link_torchs_own_openmp_runtime(cache):
    runtime = cpu_build.openmp_runtime()
    assert runtime.name.startswith(cpu_build.OPENMP_NAMES)
    linked = subprocess.run(["ldd", str(library(cache))], capture_output=True, text=True).stdout
    omp_lines = [line for line in linked.splitlines() if any(name in line for name in cpu_build.OPENMP_NAMES)]
    assert len(omp_lines) == 1 and str(runtime.resolve().parent) in omp_lines[0]


def test_ranks_starting_together_build_once(tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "COLORL_CACHE": str(cache)}
    env.pop("COLORL_CPU_DECODE", None)
    processes = [subprocess.Popen([sys.executable, "-c", PROBE], env=env, stdout=subprocess.PIPE, text=True)
                 for _ in range(3)]
    assert [p.communicate(timeout=300)[0].split()[0] for p in processes] == ["loaded"] * 3
    assert len(list((cache / "cpu_decode").glob("*.so"))) == 1
    assert not list((cache / "cpu_decode").glob(".*"))  # no temporary left behind


# a 20-row product (two whole tiles of 8 and a part one) against each of its rows alone through the few-rows loop
SAME_BITS = ("import torch; import colorl.engines.native.cpu_decode as c; lib = c.load(); assert lib is not None, "
             "c.why_not(); g = torch.Generator().manual_seed(5); x = torch.randn(20, 400, generator=g); "
             "w = torch.randn(222, 400, generator=g); p = lib.pack_panels(w); y = lib.panel_linear(x, p, 222, None); "
             "print(sum(not torch.equal(y[r:r + 1], lib.panel_linear(x[r:r + 1], p, 222, None)) for r in range(20)))")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or "avx2" not in cpu_identity().flags,
                    reason="builds the AVX2 loops, which run on an x86 CPU with AVX2")
def test_loops_tuned_for_a_zen_3_sum_alike_in_every_loop(tmp_path):
    """GCC tunes a Zen 3 build (-march=native there) to leave some of a loop's a * b + c unfused, which gave a
    20-row product's rows other bits than the same rows alone on a Zen 3 (so a sequence's tokens depended on its
    batch). Built for that tuning on any x86 CPU, every row must have the same bits (cpu_build.GCC_EXACT_FLAGS)."""
    version = subprocess.run([*cpu_build.compiler(), "--version"], capture_output=True, text=True).stdout
    if not cpu_build.exact_flags(version):
        pytest.skip("not GCC: its FMA-chain tuning is what this guards against")
    env = {**os.environ, "COLORL_CACHE": str(tmp_path), "COLORL_CPU_DECODE_ARCH": "x86-64-v3",
           "COLORL_CPU_DECODE_TUNE": "znver3"}
    env.pop("COLORL_CPU_DECODE", None)
    done = subprocess.run([sys.executable, "-c", SAME_BITS], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "0", "rows whose bits differ from the same row alone: " + done.stdout
    (manifest,) = (tmp_path / "cpu_decode").glob("*.json")
    assert "-mtune=znver3" in manifest.read_text() and cpu_build.GCC_EXACT_FLAGS[0] in manifest.read_text()
