"""Bounded-lag's two loops share a rank's cores: each its share while both work, all of them while
the other idles. Checked on the real trainer model (FSDP2, gloo) and in a real run."""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from dataclasses import dataclass
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


@dataclass
class _DecisionsShare(CoreShare):
    """A CoreShare that remembers what each loop last decided from: the flag it read and the count it gave."""
    rollout_decision: tuple = (None, None)
    train_decision: tuple = (None, None)

    def rollout_threads(self) -> int:
        idle = self.trainer_idle
        self.rollout_decision = (idle, self.budget if idle else self.rollout)
        return self.rollout_decision[1]

    def train_threads(self) -> int:
        idle = self.rollout_idle
        self.train_decision = (idle, self.budget if idle else self.train)
        return self.train_decision[1]


def _wait_until(flag, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not flag() and time.monotonic() < deadline:
        time.sleep(0.005)


def _eta_zero_run(rank, world, cfg_dict, run_dir, out_file):
    """η = 0: the engine has nothing to decode while the trainer trains, and the trainer waits while the
    engine decodes the batch it needs. Every engine step and every decoder layer is recorded with the
    thread count it ran on and the other loop's idle flag its loop decided from. How often each loop
    finds the other idle depends on the machine's speed (the tiny model decodes a batch faster than the
    trainer logs a step on a fast CPU), so each probe waits once for the other loop to go idle, which
    at η = 0 it must: the claim is then checked on both flags, on any machine."""
    from colorl.modes.bounded_lag import run_bounded_lag
    from colorl.worker import StopRequest
    from rank_context import fresh_rank_context

    ctx = fresh_rank_context(rank, world, cfg_dict, run_dir)
    ctx.rank_threads = 2  # the budget, whatever this machine's core count
    make_share = ctx.core_share
    shares: list[_DecisionsShare] = []

    def decisions_share():
        shares.append(_DecisionsShare(**dataclasses.asdict(make_share())))
        return shares[-1]

    ctx.core_share = decisions_share
    rollout_seen, train_seen = [], []
    step = ctx.engine.step

    def probed_step():
        if threading.current_thread().name == "colorl-rollout":
            share = shares[-1]
            rollout_seen.append([torch.get_num_threads(), *share.rollout_decision])
            if len(rollout_seen) == 1:
                _wait_until(lambda: share.trainer_idle)  # the trainer can only wait for this batch
        return step()

    def record_training():
        share = shares[-1]
        train_seen.append([torch.get_num_threads(), *share.train_decision])
        if len(train_seen) == 1:
            _wait_until(lambda: share.rollout_idle)  # η = 0: no batch to admit before this step's publish

    def probed_layer(_module, _inputs, output):
        record_training()
        hidden = output[0] if isinstance(output, tuple) else output
        hidden.register_hook(lambda _grad: record_training())  # fires before the layer's backward

    ctx.engine.step = probed_step
    from colorl.train.fsdp import decoder_layers
    for layer in decoder_layers(ctx.trainer.model):
        layer.register_forward_hook(probed_layer)
    run_bounded_lag(ctx, StopRequest())
    Path(out_file).write_text(json.dumps({"rollout": rollout_seen, "train": train_seen}))


@pytest.mark.timeout(180)
def test_with_eta_zero_each_loop_runs_on_the_whole_budget(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(HELPERS)
    sets = ["mode=bounded_lag", "staleness.max=0", "run.steps=2", "rollout.batch_groups=2", "rollout.max_new_tokens=12",
            "task.reward=reward_fns:digit_fraction", "launch.rollout_threads=1", "launch.train_threads=1"]
    cfg = load_config(ROOT / "configs" / "tiny.yaml", sets).model_dump(mode="json")
    out = tmp_path / "seen.json"
    run_world(_eta_zero_run, 1, cfg, str(tmp_path / "run"), str(out))
    seen = json.loads(out.read_text())
    for loop in ("rollout", "train"):
        # each engine step / layer ran on the count its loop decided: 2 (the budget) with the other loop
        # idle, 1 (its share) with it busy; and the whole budget was taken once the other loop went idle
        assert all(threads == given == (2 if idle else 1) for threads, idle, given in seen[loop]), seen[loop]
        assert any(idle for _, idle, _ in seen[loop]), seen[loop]
