"""How the bounded-lag mode's two loops share one rank's CPU cores: the cores follow the work.

Each loop runs torch on its own thread with its own OpenMP team (set per thread:
colorl/threads.py). While both loops work, each keeps its share (half each by default:
bench/threads.py measured the alternatives); two teams as wide as the rank would oversubscribe
its cores. While one loop has nothing to do (the trainer waits for a Ready buffer; the engine
has no admitted sequence because the buffers are full), the other takes the whole budget from its
next boundary on: the rollout loop at each engine step, the trainer at each decoder layer's
forward and backward. On CUDA the thread counts only size CPU-side work and change nothing that matters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from colorl.threads import set_threads
from colorl.train.fsdp import decoder_layers


@dataclass
class CoreShare:
    budget: int  # the rank's intra-op threads
    rollout: int  # the rollout loop's threads while both loops work
    train: int  # the train loop's threads while both loops work
    trainer_idle: bool = False  # set by the trainer thread while it waits for a buffer
    rollout_idle: bool = False  # set by the rollout thread while the engine has nothing to decode

    @classmethod
    def of_rank(cls, launch, budget: int) -> "CoreShare":
        """`launch`'s rollout_threads / train_threads, by default half the budget each (bench/threads.py
        measured the alternatives)."""
        rollout = launch.rollout_threads or max(1, budget // 2)
        return cls(budget, rollout, launch.train_threads or max(1, budget - rollout))

    def rollout_threads(self) -> int:
        return self.budget if self.trainer_idle else self.rollout

    def train_threads(self) -> int:
        return self.budget if self.rollout_idle else self.train


def follow_in_training(model: torch.nn.Module, share: CoreShare) -> list:
    """Hooks that set the training thread's team size before each decoder layer's forward and
    before its backward (a gradient hook on the layer's output fires just before the layer's own
    backward, on the thread that runs the CPU backward: the trainer's). Returns the handles."""

    def take_train_share(*_):
        set_threads(share.train_threads())

    def before_backward(_module, _inputs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(take_train_share)

    handles = []
    for layer in decoder_layers(model):
        handles.append(layer.register_forward_pre_hook(take_train_share))
        handles.append(layer.register_forward_hook(before_backward))
    return handles
