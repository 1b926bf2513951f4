"""Bounded-lag's two loops share a rank's cores: each its share while both work, all of them while
the other idles. Checked on the real trainer model (FSDP2, gloo) and in a real run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from colorl.config import load_config
from colorl.distributed import run_world
from colorl.modes.cores import CoreShare, follow_in_training
from colorl.threads import set_threads

HELPERS = str(Path(__file__).parents[1] / "helpers")
ROOT = Path(__file__).parents[2]


def test_each_loop_takes_the_whole_budget_only_while_the_other_idles():
    share = CoreShare(budget=4, rollout=1, train=3)
    assert (share.rollout_threads(), share.train_threads()) == (1, 3)
    share.trainer_idle = True
    assert (share.rollout_threads(), share.train_threads()) == (4, 3)
    share.trainer_idle, share.rollout_idle = False, True
    assert (share.rollout_threads(), share.train_threads()) == (1, 4)


def _probe_layers(model, seen: list) -> None:
    """Record the thread count each decoder layer runs its forward and its backward with."""
    from colorl.train.fsdp import decoder_layers

    for layer in decoder_layers(model):
        def after_forward(_m, _i, output):
            seen.append(("forward", torch.get_num_threads()))
            hidden = output[0] if isinstance(output, tuple) else output
            hidden.register_hook(lambda _g: seen.append(("backward", torch.get_num_threads())))
        layer.register_forward_hook(after_forward)


def _skip_set_num_threads(count: int) -> None:
    """What vLLM's CPU worker puts in place of `torch.set_num_threads` once it starts (it only warns)."""


def _flip_between_forward_and_backward(rank, world, cfg_dict, run_dir, out_file, vllm_started):
    from rank_context import fresh_rank_context

    ctx = fresh_rank_context(rank, world, cfg_dict, run_dir)
    if vllm_started:
        torch.set_num_threads = _skip_set_num_threads
    model = ctx.trainer.model  # FSDP2-wrapped, as bounded-lag trains it
    share = CoreShare(budget=2, rollout=1, train=1)
    follow_in_training(model, share)
    seen: list = []
    _probe_layers(model, seen)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    packed = {"position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]]), "cu_seq_lens_q": torch.tensor([0, 3, 6]),
              "cu_seq_lens_k": torch.tensor([0, 3, 6]), "max_length_q": 3, "max_length_k": 3}  # two sequences
    for idle_in_forward in (False, True):
        set_threads(1)
        share.rollout_idle = idle_in_forward
        loss = model(input_ids=ids, **packed).logits.float().mean()
        share.rollout_idle = not idle_in_forward  # the engine starts or stops between the passes
        loss.backward()
    Path(out_file).write_text(json.dumps(seen))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("vllm_started", [False, True], ids=["torch", "after-vllm-replaced-set_num_threads"])
def test_trainer_threads_follow_the_engine_at_every_layer_forward_and_backward(tmp_path, monkeypatch, vllm_started):
    monkeypatch.syspath_prepend(HELPERS)
    cfg = load_config(ROOT / "configs" / "tiny.yaml", []).model_dump(mode="json")
    out = tmp_path / "seen.json"
    run_world(_flip_between_forward_and_backward, 1, cfg, str(tmp_path / "run"), str(out), vllm_started)
    seen = [tuple(x) for x in json.loads(out.read_text())]
    layers = len(seen) // 4
    assert layers >= 2
    # pass 1: engine busy in forward (the train share), idle in backward (the whole budget); pass 2: reversed
    assert seen[:2 * layers] == [("forward", 1)] * layers + [("backward", 2)] * layers
    assert seen[2 * layers:] == [("forward", 2)] * layers + [("backward", 1)] * layers


def _eta_zero_run(rank, world, cfg_dict, run_dir, out_file):
    """η = 0: the engine idles while the trainer trains and the trainer waits while the engine
    decodes, so each loop should get both cores most of the time."""
    from colorl.modes.bounded_lag import run_bounded_lag
    from colorl.worker import StopRequest
    from rank_context import fresh_rank_context

    ctx = fresh_rank_context(rank, world, cfg_dict, run_dir)
    ctx.rank_threads = 2  # the budget, whatever this machine's core count
    rollout_seen, train_seen = [], []
    step = ctx.engine.step

    def probed_step():
        rollout_seen.append(torch.get_num_threads())
        return step()

    ctx.engine.step = probed_step
    _probe_layers(ctx.trainer.model, train_seen)
    run_bounded_lag(ctx, StopRequest())
    Path(out_file).write_text(json.dumps({"rollout": rollout_seen, "train": [n for _, n in train_seen]}))


@pytest.mark.timeout(180)
def test_with_eta_zero_each_loop_runs_on_the_whole_budget(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(HELPERS)
    sets = ["mode=bounded_lag", "staleness.max=0", "run.steps=2", "rollout.batch_groups=2", "rollout.max_new_tokens=12",
            "task.reward=reward_fns:digit_fraction", "launch.rollout_threads=1", "launch.train_threads=1"]
    cfg = load_config(ROOT / "configs" / "tiny.yaml", sets).model_dump(mode="json")
    out = tmp_path / "seen.json"
    run_world(_eta_zero_run, 1, cfg, str(tmp_path / "run"), str(out))
    seen = json.loads(out.read_text())
    # a few steps on either side may run before the other loop's flag flips; most run on both cores
    assert seen["rollout"].count(2) > len(seen["rollout"]) / 2, seen["rollout"]
    assert seen["train"].count(2) > len(seen["train"]) / 2, seen["train"]
