"""Rollout collection through a real engine on a tiny model."""
from __future__ import annotations

import random

from colorl.config import EngineConfig, RolloutConfig
from colorl.engines.hf import HFEngine
from colorl.models import build_tokenizer, encode_chat
from colorl.rollout.collect import collect_groups
from colorl.rollout.episodes import Rollouts
from colorl.staleness.formula import LengthModel
from colorl.tasks.base import Problem


def test_length_override_gives_exactly_the_drawn_lengths(tiny_model_dir):
    tokenizer = build_tokenizer()
    cfg = RolloutConfig(group_size=3, max_new_tokens=8, length_override={"mean": 6, "tailness": 90, "cap": 20})
    problems = [Problem(f"What is {i} + 1?", str(i + 1)) for i in range(2)]
    ids = [encode_chat(tokenizer, p.prompt) for p in problems]
    engine = HFEngine(tiny_model_dir, EngineConfig())
    groups = collect_groups(Rollouts(engine), problems, ids, cfg, lambda p, c, a: float(len(c)), tokenizer.decode, 5,
                            stop_ids=(tokenizer.eos_token_id,))
    rng = random.Random(5)
    model = LengthModel(mean=6, tailness=90, cap=20)
    expected = [model.draw(rng) for _ in range(6)]
    assert [len(r.output_ids) for g in groups for r in g.results] == expected
    assert all(len(g.rewards) == 3 and g.first_version == 0 for g in groups)
