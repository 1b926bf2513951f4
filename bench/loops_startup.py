"""What the native engine's run-time build of its decode loops costs a process at start (docs/cpu.md, "How the
loops are built"): the first start on a machine (compile, check in a child process, load) against every later
start (size and hash checked, then load), each in a fresh process with an empty cache of its own, and the
same for a start with the loops switched off (COLORL_CPU_DECODE=0) as the baseline. `colorl.models` is
imported before the clock starts: a run imports it anyway.

Then what the run-time build buys in speed over the builds an install-time wheel would ship: the rows
kernel's decode products (colorl.engines.native.cpu_decode.race_rows: race_bytes() of weights streamed at 1, 4 and 8
rows, best of its rounds) in the loops built with -march=native against the same source built for the ISA
levels a wheel carries (x86-64-v3: AVX2; x86-64-v4: AVX-512, only where the CPU has it), each in a fresh
process, alternating; oneDNN's product over the same weights, timed in the same process, is the fixed
baseline each build is also held to.

    python bench/loops_startup.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import cpu_model  # bench/

RESULTS = Path(__file__).resolve().parent / "results" / "loops_startup.json"
PROBE = ("import time, colorl.models; from colorl.engines.native import cpu_decode; t = time.perf_counter(); "
         "lib = cpu_decode.load(); print(time.perf_counter() - t, lib is not None)")


def start(cache: Path, **env: str) -> tuple[float, bool]:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                         env={**os.environ, "COLORL_CACHE": str(cache), **env})
    seconds, loaded = out.stdout.split()
    return float(seconds), loaded == "True"


SPEED_PROBE = ("import json, torch, colorl.models; from colorl.engines.native import cpu_decode; "
               "lib = cpu_decode.load(); assert lib is not None, cpu_decode.why_not(); "
               "print(json.dumps(cpu_decode.race_rows(lib, torch.float32)['seconds']))")
SPEED_ROWS = ("1", "4", "8")


def build_speed(cache: Path, arch: str | None) -> dict[str, tuple[float, float]]:
    """Each row count's best seconds (loops, oneDNN) over every pass of the race, for the loops built for `arch`
    (None: -march=native)."""
    env = {**os.environ, "COLORL_CACHE": str(cache), "COLORL_CPU_DECODE_ROWS": ""}
    if arch:
        env["COLORL_CPU_DECODE_ARCH"] = arch
    out = subprocess.run([sys.executable, "-c", SPEED_PROBE], capture_output=True, text=True, check=True, env=env)
    seconds = json.loads(out.stdout.strip().splitlines()[-1])
    return {rows: (min(p[0] for p in seconds[rows]), min(p[1] for p in seconds[rows])) for rows in SPEED_ROWS}


def wheel_levels() -> list[str]:
    """The x86 ISA levels an install-time build would ship that this CPU can run."""
    from colorl.machine import cpu_identity

    flags = cpu_identity().flags
    return ["x86-64-v3"] + (["x86-64-v4"] if {"avx512f", "avx512bw", "avx512vl"} <= flags else [])


def speed_table(repeats: int) -> dict:
    builds = {"native": None, **{level: level for level in wheel_levels()}}
    best: dict[str, dict[str, list[float]]] = {name: {r: [] for r in SPEED_ROWS} for name in builds}
    onednn: dict[str, list[float]] = {r: [] for r in SPEED_ROWS}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(repeats):
            for name, arch in builds.items():  # alternating, so that a noisy moment hits every build
                for rows, (loops, other) in build_speed(Path(folder) / name, arch).items():
                    best[name][rows].append(loops)
                    onednn[rows].append(other)
    from colorl.engines.native import cpu_decode

    gigabytes = cpu_decode.race_bytes() / 1e9  # what race_rows streams
    print(f"\ndecode products over {gigabytes * 1e3:.0f} MB, fp32, {torch_threads()} threads: GB/s (best of each build's "
          f"rounds, {repeats} processes each), and the run-time build (native) against each")
    print(f"{'build':12}" + "".join(f" {r + ' rows':>9}" for r in SPEED_ROWS) + "".join(
        f" {'native/' + r:>9}" for r in SPEED_ROWS))
    table = {}
    for name in builds:
        rates = {r: gigabytes / min(best[name][r]) for r in SPEED_ROWS}
        ratios = {r: min(best[name][r]) / min(best["native"][r]) for r in SPEED_ROWS}
        table[name] = {"gb_per_s": rates, "native_speedup": ratios}
        print(f"{name:12}" + "".join(f" {rates[r]:9.1f}" for r in SPEED_ROWS) + "".join(
            f" {ratios[r]:8.2f}x" for r in SPEED_ROWS))
    table["onednn"] = {"gb_per_s": {r: gigabytes / min(onednn[r]) for r in SPEED_ROWS}}
    print(f"{'oneDNN':12}" + "".join(f" {table['onednn']['gb_per_s'][r]:9.1f}" for r in SPEED_ROWS))
    return table


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    first, cached, off = [], [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as folder:
            seconds, loaded = start(Path(folder))
            assert loaded, "the loops did not build here"
            first.append(seconds)
            cached.append(start(Path(folder))[0])
            off.append(start(Path(folder), COLORL_CPU_DECODE="0")[0])
    rows = {"first start (build, check, load)": first, "later start (verify, load)": cached,
            "loops off (baseline)": off}
    cpu = cpu_model()
    print(f"{cpu}; {args.repeats} fresh processes each")
    print(f"{'':36} {'median s':>9} {'min s':>8} {'max s':>8}")
    for name, values in rows.items():
        print(f"{name:36} {statistics.median(values):9.3f} {min(values):8.3f} {max(values):8.3f}")
    speed = speed_table(args.repeats)
    Path(args.out).write_text(json.dumps({"date": datetime.date.today().isoformat(), "cpu": cpu,
                                          "repeats": args.repeats, "seconds": rows, "build_speed": speed}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
