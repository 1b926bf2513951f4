"""The SGLang adapter on a real GPU with the real package (marked `cuda`; skipped without one).

Run on a GPU box: pip install -e '.[dev,sglang]' && python -m pytest -m cuda
Never run by the author (no GPU where colorl is developed): see docs/gpu.md.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from colorl.config import EngineConfig, SyncConfig
from colorl.engines import build_engine
from colorl.engines.base import GenerationRequest, SamplingParams
from colorl.models import load_model, save_tiny_model
from colorl.sync import CheckpointEngine

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                       reason="sglang is not installed (pip install 'colorl[sglang]')"),
]
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             initializer_range=0.3)  # head_dim 64: a size SGLang's attention kernels take
PARAMS = SamplingParams(temperature=0.8, max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return (save_tiny_model(tmp_path_factory.mktemp("sgl-a"), **SHAPE),
            save_tiny_model(tmp_path_factory.mktemp("sgl-b"), seed=1, **SHAPE))


@pytest.fixture(scope="module")
def engine(dirs):
    built = build_engine("sglang", dirs[0], EngineConfig(memory_fraction=0.3, max_num_seqs=16), "cuda", torch.float32)
    yield built
    built.shutdown()


def test_generate_logprobs_match_the_model(engine, dirs):
    results = engine.generate([GenerationRequest(f"r{i}", [5 + i, 6, 7, 8], PARAMS) for i in range(4)])
    model = load_model(dirs[0]).cuda().eval()
    for result in results:
        ids = torch.tensor([result.prompt_ids + result.output_ids], device="cuda")
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float() / PARAMS.temperature, -1)
        start = len(result.prompt_ids) - 1
        expected = [float(logp[start + k, t]) for k, t in enumerate(result.output_ids)]
        assert result.logprobs == pytest.approx(expected, abs=2e-2)
        assert result.versions == [0] * len(result.output_ids) and result.finish_reason == "length"


def test_sync_sleep_wake_and_in_flight_update(engine, dirs):
    trainer = load_model(dirs[1]).cuda()
    sync = CheckpointEngine(trainer, engine, SyncConfig(bucket_mb=1))
    engine.sleep(1)
    sync.sync(engine, 1)
    engine.wake()
    for name, p in trainer.named_parameters():
        served = engine._engine.get_weights_by_name(name, truncate_size=10**9)
        assert torch.allclose(torch.tensor(served).flatten(), p.detach().cpu().flatten()), name
    engine.add(GenerationRequest("x", [5, 6, 7], SamplingParams(temperature=1.0, max_new_tokens=200, ignore_eos=True)))
    for _ in range(20):
        engine.step()
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(0.5)
    sync.publish(2).apply(engine)
    done = []
    while engine.has_unfinished():
        done += engine.step()
    versions = done[0].versions
    assert versions[0] == 1 and versions[-1] == 2 and versions == sorted(versions)
