"""What the native engine's run-time build of its decode loops costs a process at start (docs/cpu.md, "How the
loops are built"): the first start on a machine (compile, check in a child process, load) against every later
start (size and hash checked, then load), each in a fresh process with an empty cache of its own, and the
same for a start with the loops switched off (COLORL_CPU_DECODE=0) as the baseline. `colorl.models` is
imported before the clock starts: a run imports it anyway.

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
    Path(args.out).write_text(json.dumps({"date": datetime.date.today().isoformat(), "cpu": cpu,
                                          "repeats": args.repeats, "seconds": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
