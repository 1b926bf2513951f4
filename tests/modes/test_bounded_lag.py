"""Real runs of bounded-lag mode on a tiny random model (gloo, world size 1 and 2).

Every run checks the promises of the mode: no group trained staler than η, engine weights equal
to the published trainer weights after every apply, no prompt trained twice, no hang (timeouts).
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from colorl.cli import main
from colorl.config import load_config
from colorl.distributed import run_world

pytestmark = pytest.mark.matrix  # whole bounded-lag runs: make test-matrix

HELPERS = str(Path(__file__).parents[1] / "helpers")
BASE = ["task.reward=reward_fns:digit_fraction", "rollout.batch_groups=4", "rollout.max_new_tokens=12",
        "mode=bounded_lag"]


def _sets(extra) -> list[str]:
    return [*BASE, *extra]


def _bounded_in_process(rank, world, cfg_dict, run_dir, out_file):
    """Run the mode in real ranks; check the engine against each published version as it is applied."""
    from colorl.modes.bounded_lag import run_bounded_lag
    from colorl.worker import StopRequest
    from rank_context import fresh_rank_context

    ctx = fresh_rank_context(rank, world, cfg_dict, run_dir)
    sync, params = ctx.weight_sync, dict(ctx.trainer.model.named_parameters())
    published: dict[int, dict[str, torch.Tensor]] = {}
    applied, mismatched = [], []
    publish, apply_pending = sync.publish, sync.apply_pending

    def checked_publish(version):  # the trainer's weights are version `version` when it publishes
        published[version] = {n: p.full_tensor().clone() for n, p in params.items()}
        return publish(version)

    def checked_apply(engine):
        stats = apply_pending(engine)
        if stats is not None:
            expected = published[engine.version]
            weights = engine.named_weights()
            applied.append(engine.version)
            mismatched.extend(f"v{engine.version}:{n}" for n in expected if not torch.equal(weights[n], expected[n]))
        return stats

    sync.publish, sync.apply_pending = checked_publish, checked_apply
    run_bounded_lag(ctx, StopRequest())
    Path(f"{out_file}.{rank}").write_text(json.dumps({
        "applied": applied, "mismatched": mismatched, "state_version": ctx.state.version}))


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_no_prompt_twice(lines: list[dict]) -> None:
    trained = [i for r in lines for i in r["trained_problems"]]
    assert len(trained) == len(set(trained))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world, extra", [
    (1, ["staleness.max=1"]),
    (2, ["staleness.max=2", "staleness.partial_rollout=recompute"]),
    (1, ["staleness.buffer=queue_max", "staleness.max=1", "rollout.concurrency=32"]),
    (2, ["staleness.buffer=queue_drop", "staleness.queue_factor=2"]),
    (1, ["rollout.engine=hf", "staleness.partial_rollout=recompute", "staleness.max=1"]),
], ids=["world1-staleflow-keep-eta1", "world2-staleflow-recompute-eta2", "world1-queue_max-eta1",
        "world2-queue_drop-q2", "world1-hf-recompute"])
def test_bounded_lag_trains_within_eta_and_engines_hold_each_published_version(tmp_path, monkeypatch, world, extra):
    monkeypatch.syspath_prepend(HELPERS)
    steps = 5
    cfg = load_config("configs/tiny.yaml", _sets([f"launch.nproc={world}", f"run.steps={steps}", *extra]))
    run_dir, out = tmp_path / "run", tmp_path / "out"
    run_world(_bounded_in_process, world, cfg.model_dump(mode="json"), str(run_dir), str(out))
    for rank in range(world):
        report = json.loads(Path(f"{out}.{rank}").read_text())
        assert report["mismatched"] == []  # engine == trainer weights of that version, bit for bit
        assert report["applied"] and report["applied"] == sorted(report["applied"])
        assert report["state_version"] == steps
    lines = _metrics(run_dir)
    assert [r["step"] for r in lines] == list(range(1, steps + 1))
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in lines)
    eta = cfg.staleness.max
    if cfg.staleness.buffer != "queue_drop":
        assert all(r["staleness_max"] <= eta for r in lines), [r["staleness_max"] for r in lines]
    assert max(r["staleness_max"] for r in lines) >= 1  # the trainer really ran ahead of the rollouts
    for r in lines:
        assert sum(r["staleness_hist"].values()) == cfg.rollout.batch_groups
        assert r["staleness_mean"] == pytest.approx(r["pqs_measured"] + r["iqs_measured"])
        assert 0 <= r["engine_idle_frac"] <= 1 and r["trainer_wait_s"] >= 0
        assert r["trained_tokens"] > 0
    assert sum(r["generated_tokens"] for r in lines) >= sum(r["trained_tokens"] for r in lines)
    _assert_no_prompt_twice(lines)


def _cli(argv) -> int:
    return main(["train", "configs/tiny.yaml", *argv])


def _argv(sets) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in (run_dir / "checkpoints" / f"step_{step}" / "model").glob("*.safetensors"):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
def test_eta_zero_trains_exactly_what_colocated_trains(tmp_path, monkeypatch, world):
    """Same prompts, same samples, same losses, same final weights: bit for bit when each loop uses the
    thread count colocated mode uses (a different count changes float reduction order only)."""
    monkeypatch.syspath_prepend(HELPERS)
    common = [f"--nproc={world}", *_argv([*BASE[:3], "run.steps=3"])]
    colocated, bounded = tmp_path / "colocated", tmp_path / "bounded"
    assert _cli(common + ["--run-dir", str(colocated)]) == 0
    from colorl.launch import rank_threads

    threads = rank_threads(world)  # what the launcher gives each rank
    same_threads = [f"launch.rollout_threads={threads}", f"launch.train_threads={threads}"]
    assert _cli(common + _argv(["mode=bounded_lag", "staleness.max=0", *same_threads])
                + ["--run-dir", str(bounded)]) == 0
    keys = ("step", "loss", "reward_mean", "response_len_mean", "grad_norm", "trained_problems",
            "staleness_max", "is_weight_mean")
    a, b = _metrics(colocated), _metrics(bounded)
    assert [{k: r[k] for k in keys} for r in a] == [{k: r[k] for k in keys} for r in b]
    wa, wb = _weights(colocated, 3), _weights(bounded, 3)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.timeout(300)
def test_resume_neither_loses_nor_repeats_a_prompt_and_keeps_the_bound(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(HELPERS)
    sets = _sets(["launch.nproc=2", "staleness.max=1", "run.save_every=3"])
    run = tmp_path / "run"
    assert _cli(_argv([*sets, "run.steps=3"]) + ["--run-dir", str(run)]) == 0
    saved = [json.loads((run / "checkpoints" / "step_3" / f"rollout_rank{r}.json").read_text()) for r in (0, 1)]
    assert _cli(_argv([*sets, "run.steps=6"]) + ["--run-dir", str(run), "--resume"]) == 0
    lines = _metrics(run)
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]
    assert all(r["staleness_max"] <= 1 for r in lines)
    _assert_no_prompt_twice(lines)
    trained = {i for r in lines for i in r["trained_problems"]}
    final = [json.loads((run / "checkpoints" / "step_6" / f"rollout_rank{r}.json").read_text()) for r in (0, 1)]
    # every prompt handed out before the save is trained, or still held (buffer / in flight) at the end
    held_tickets = [{*s["reissue"], *(c["group"]["ticket"] for c in s["completed"])} for s in final]
    per_rank = 4 // 2
    for rank, state in enumerate(saved):
        for ticket in range(state["next_ticket"]):
            step, j = divmod(ticket, per_rank)
            problem = step * 4 + rank * per_rank + j
            assert problem in trained or ticket in held_tickets[rank], (rank, ticket)


@pytest.mark.timeout(240)
def test_filtered_and_redundant_groups_are_counted_and_the_length_shift_reported(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(HELPERS)
    sets = _sets(["run.steps=4", "filter.zero_variance=true", "staleness.redundancy={level: group, ratio: 0.5}",
                  "task.reward=reward_fns:long_is_right"])
    assert _cli(_argv(sets) + ["--run-dir", str(tmp_path / "r")]) == 0
    lines = _metrics(tmp_path / "r")
    assert sum(r["samples_aborted"] for r in lines) > 0  # 6 samples per group, the 2 slowest aborted
    assert sum(r["groups_filtered"] for r in lines) > 0
    assert all(r["staleness_max"] <= 1 for r in lines)
    for r in lines:
        assert r["sampled_len_mean"] > 0 and r["trained_len_mean"] > 0


@pytest.mark.timeout(240)
def test_batch_redundancy_aborts_the_slowest_groups(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(HELPERS)
    sets = _sets(["run.steps=4", "staleness.redundancy={level: batch, ratio: 0.5}", "staleness.max=0",
                  "rollout.concurrency=32", "rollout.length_override={mean: 8, tailness: 90, cap: 32}"])
    assert _cli(_argv(sets) + ["--run-dir", str(tmp_path / "r")]) == 0
    lines = _metrics(tmp_path / "r")
    assert sum(r["groups_aborted"] for r in lines) > 0
    assert all(r["staleness_max"] == 0 for r in lines)
    _assert_no_prompt_twice(lines)


@pytest.mark.parametrize("sets, message", [
    (["rollout.engine=hf"], "rollout.engine=hf cannot keep in-flight sequences"),
    (["staleness.buffer=queue_drop", "staleness.redundancy={level: batch, ratio: 0.5}"],
     "staleness.redundancy.level=batch needs staleness.buffer=staleflow"),
])
def test_settings_an_engine_or_buffer_cannot_honour_are_refused(capsys, sets, message):
    assert _cli(_argv(_sets(sets)) + ["--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


@pytest.mark.timeout(180)
def test_ctrl_c_stops_both_loops_saves_and_exits_cleanly(tmp_path):
    run = tmp_path / "run"
    from colorl_process import start_colorl

    proc = start_colorl(["train", "configs/tiny.yaml", "--run-dir", str(run),
                         *_argv(_sets(["run.steps=500", "run.save_every=0"]))], HELPERS)
    deadline = time.monotonic() + 120
    while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err  # a clean save after Ctrl-C: the shell's "interrupted" code
    (saved,) = list((run / "checkpoints").iterdir())
    assert (saved / "rollout_rank0.json").is_file()
    assert "--resume" in err


def _rank_with_failing_rollout_thread(rank, world, cfg_dict, run_dir, resume, device):
    """A rank whose rollout thread raises on its 5th engine step (rank 1 only)."""
    from colorl.rollout.producer import RolloutProducer
    from colorl.worker import run_rank

    if rank == 1:
        step = RolloutProducer._step
        calls = []

        def failing_step(self):
            calls.append(1)
            if len(calls) == 5:
                Path(run_dir, "failed_at").write_text(str(time.time()))
                raise RuntimeError("injected failure in the rollout thread")
            step(self)

        RolloutProducer._step = failing_step
    run_rank(rank, world, cfg_dict, run_dir, resume, device)


@pytest.mark.timeout(180)
def test_an_exception_in_the_rollout_thread_stops_every_rank_with_its_traceback(tmp_path, monkeypatch):
    from colorl.cli import _readable
    from colorl.launch import launch
    from colorl.worker import prepare_run_dir

    monkeypatch.syspath_prepend(HELPERS)
    monkeypatch.setenv("PYTHONPATH", HELPERS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cfg = load_config("configs/tiny.yaml", _sets(["launch.nproc=2", "run.steps=50"]))
    prepare_run_dir(cfg, tmp_path / "run", resume=False)
    started = time.monotonic()
    failure = launch(_rank_with_failing_rollout_thread, 2, "cpu",
                     (cfg.model_dump(mode="json"), str(tmp_path / "run"), False, "cpu"))
    assert failure is not None and failure.rank == 1
    assert time.time() - float((tmp_path / "run" / "failed_at").read_text()) < 30  # every rank stopped
    assert time.monotonic() - started < 90
    shown = _readable(failure.error)
    assert shown.startswith("RolloutThreadError: the rollout thread failed: "
                            "RuntimeError: injected failure in the rollout thread")
    assert "failing_step" in shown  # the rollout thread's own frames
    assert "take_batch" not in shown  # not the trainer's, which only noticed
