"""Install torch for `make setup`: the CPU build on a Linux machine without an NVIDIA GPU, found
where it is, in seconds.

PyPI's Linux torch is the multi-GB CUDA build. The CPU build lives on the PyTorch index, and often
on a local wheel folder or a mirror that pip is already configured with. Asking the PyTorch index
first, as a plain `--index-url`, costs minutes of retries on a machine that cannot reach it, so:
1. what pip's own configuration resolves `torch==VERSION` to, without downloading it (`--dry-run
   --report`): a `+cpu` build (local wheel, mirror) is taken;
2. else the PyTorch CPU index, if it answers within a few seconds;
3. else one line that says what to do, and exit code 2 — never a silent CUDA download.
A machine with `nvidia-smi`, or not Linux, takes PyPI's torch (CUDA on Linux, CPU elsewhere).

    python scripts/install_torch.py [--spec torch==2.13.0] [--index URL] [--print]
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import urllib.request

DEFAULT_SPEC = "torch==2.13.0"
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_TIMEOUT_S = 5


def wants_cpu_build() -> bool:
    return platform.system() == "Linux" and shutil.which("nvidia-smi") is None


def configured_version(spec: str) -> str | None:
    """The torch version pip's configured indexes and wheel folders resolve `spec` to (no download)."""
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet",
           "--report", "-", "--retries", "0", "--timeout", str(PROBE_TIMEOUT_S), spec]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        return None
    try:
        report = json.loads(out.stdout)
    except json.JSONDecodeError:
        return None
    versions = [item["metadata"]["version"] for item in report.get("install", [])
                if item.get("metadata", {}).get("name", "").lower() == "torch"]
    return versions[0] if versions else None


def index_answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/torch/", timeout=PROBE_TIMEOUT_S) as response:
            return response.status == 200
    except OSError:
        return False


def pip_command(spec: str, index: str | None) -> list[str] | str:
    """The pip command to run, or a one-line reason why none can give a CPU torch here."""
    base = [sys.executable, "-m", "pip", "install", "--quiet", spec]
    if index is not None:  # the user chose (TORCH_INDEX=...; empty: pip's own configuration)
        return base + (["--index-url", index] if index else [])
    if not wants_cpu_build():
        return base
    version = configured_version(spec)
    if version is not None and version.endswith("+cpu"):
        return base
    if index_answers(PYTORCH_CPU_INDEX):
        return base + ["--index-url", PYTORCH_CPU_INDEX]
    found = f"pip's indexes offer {spec} only as {version}" if version else f"pip's indexes do not offer {spec}"
    return (f"no CPU build of {spec} is reachable: {found} (PyPI's Linux torch is the multi-GB CUDA build) and "
            f"{PYTORCH_CPU_INDEX} did not answer within {PROBE_TIMEOUT_S} s; put the CPU wheel in a folder and set "
            f"PIP_FIND_LINKS=<folder>, or take PyPI's CUDA build with `make setup TORCH_INDEX=`")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default=DEFAULT_SPEC)
    parser.add_argument("--index", default=None, help="an index URL; empty: pip's own configuration")
    parser.add_argument("--print", action="store_true", help="print the pip command instead of running it")
    args = parser.parse_args(argv)
    command = pip_command(args.spec, args.index)
    if isinstance(command, str):
        print(f"install_torch: error: {command}", file=sys.stderr)
        return 2
    if args.print:
        print(" ".join(command[1:]))
        return 0
    print(f"installing {args.spec}" + (f" from {command[-1]}" if "--index-url" in command else ""), flush=True)
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())
