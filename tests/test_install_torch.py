"""scripts/install_torch.py: `make setup` finds the CPU torch where pip already looks, or says in one
line why it cannot, in seconds, and never falls back to PyPI's CUDA build on its own."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "install_torch.py"
spec = importlib.util.spec_from_file_location("install_torch", SCRIPT)
install_torch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(install_torch)


def _wheel(folder: Path, version: str) -> None:
    """A minimal wheel of `torch` at `version`: enough for pip to resolve it."""
    info = f"torch-{version}.dist-info"
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")


def _offline_env(wheels: Path) -> dict[str, str]:
    return {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels)}


@pytest.mark.parametrize("version, cpu", [("2.13.0+cpu", True), ("2.13.0", False)])
def test_reads_what_pips_own_configuration_resolves_to(tmp_path, monkeypatch, version, cpu):
    _wheel(tmp_path, version)
    for key, value in _offline_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    assert install_torch.configured_version("torch==2.13.0") == version
    monkeypatch.setattr(install_torch, "wants_cpu_build", lambda: True)
    monkeypatch.setattr(install_torch, "index_answers", lambda url: False)
    started = time.perf_counter()
    command = install_torch.pip_command("torch==2.13.0", None)
    assert time.perf_counter() - started < 60
    if cpu:  # the local CPU wheel, no PyTorch index asked
        assert command[-1] == "torch==2.13.0"
    else:  # a CUDA build is all pip would find: one line, no download
        assert isinstance(command, str) and "no CPU build" in command and "PIP_FIND_LINKS" in command


def test_asks_the_pytorch_index_only_when_nothing_local_is_a_cpu_build(monkeypatch):
    monkeypatch.setattr(install_torch, "wants_cpu_build", lambda: True)
    monkeypatch.setattr(install_torch, "configured_version", lambda spec: "2.13.0")
    monkeypatch.setattr(install_torch, "index_answers", lambda url: True)
    assert install_torch.pip_command("torch==2.13.0", None)[-2:] == ["--index-url", install_torch.PYTORCH_CPU_INDEX]
    assert install_torch.pip_command("torch==2.13.0", "")[-1] == "torch==2.13.0"  # TORCH_INDEX= : pip's own choice
    assert install_torch.pip_command("torch", "https://example.org/simple")[-1] == "https://example.org/simple"
    monkeypatch.setattr(install_torch, "wants_cpu_build", lambda: False)  # a GPU box: PyPI's (CUDA) torch
    assert install_torch.pip_command("torch==2.13.0", None)[-1] == "torch==2.13.0"


def test_unreachable_index_is_one_line_and_exit_2(tmp_path):
    env = {**_offline_env(tmp_path), "PATH": "/usr/bin:/bin"}  # no nvidia-smi
    out = subprocess.run([sys.executable, str(SCRIPT), "--print"], env=env, capture_output=True, text=True, timeout=120)
    if out.returncode == 0:  # this machine reaches the PyTorch CPU index: that is what it chose
        assert install_torch.PYTORCH_CPU_INDEX in out.stdout
    else:
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "no CPU build" in out.stderr
