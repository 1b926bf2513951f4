"""colorl/engines/native/cpu_build.py: the compiled loops' library is built, cached and loaded like a library's
own build: a damaged, planted or foreign library never runs, a failure is said once and remembered, and the
loops join torch's OpenMP runtime."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from colorl.engines.native import cpu_build

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
