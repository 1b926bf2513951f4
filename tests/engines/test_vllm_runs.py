"""Whole `colorl train` runs with rollout.engine=vllm on the real vLLM CPU build (make test-vllm): both
modes, LoRA, eval, resume, with the checkpoint engine's bit-exact check after every sync (colorl
doctor's rank function), on the tiny model with head_dim 32 (vLLM's CPU attention refuses 16)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not importable here (it runs in its own venv: make test-vllm)")

from colorl.cli import main  # noqa: E402
from colorl.doctor import checked_rank  # noqa: E402
from colorl.models import TINY_HD32_ALIAS, resolve_model_path  # noqa: E402
from checked_runs import checked_run as run_checked, metrics, weights  # noqa: E402  (tests/helpers)

BASE = ["rollout.engine=vllm", "model.path=tiny-random-llama-hd32", "task.reward=reward_fns:long_is_right",
        "rollout.max_new_tokens=8", "run.eval_every=1", "run.eval_prompts=4", "train.lr=1e-2", "launch.device=cpu"]
LORA = "model.lora={r: 4, alpha: 8}"
RESUMABLE = ["run.steps=3", "run.save_every=2", "run.optimizer_state=all"]
HELPERS = str(Path(__file__).parents[1] / "helpers")
ROOT = Path(__file__).parents[2]


@pytest.fixture(autouse=True)
def _helpers(monkeypatch):
    monkeypatch.syspath_prepend(HELPERS)  # reward_fns


def checked_run(sets: list[str], run_dir: Path, resume: bool = False) -> list[dict]:
    return run_checked(checked_rank, [*BASE, *sets], run_dir, resume, "vllm")


@pytest.mark.timeout(480)
def test_colocated_lora_sleep2_eval_bit_exact_and_resume(tmp_path):
    """Resumed twice, each time from a fresh process: a resume that differed from the uninterrupted run in
    one run of two (MKL's alignment-dependent paths, a rank reseeded by building an alias) fails here."""
    sets = [*RESUMABLE, LORA, "engine.sleep_level=2", "mode=colocated"]
    (report,) = checked_run(sets, tmp_path / "straight")
    assert report["checked_versions"] == [0, 1, 2, 3]  # start-up, then after each step: bit-exact
    lines = metrics(tmp_path / "straight")
    assert [r["step"] for r in lines] == [1, 2, 3] and all(r["eval_accuracy"] is not None for r in lines)
    assert all(r["staleness_max"] == 0 for r in lines)
    # resume from step 2 through the CLI: step 3 trains exactly as the uninterrupted run did, every time
    cli = [a for s in [*BASE, *sets] for a in ("--set", s)]
    keys = ("step", "version", "loss", "reward_mean", "response_len_mean")
    for attempt in (1, 2):
        resumed = tmp_path / f"resumed-{attempt}"
        assert main(["train", "configs/tiny.yaml", *cli, "--set", "run.steps=2", "--run-dir", str(resumed)]) == 0
        assert main(["train", "configs/tiny.yaml", *cli, "--run-dir", str(resumed), "--resume"]) == 0
        assert [{k: r[k] for k in keys} for r in metrics(resumed)] == [{k: r[k] for k in keys} for r in lines]
        a, b = weights(tmp_path / "straight", 3), weights(resumed, 3)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), attempt


@pytest.mark.timeout(300)
@pytest.mark.parametrize("partial", ["keep", "recompute"])
def test_bounded_lag_partial_rollout_bit_exact(tmp_path, partial):
    lora = [LORA] if partial == "keep" else []
    (report,) = checked_run(["run.steps=3", *lora, "mode=bounded_lag", "staleness.max=1",
                             f"staleness.partial_rollout={partial}"], tmp_path / "run")
    checked = report["checked_versions"]
    assert checked[0] == 0 and checked == sorted(set(checked)) and len(checked) >= 2  # published versions applied
    lines = metrics(tmp_path / "run")
    assert [r["step"] for r in lines] == [1, 2, 3] and all(r["staleness_max"] <= 1 for r in lines)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in lines)


@pytest.mark.timeout(300)
def test_colocated_world_size_2(tmp_path):
    cli = [a for s in [*BASE, "run.steps=2"] for a in ("--set", s)]
    assert main(["train", "configs/tiny.yaml", *cli, "--nproc=2", "--run-dir", str(tmp_path / "w2")]) == 0
    lines = metrics(tmp_path / "w2")
    assert [r["step"] for r in lines] == [1, 2] and all(r["version"] == r["step"] for r in lines)


@pytest.mark.timeout(600)
def test_doctor_runs_its_vllm_cases_on_the_model_vllm_accepts_on_a_quiet_screen(tmp_path, capfd):
    """`colorl doctor` on CPU adds the vllm cases where vLLM is installed, on the tiny model with head_dim 32;
    the screen (the ranks' file descriptors included) holds only the doctor's own lines."""
    cases = ["vllm/colocated/sleep2/lora", "vllm/bounded_lag/full"]
    resolve_model_path(TINY_HD32_ALIAS)  # built before: the doctor does not print its preparation
    capfd.readouterr()
    code = main(["doctor", "--device", "cpu", "--nproc", "1", "--out", str(tmp_path / "d"),
                 *[a for c in cases for a in ("--case", c)]])
    out, err = capfd.readouterr()
    assert code == 0, out + err
    assert all(f"PASS  {case} " in out for case in cases), out
    # the doctor's verdicts and, indented under each, its memory per phase
    assert all(line.startswith(("colorl doctor:", "PASS  ", "    after ")) for line in (out + err).splitlines()), out + err


@pytest.mark.timeout(600)
def test_doctor_reads_back_what_vllm_computes_with_not_its_sync_copy(tmp_path, capsys, monkeypatch):
    """After the sync to version 2 one value of vLLM's own model (in its worker) is one ulp off while
    the copy the sync wrote is intact: the doctor's case fails naming the weight. Untouched, the same
    case passes (the test above)."""
    from doctor_faults import rank_with_corrupt_engine  # tests/helpers

    from colorl import doctor

    monkeypatch.setattr(doctor, "checked_rank", rank_with_corrupt_engine)
    code = main(["doctor", "--device", "cpu", "--nproc", "1", "--out", str(tmp_path / "d"),
                 "--case", "vllm/colocated/sleep1/full"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert re.search(r"FAIL  vllm/colocated/sleep1/full .*weight sync to version 2: 1 of \d+ engine weights differ "
                     r"from the trainer's \(first: model\.norm\.weight\)", out), out


def test_vllms_cpu_kernels_are_read_back_bit_for_bit(tmp_path):
    """vLLM's CPU build empties every linear weight into its kernel's packed layout: read back through
    the kernel, what it computes with equals the checkpoint bit for bit, the tied LM head included; a
    kernel left stale by a reload (the LM head's, had the embedding not been repacked) is caught."""
    from colorl.config import EngineConfig
    from colorl.engines import build_engine
    from colorl.engines import vllm as adapter
    from colorl.sync.verify import compare

    engine = build_engine("vllm", resolve_model_path(TINY_HD32_ALIAS), EngineConfig(max_num_seqs=4, num_blocks=64))
    tied = {"lm_head.weight": "model.embed_tokens.weight"}
    try:
        (emptied,) = engine._llm.apply_model(lambda model: sorted(
            name for name, p in model.named_parameters() if p.numel() == 0))
        assert "model.layers.0.self_attn.qkv_proj.weight" in emptied  # what a read of the parameters would miss
        served = engine.read_weights()
        assert compare(served, engine.named_weights(), tied).differing == [] and "lm_head.weight" in served
        with torch.no_grad():
            for tensor in engine.named_weights().values():
                tensor.mul_(1.5)
        skipped = []
        original = adapter._repack_vocab_layers
        adapter._repack_vocab_layers = lambda model: skipped.append(1)
        try:
            engine.version = 1
        finally:
            adapter._repack_vocab_layers = original
        assert skipped and compare(engine.read_weights(), engine.named_weights(), tied).differing == ["lm_head.weight"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "train"])
def test_a_model_vllm_refuses_on_cpu_is_refused_before_launch_in_one_line(tmp_path, capsys, dry_run):
    args = ["train", "configs/tiny.yaml", "--set", "rollout.engine=vllm", "--set", "launch.device=cpu",
            "--run-dir", str(tmp_path / "run"), *(["--dry-run"] if dry_run else [])]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "head_dim 16" in err[0] and "model.path=tiny-random-llama-hd32" in err[0], err
    assert not (tmp_path / "run").exists()  # nothing launched


def _screen(engine: str, run_dir: Path) -> list[str]:
    """Every line `colorl train` puts on the terminal (stdout, then stderr; the ranks write to both)."""
    sets = [f"rollout.engine={engine}", f"model.path={TINY_HD32_ALIAS}", "run.steps=2", "launch.device=cpu"]
    done = subprocess.run([sys.executable, "-m", "colorl", "train", "configs/tiny.yaml",
                           *[a for s in sets for a in ("--set", s)], "--run-dir", str(run_dir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return (done.stdout + done.stderr).splitlines()


@pytest.mark.timeout(900)
def test_the_screen_of_a_vllm_run_has_the_native_runs_lines_and_vllms_output_is_in_engine_log(tmp_path):
    """vLLM's log, its start-up's C++ warnings and progress bar, and its libraries' output at exit go to
    RUN_DIR/engine.log: the screen holds exactly the lines of the same run with the native engine."""
    resolve_model_path(TINY_HD32_ALIAS)  # built once before: neither run prints its preparation
    native, vllm = _screen("native", tmp_path / "native"), _screen("vllm", tmp_path / "vllm")
    shape = [line.split(" ")[0][:4] for line in native]
    assert [line.split(" ")[0][:4] for line in vllm] == shape, "\n".join(vllm)
    log = (tmp_path / "vllm" / "engine.log").read_text(encoding="utf-8")
    assert "Reloading weights inplace" in log and "rank 0 " in log  # vLLM's INFO records, through colorl's handler
