"""Issue 19 defect 1: before every wake the process gives its cached device memory back (an engine in
another process, SGLang's scheduler, can only map what the trainer's caching allocator returned).

Run for real (colocated, world 1, eval on, sleep level 2) with recorders around what allocates on the
device (a training step, a weight sync) and around the hand-off: each wake must come after a hand-off
that follows the last allocation, and each sync after a hand-off that follows training. The
stand-in of SGLang (tests/engines/sglang_standin.py) enforces the same through its simulated device."""
from __future__ import annotations

import json
from pathlib import Path

from colorl.config import load_config
from colorl.distributed import run_world

HELPERS = str(Path(__file__).parents[1] / "helpers")


def _recorded_run(rank, world, cfg_dict, run_dir, out_file):
    from colorl import distributed
    from colorl.modes.colocated import run_colocated
    from colorl.worker import StopRequest
    from rank_context import fresh_rank_context

    ctx = fresh_rank_context(rank, world, cfg_dict, run_dir)
    events: list[str] = []

    def recorded(name, call):
        def wrapper(*args, **kwargs):
            events.append(name)
            return call(*args, **kwargs)
        return wrapper

    release = distributed.release_cached_device_memory
    distributed.release_cached_device_memory = recorded("hand-off", release)
    ctx.trainer.train_step = recorded("train", ctx.trainer.train_step)
    ctx.weight_sync.sync = recorded("sync", ctx.weight_sync.sync)
    ctx.engine.wake = recorded("wake", ctx.engine.wake)
    try:
        run_colocated(ctx, StopRequest())
    finally:
        distributed.release_cached_device_memory = release
    Path(out_file).write_text(json.dumps(events))


def test_every_wake_follows_a_memory_hand_off(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(HELPERS)
    cfg = load_config("configs/tiny.yaml", ["task.reward=reward_fns:digit_fraction", "run.steps=2",
                                            "rollout.batch_groups=2", "rollout.max_new_tokens=6",
                                            "run.eval_every=1", "run.eval_prompts=2", "engine.sleep_level=2"])
    out = tmp_path / "events.json"
    run_world(_recorded_run, 1, cfg.model_dump(mode="json"), str(tmp_path / "run"), str(out))
    events = json.loads(out.read_text())
    wakes = [i for i, e in enumerate(events) if e == "wake"]
    assert len(wakes) == 1 + 2 + 2  # the first eval, then a rollout and an eval per step
    for i in wakes:
        allocations = [j for j in range(i) if events[j] in ("train", "sync")]
        last_allocation = allocations[-1] if allocations else -1
        assert "hand-off" in events[last_allocation + 1:i], events
    # at sleep level 2 a sync maps the engine's weights back first: training's cache is returned before it
    syncs_after_training = [i for i, e in enumerate(events) if e == "sync" and "train" in events[:i]]
    assert len(syncs_after_training) == 2
    for i in syncs_after_training:
        last_train = max(j for j in range(i) if events[j] == "train")
        assert "hand-off" in events[last_train + 1:i], events
