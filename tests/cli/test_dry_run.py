"""`--dry-run` runs every check the launch runs (colorl/preflight.py) and answers the same way, with
nothing started or written; what only the target machine can answer is a warning there."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from colorl.cli import main
from colorl.models import save_tiny_model


def _no_template_model(folder: Path) -> Path:
    save_tiny_model(folder)
    (folder / "chat_template.jinja").unlink()
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder


def _rewriting_template_model(folder: Path) -> Path:
    """A template that hides past assistant turns: multi-turn episodes cannot extend it."""
    save_tiny_model(folder)
    template = (folder / "chat_template.jinja").read_text()
    rewriting = template.replace("{{ message['content'] }}", "{% if message['role'] == 'assistant' and not loop.last %}"
                                 "[earlier]{% else %}{{ message['content'] }}{% endif %}")
    assert rewriting != template
    (folder / "chat_template.jinja").write_text(rewriting)
    return folder


# (name, extra argv given a tmp folder, words of the one-line error both must print)
LAUNCH_CHECKS = [
    ("context length", lambda tmp: ["--set", "rollout.max_new_tokens=600"], ["rollout.max_new_tokens=600", "context of 512"]),
    ("model folder", lambda tmp: ["--set", f"model.path={tmp / 'none'}"], ["model.path", "not a folder"]),
    ("chat template", lambda tmp: ["--set", f"model.path={_no_template_model(tmp / 'bare')}"], ["cannot build a chat prompt"]),
    ("devices", lambda tmp: ["--device", "cuda"], ["launch.device=cuda", "no CUDA device"]),
    ("episode template", lambda tmp: ["--set", f"model.path={_rewriting_template_model(tmp / 'rw')}",
                                      "--set", "task.env=calculator"], ["task.env='calculator'", "rewrites earlier turns"]),
    ("resume point", lambda tmp: ["--resume"], ["no complete checkpoint"]),
]


@pytest.mark.parametrize("name, extra, words", LAUNCH_CHECKS, ids=[c[0] for c in LAUNCH_CHECKS])
def test_dry_run_refuses_what_the_launch_refuses(tmp_path, capsys, name, extra, words):
    if name == "devices":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA: the device check passes here")
    argv = ["train", "configs/tiny.yaml", "--run-dir", str(tmp_path / "run")] + extra(tmp_path)
    launch_code = main(argv)
    launch_err = capsys.readouterr().err.strip().splitlines()
    assert launch_code == 2 and len(launch_err) == 1 and all(w in launch_err[0] for w in words), launch_err
    dry_code = main(argv + ["--dry-run"])
    dry_err = capsys.readouterr().err.strip().splitlines()
    if name == "devices":  # a config may be written for another machine: --dry-run warns and validates the rest
        assert dry_code == 0 and dry_err == [f"colorl: warning: this machine could not launch it: {launch_err[0].split(': ', 2)[2]}"]
    else:
        assert dry_code == 2 and dry_err == launch_err
    assert not (tmp_path / "run").exists()


def test_dry_run_warns_like_the_launch_for_bf16_on_a_cpu_without_bf16_products(tmp_path):
    """oneDNN held to AVX2 (an AVX2-only CPU): bf16 is accepted with one warning naming the way out."""
    from colorl.kernels import onednn_available

    if not onednn_available():
        pytest.skip("no oneDNN here: torch's own kernels serve bf16 and nothing is said")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "COLORL_ONEDNN": "1"}
    cmd = [sys.executable, "-m", "colorl", "train", "configs/tiny.yaml", "--run-dir", str(tmp_path / "run"),
           "--set", "train.mixed_precision=bfloat16", "--dry-run"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if "bfloat16" in line]
    assert len(warnings) == 1 and "no bf16 matrix products" in warnings[0] and "float32" in warnings[0]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)  # this process's own environment
    from colorl.kernels import onednn_dtypes
    import torch

    assert ("no bf16 matrix products" in out.stderr) == (torch.bfloat16 not in onednn_dtypes())


def test_dry_run_says_what_precision_auto_becomes_here(tmp_path):
    """On a CPU without bf16 products (oneDNN held to AVX2, so on every x86 CPU) auto keeps float32 without racing
    and says why; forced, it says so."""
    from colorl.kernels import onednn_available

    if not onednn_available():
        pytest.skip("no oneDNN here: auto keeps float32 for another reason (tested in tests/test_precision.py)")
    cmd = [sys.executable, "-m", "colorl", "train", "configs/tiny.yaml", "--run-dir", str(tmp_path / "run"), "--dry-run"]
    base = {k: v for k, v in os.environ.items() if k != "COLORL_BF16"}
    for env, line in (({"ONEDNN_MAX_CPU_ISA": "AVX2", "COLORL_ONEDNN": "1"},
                       "# precision: compute float32, serving float32 (auto: this CPU has no bf16 matrix products: "),
                      ({"COLORL_BF16": "1"}, "# precision: compute bfloat16, serving bfloat16 (auto: forced by COLORL_BF16=1)")):
        out = subprocess.run(cmd, env={**base, **env}, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert [l for l in out.stdout.splitlines() if l.startswith("# precision")][0].startswith(line), out.stdout


@pytest.mark.parametrize("sets, keys", [(["rollout.top_p=0.9"], "rollout.top_p=0.9"),
                                        (["rollout.top_k=50", "rollout.top_p=0.95"], "rollout.top_p=0.95, rollout.top_k=50"),
                                        ([], None)])
def test_truncated_sampling_is_said_in_one_line(tmp_path, capsys, sets, keys):
    """top-p / top-k put the IS weights below 1 by design (docs/grpo.md): said before the run, not left to puzzle over."""
    argv = ["train", "configs/tiny.yaml", "--run-dir", str(tmp_path / "run"), "--dry-run"]
    for item in sets:
        argv += ["--set", item]
    assert main(argv) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "is_weight_mean" in line]
    assert notes == ([] if keys is None else [f"colorl: warning: {keys}: truncated sampling, so is_weight_mean is the "
                                              "kept probability mass (below 1), not a sign of engine mismatch (docs/grpo.md)"])
