"""`colorl export` gives a folder that from_pretrained loads and that generates the same greedy text."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from colorl.cli import main
from colorl.models import build_tokenizer, encode_chat
from colorl.train.checkpoint import checkpoint_dir, load_model_weights

HELPERS = str(Path(__file__).parent / "helpers")


def _greedy(model, ids: list[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    return out[0, len(ids):].tolist()


def test_export_loads_and_generates_like_the_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(HELPERS)
    run = tmp_path / "run"
    sets = ["rollout.engine=hf", "task.reward=reward_fns:digit_fraction", "run.steps=2", "rollout.batch_groups=2",
            "rollout.max_new_tokens=8", "train.lr=1e-2"]
    assert main(["train", "configs/tiny.yaml", "--run-dir", str(run), *[x for s in sets for x in ("--set", s)]]) == 0
    out = tmp_path / "exported"
    previous = os.umask(0o022)  # inherited by the export process
    try:
        done = subprocess.run([sys.executable, "-m", "colorl", "export", str(run), str(out)], capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    finally:
        os.umask(previous)
    assert done.returncode == 0 and done.stdout == f"exported: {out}\n"
    assert done.stderr == ""  # no library warnings a user cannot act on
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [out, *out.iterdir()]}
    assert modes == {name: 0o755 if name == out.name else 0o644 for name in modes}, modes
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert (out / "model.safetensors").exists() or list(out.glob("*.safetensors"))

    from colorl.models import load_model, resolve_model_path

    reference = load_model(resolve_model_path("tiny-random-llama"))
    load_model_weights(checkpoint_dir(run, 2), reference)
    prompt = encode_chat(build_tokenizer(), "What is 2 + 2?")
    assert _greedy(exported, prompt) == _greedy(reference, prompt)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(tensor, exported.state_dict()[name]), name

    assert main(["export", str(run), str(out)]) == 2  # never overwrites
    assert "not empty" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "o2")]) == 2
    assert main(["export", str(run), str(tmp_path / "o3"), "--step", "7"]) == 2


def test_export_of_a_lora_run_merges_the_adapters(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(HELPERS)
    run = tmp_path / "run"
    sets = ["task.reward=reward_fns:digit_fraction", "run.steps=2", "rollout.batch_groups=2",
            "rollout.max_new_tokens=8", "train.lr=1e-2", "model.lora={r: 4, alpha: 8, targets: [q_proj, v_proj]}"]
    assert main(["train", "configs/tiny.yaml", "--run-dir", str(run), *[x for s in sets for x in ("--set", s)]]) == 0
    assert main(["export", str(run), str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()

    from colorl.models import load_model, resolve_model_path

    base = load_model(resolve_model_path("tiny-random-llama")).state_dict()
    assert exported.keys() == base.keys()  # a plain HF model, no peft names
    changed = {name for name in base if not torch.equal(base[name], exported[name])}
    assert changed and all("q_proj" in n or "v_proj" in n for n in changed)
