"""NativeEngine behaviour against Hugging Face references, on a tiny random model (SmolLM2: slow)."""
from __future__ import annotations

import ctypes
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from colorl.config import EngineConfig
from colorl.engines.base import GenerationRequest, SamplingParams
from colorl.engines.native import NativeEngine
from colorl.models import load_model, save_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
PROMPTS = [list(range(10, 17)), [40, 41, 42], list(range(60, 100)), [7], list(range(120, 138))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # initializer_range 0.3: a random model whose greedy outputs vary (0.02 just repeats its input)
    return save_tiny_model(tmp_path_factory.mktemp("lively-llama"), initializer_range=0.3)


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("lively-llama-2"), seed=1, initializer_range=0.3)


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_model(model_dir).eval()


def engine(model_dir, **cfg) -> NativeEngine:
    cfg = {"num_blocks": 128, "block_size": 4, "max_prefill_tokens": 16, **cfg}
    return NativeEngine(model_dir, EngineConfig(**cfg))


def requests(prompts, params=GREEDY, prefix="r"):
    return [GenerationRequest(f"{prefix}{i}", list(p), params) for i, p in enumerate(prompts)]


@torch.no_grad()
def hf_greedy(model, prompt, max_new_tokens):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_logprobs(model, prompt, output, temperature=1.0):
    logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float()  # [n, V]
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


def drain(eng, n_steps=None):
    done = {}
    steps = 0
    while eng.has_unfinished() and (n_steps is None or steps < n_steps):
        for r in eng.step():
            done[r.request_id] = r
        steps += 1
    return done


# ---------------------------------------------------------------- correctness against HF


def test_greedy_batch_of_mixed_lengths_matches_hf_generate(model_dir, hf):
    eng = engine(model_dir)  # small blocks and a 16-token prefill budget: chunked, paged, batched
    results = eng.generate(requests(PROMPTS))
    for prompt, result in zip(PROMPTS, results):
        assert result.output_ids == hf_greedy(hf, prompt, GREEDY.max_new_tokens)
        assert result.versions == [0] * len(result.output_ids)
    assert eng.stats().kv_blocks_used == 0


def test_sampled_logprobs_equal_hf_forward(model_dir, hf):
    params = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=3)
    eng = engine(model_dir)
    for prompt, result in zip(PROMPTS, eng.generate(requests(PROMPTS, params))):
        expected = hf_logprobs(hf, prompt, result.output_ids)
        assert torch.allclose(torch.tensor(result.logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_teacher_forced_scores_are_the_behaviour_logprobs(model_dir, temperature):
    """score() (the oracle test's entry: tests/engines/test_vllm_oracle.py) gives, for the tokens the
    engine sampled, the log-probs step() returned for them, and leaves no KV block taken. To float32
    rounding: on a CPU the decode steps run the compiled loops (cpu_decode.c), the teacher-forced
    prefill SDPA and oneDNN, summing in other orders."""
    params = SamplingParams(temperature=temperature, max_new_tokens=16, ignore_eos=True, seed=11)
    eng = engine(model_dir)
    for prompt, result in zip(PROMPTS, eng.generate(requests(PROMPTS, params))):
        scored = eng.score(prompt, result.output_ids, temperature)
        assert torch.allclose(torch.tensor(scored), torch.tensor(result.logprobs), atol=1e-4, rtol=0)
    assert eng.stats().kv_blocks_used == 0


def test_logprobs_follow_temperature_top_k_top_p(model_dir, hf):
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, max_new_tokens=10, ignore_eos=True, seed=5)
    eng = engine(model_dir)
    prompt = PROMPTS[0]
    result = eng.generate(requests([prompt], params))[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + result.output_ids])).logits[0, len(prompt) - 1:-1].float() / 0.7
    for row, token, logp in zip(logits, result.output_ids, result.logprobs):
        order = row.argsort(descending=True)
        probs = torch.softmax(row[order[:20]], -1)
        keep = (probs.cumsum(0) - probs) < 0.8
        kept = order[:20][keep]
        assert token in kept.tolist()
        expected = torch.log_softmax(row[kept], -1)[kept.tolist().index(token)]
        assert abs(logp - expected.item()) < 1e-4


def test_same_seed_same_samples_whatever_the_batch(model_dir):
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=42)
    alone = engine(model_dir).generate([GenerationRequest("x", PROMPTS[1], params)])[0]
    eng = engine(model_dir, max_prefill_tokens=64)
    others = requests(PROMPTS, replace(params, seed=7), prefix="o")
    crowd = eng.generate(others[:3] + [GenerationRequest("x", PROMPTS[1], params)] + others[3:])[3]
    assert crowd.output_ids == alone.output_ids
    assert engine(model_dir).generate([GenerationRequest("y", PROMPTS[1], replace(params, seed=43))])[0].output_ids != alone.output_ids


# ---------------------------------------------------------------- RL controls


def test_abort_frees_all_blocks(model_dir):
    eng = engine(model_dir)
    for r in requests(PROMPTS, replace(GREEDY, max_new_tokens=50, ignore_eos=True)):
        eng.add(r)
    drain(eng, n_steps=6)
    assert eng.stats().kv_blocks_used > 0 and eng.stats().running > 0
    eng.abort([f"r{i}" for i in range(len(PROMPTS))])
    stats = eng.stats()
    assert (stats.kv_blocks_used, stats.running, stats.waiting) == (0, 0, 0)
    assert not eng.has_unfinished()


@pytest.mark.parametrize("keep_kv", [False, True])
def test_interrupt_and_resume_continue_like_an_uninterrupted_run(model_dir, keep_kv):
    params = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True, seed=11)
    reference = engine(model_dir).generate(requests(PROMPTS[:3], params))
    eng = engine(model_dir)
    for r in requests(PROMPTS[:3], params):
        eng.add(r)
    drain(eng, n_steps=5)  # the prefills (54 tokens, 16 a step), then a burst of decode steps (engine.decode_burst)
    partial = eng.interrupt(["r0", "r1", "r2"], keep_kv=keep_kv)
    assert {p.finish_reason for p in partial} == {"interrupt"}
    assert all(0 < len(p.output_ids) < 20 for p in partial)
    assert (eng.stats().kv_blocks_used > 0) == keep_kv
    computed_before = eng.num_computed_tokens
    resumed = [GenerationRequest(p.request_id, p.prompt_ids, params, p.output_ids, p.logprobs, p.versions) for p in partial]
    finished = eng.generate(resumed)
    for ref, got in zip(reference, finished):
        assert got.output_ids == ref.output_ids
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=1e-4)
    recomputed = eng.num_computed_tokens - computed_before
    remaining = sum(20 - len(p.output_ids) for p in partial)
    if keep_kv:
        assert recomputed == remaining  # one token per step, nothing re-prefilled
    else:
        assert recomputed > remaining
    assert eng.stats().kv_blocks_used == 0


def test_update_weights_changes_outputs_and_stamps_new_version(model_dir, other_dir):
    params = replace(GREEDY, max_new_tokens=16, ignore_eos=True)
    other = load_model(other_dir).eval()
    eng = engine(model_dir)
    before = eng.generate(requests([PROMPTS[0]], params, prefix="a"))[0]  # fills the prefix cache
    eng.add(GenerationRequest("mid", PROMPTS[0], params))
    drain(eng, n_steps=5)
    eng.update_weights(other.state_dict().items(), version=1)
    assert eng.version == 1
    mid = drain(eng)["mid"]
    n_old = mid.versions.count(0)
    assert n_old == 5 and mid.versions == [0] * n_old + [1] * (16 - n_old)
    assert mid.output_ids[:n_old] == before.output_ids[:n_old]
    after = eng.generate(requests([PROMPTS[0]], params, prefix="b"))[0]
    assert after.output_ids == hf_greedy(other, PROMPTS[0], 16) != before.output_ids
    assert after.versions == [1] * 16


@pytest.mark.parametrize("keep_kv", [False, True])
def test_a_prompt_prefilled_across_a_weight_update_keeps_the_older_version(model_dir, other_dir, keep_kv):
    """Chunks of 16, a 40-token prompt: 16 prompt tokens' KV computed at v0, then the weights move to v1.
    Every token is sampled at v1, but each reads v0's KV: the sample's version is 0, also after an
    interrupt and resume (re-prefilled or on its kept KV) and when the update comes between tokens."""
    params = replace(GREEDY, max_new_tokens=4, ignore_eos=True)
    other = load_model(other_dir).eval()
    eng = engine(model_dir)
    eng.add(GenerationRequest("straddling", PROMPTS[2], params))
    drain(eng, n_steps=1)  # the first chunk of the prompt
    eng.update_weights(other.state_dict().items(), version=1)
    drain(eng, n_steps=3)  # the prompt's other two chunks (v1), the first token, a second one
    (partial,) = eng.interrupt(["straddling"], keep_kv=keep_kv)
    eng.update_weights(other.state_dict().items(), version=2)
    (done,) = eng.generate([GenerationRequest("straddling", partial.prompt_ids, params, partial.output_ids,
                                              partial.logprobs, partial.versions, partial.state_version)])
    assert done.versions == [1, 1, 2, 2]
    assert done.state_version == 0 and done.first_version == 0
    fresh = eng.generate([GenerationRequest("fresh", PROMPTS[2], params)])[0]
    assert fresh.versions == [2] * 4 and fresh.first_version == 2


def test_named_weights_are_live(model_dir, hf):
    eng = engine(model_dir)
    weights = eng.named_weights()
    assert set(weights) == set(hf.state_dict()) - {"lm_head.weight"}  # tied: only the embedding
    before = eng.generate(requests([PROMPTS[0]]))[0].output_ids
    with torch.no_grad():
        weights["model.layers.0.self_attn.k_proj.weight"].mul_(-1.0)
        weights["model.layers.1.mlp.up_proj.weight"].mul_(3.0)
    eng.version += 1  # how a writer says it is done (the checkpoint engine always does)
    assert eng.generate(requests([PROMPTS[0]], prefix="z"))[0].output_ids != before


@pytest.mark.parametrize("level, backup", [(1, False), (2, True)], ids=["level1", "level2-backup"])
def test_sleep_wake_round_trip_preserves_outputs(model_dir, level, backup):
    """Level 1, and level 2 with a backup (LoRA's: its sync re-sends only the adapted matrices):
    the weights stay, nothing has to be loaded before the next rollout."""
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=9)
    eng = engine(model_dir, weights_cpu_backup=backup)
    first = eng.generate(requests(PROMPTS, params))
    for r in requests(PROMPTS, params, prefix="s"):
        eng.add(r)
    drain(eng, n_steps=2)  # asleep mid-flight (the prefills, a burst of decode steps): re-prefilled after wake
    eng.sleep(level)
    assert eng.stats().kv_blocks_used == 0 and eng.runner.kv_cache is None
    assert not eng.model.linears.packed._packed  # the packed weight copies are the training phase's too
    with pytest.raises(RuntimeError):
        eng.step()
    eng.wake()
    done = drain(eng)
    assert [done[f"s{i}"].output_ids for i in range(len(PROMPTS))] == [r.output_ids for r in first]
    assert [r.output_ids for r in eng.generate(requests(PROMPTS, params, prefix="t"))] == [r.output_ids for r in first]


def _weight_bytes(eng) -> int:
    return sum(p.numel() * p.element_size() for p in eng.model.parameters())


def test_sleep_level_2_releases_the_weights_and_refuses_to_serve_until_a_full_load(model_dir):
    eng = engine(model_dir)
    served = {name: t.clone() for name, t in eng.named_weights().items()}
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=9)
    first = [r.output_ids for r in eng.generate(requests(PROMPTS, params))]
    eng.sleep(2)
    assert _weight_bytes(eng) == 0 and eng.weights_released  # the training phase gets their memory
    with pytest.raises(RuntimeError, match="released at sleep level 2"):
        eng.wake()
    with pytest.raises(RuntimeError, match="released at sleep level 2"):
        eng.named_weights()  # a partial writer (a LoRA merge) cannot take them back
    eng.version = 1  # a version stamp alone loads nothing
    with pytest.raises(RuntimeError, match="no full load"):
        eng.wake()
    with pytest.raises(KeyError, match="missing"):  # some weights only: refused, still released
        eng.load_weights(list(served.items())[:3])
    assert eng.weights_released and _weight_bytes(eng) == 0

    targets = eng.full_load_targets()  # the checkpoint engine's sync: every weight, then the version
    with pytest.raises(RuntimeError, match="no full load"):
        eng.wake()  # storage is back but not yet written
    for name, tensor in served.items():
        targets[name].copy_(tensor)
    eng.version = 2
    eng.wake()
    assert all(torch.equal(eng.named_weights()[name], tensor) for name, tensor in served.items())  # bit-exact
    assert [r.output_ids for r in eng.generate(requests(PROMPTS, params, prefix="b"))] == first


def _mapping_of(address: int) -> str | None:
    """The /proc/self/maps line whose range holds `address`, or None."""
    for line in open("/proc/self/maps"):
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return line
    return None


@pytest.fixture
def kept_heap():
    """Every allocation from the heap, as in colorl's CPU ranks (MALLOC_MMAP_MAX_=0, colorl/launch.py)."""
    from colorl.heap import GLIBC_MMAP_MAX, M_MMAP_MAX

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_MAX, 0)
    yield
    libc.mallopt(M_MMAP_MAX, GLIBC_MMAP_MAX)


def test_the_cpu_kv_pool_is_a_mapping_of_its_own_given_back_at_sleep(model_dir, kept_heap):
    """Not on the heap: a rank keeps its heap, where the pool's touched pages stayed resident after
    sleep and the train phase's tensors landed beside them, a little higher each step (issue 31)."""
    eng = engine(model_dir)
    address = eng.runner.kv_cache.data_ptr()
    assert "[heap]" not in _mapping_of(address)
    eng.sleep(1)
    assert _mapping_of(address) is None  # its pages went back to the system
    eng.wake()
    assert eng.generate(requests([PROMPTS[0]]))[0].output_ids


def _advised_huge(address: int) -> bool:
    """Whether the mapping holding `address` was advised for huge pages (smaps' VmFlags `hg`)."""
    entry = None
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and ":" not in head[0]:
            start, end = (int(x, 16) for x in head[0].split("-"))
            entry = start <= address < end
        elif entry and line.startswith("VmFlags:"):
            return "hg" in head[1:]
    return False


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists(), reason="no transparent huge pages")
def test_cpu_weights_share_one_mapping_advised_for_huge_pages(model_dir, kept_heap):
    """A decode step streams every weight once; with them on 2 MB pages a step ran 1.04-1.13x faster on one
    Zen 3 (bench/decode_step.py). The weights sit off the heap in one advised mapping when built, and again when a
    full load brings them back after sleep level 2; the KV pool stays on small pages."""
    eng = engine(model_dir)
    first = eng.generate(requests(PROMPTS))
    for _ in range(2):
        addresses = [p.data_ptr() for p in eng.model.parameters()]
        assert len({_mapping_of(a) for a in addresses}) == 1 and "[heap]" not in _mapping_of(addresses[0])
        assert all(_advised_huge(a) for a in addresses)
        assert not _advised_huge(eng.runner.kv_cache.data_ptr())
        served = {name: t.clone() for name, t in eng.named_weights().items()}
        eng.sleep(2)
        assert _mapping_of(addresses[0]) is None  # released: the mapping went back to the system
        targets = eng.full_load_targets()
        for name, tensor in served.items():
            targets[name].copy_(tensor)
        del targets  # views of the new mapping: held, they would keep it past the next release
        eng.version += 1
        eng.wake()
    assert [r.output_ids for r in eng.generate(requests(PROMPTS, prefix="b"))] == [r.output_ids for r in first]


def test_a_load_of_every_weight_brings_released_weights_back(model_dir, hf):
    eng = engine(model_dir)
    first = eng.generate(requests(PROMPTS))
    eng.sleep(2)
    eng.update_weights(hf.state_dict().items(), version=1)  # whole tensors, as naive_sync hands them over
    eng.wake()
    weights = eng.named_weights()
    assert all(torch.equal(weights[name], t) for name, t in hf.state_dict().items() if name in weights)
    assert [r.output_ids for r in eng.generate(requests(PROMPTS, prefix="b"))] == [r.output_ids for r in first]


def test_burst_larger_than_kv_pool_preempts_and_completes(model_dir, hf):
    # 14 blocks of 4 tokens = 56 tokens of KV for 6 requests that need up to 30 each
    prompts = [list(range(20 + i, 34 + i)) for i in range(6)]
    params = replace(GREEDY, max_new_tokens=16, ignore_eos=True)
    eng = engine(model_dir, num_blocks=14)
    results = eng.generate(requests(prompts, params))
    assert eng.scheduler.num_preemptions > 0
    for prompt, result in zip(prompts, results):
        assert result.output_ids == hf_greedy_ignore_eos(hf, prompt, 16)
    assert eng.stats().kv_blocks_used == 0


@torch.no_grad()
def hf_greedy_ignore_eos(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_group_prompt_is_prefilled_once(model_dir):
    prompt = list(range(30, 70))  # 10 blocks of 4
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    eng = engine(model_dir, max_prefill_tokens=256)
    group = [GenerationRequest(f"g{i}", prompt, replace(params, seed=i)) for i in range(4)]
    results = eng.generate(group)
    # prompt computed once + each sample's last (unshared) block + its decode steps
    assert eng.scheduler.num_prefix_hit_tokens == 3 * 36
    assert eng.num_computed_tokens == 40 + 3 * 4 + 4 * 5
    separate = [engine(model_dir).generate([r])[0].output_ids for r in group]
    assert [r.output_ids for r in results] == separate


def test_stats_and_max_num_seqs(model_dir):
    eng = engine(model_dir, max_num_seqs=2)
    for r in requests(PROMPTS, replace(GREEDY, max_new_tokens=4, ignore_eos=True)):
        eng.add(r)
    eng.step()
    stats = eng.stats()
    assert (stats.running, stats.waiting, stats.finished) == (2, 3, 0)
    assert stats.kv_blocks_total == 128 and stats.kv_blocks_used > 0
    drain(eng)
    stats = eng.stats()
    assert (stats.running, stats.waiting, stats.finished, stats.kv_blocks_used) == (0, 0, 5, 0)
    assert stats.decode_tokens_per_s > 0


def test_stop_ids_eos_and_resume_budget(model_dir):
    eng = engine(model_dir)
    free_run = eng.generate(requests([PROMPTS[0]], replace(GREEDY, ignore_eos=True)))[0].output_ids
    stop_at = free_run[3]
    params = replace(GREEDY, stop_token_ids=(stop_at,), ignore_eos=True)
    stopped = eng.generate(requests([PROMPTS[0]], params, prefix="s"))[0]
    assert stopped.finish_reason == "stop" and stopped.output_ids == free_run[:free_run.index(stop_at) + 1]
    # a resumed request whose carried output already fills max_new_tokens finishes at once
    full = GenerationRequest("f", PROMPTS[0], replace(GREEDY, max_new_tokens=2), free_run[:2], [0.0, 0.0], [0, 0])
    assert eng.generate([full])[0].finish_reason == "length"


def test_registry_and_model_argument(model_dir, hf):
    from colorl.engines import build_engine

    eng = build_engine("native", model_dir, EngineConfig(num_blocks=64, block_size=4))
    assert isinstance(eng, NativeEngine)
    from_module = NativeEngine(model_dir, EngineConfig(num_blocks=64, block_size=4), model=hf)
    expected = eng.generate(requests(PROMPTS[:2]))
    assert [r.output_ids for r in from_module.generate(requests(PROMPTS[:2]))] == [r.output_ids for r in expected]


def test_default_pool_is_sized_from_memory_fraction(model_dir):
    eng = NativeEngine(model_dir, EngineConfig(memory_fraction=0.01, max_num_seqs=4, block_size=16))
    # capped by what max_num_seqs sequences of max_position_embeddings tokens can use
    assert 1 <= eng.stats().kv_blocks_total <= 4 * 512 // 16


# ---------------------------------------------------------------- the real model


@pytest.mark.slow
def test_smollm2_greedy_and_logprobs_match_hf(smollm2_dir):
    from colorl.models import encode_chat, load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    model = load_model(smollm2_dir).eval()
    prompts = [encode_chat(tokenizer, q) for q in ("What is 2+3?", "Name a color.", "Write a haiku about the sea.")]
    prompts.append(prompts[0][:5])
    eng = NativeEngine(smollm2_dir, EngineConfig(num_blocks=256, block_size=16, max_prefill_tokens=32))
    for prompt, result in zip(prompts, eng.generate(requests(prompts, replace(GREEDY, max_new_tokens=24)))):
        assert result.output_ids == hf_greedy(model, prompt, 24)
        expected = hf_logprobs(model, prompt, result.output_ids)
        assert torch.allclose(torch.tensor(result.logprobs), expected, atol=1e-4, rtol=0)


def test_random_traffic_with_aborts_and_interrupts(model_dir, hf):
    """Arrivals, aborts, interrupts (both resume kinds) on a tight pool: greedy outputs stay exact,
    every surviving request finishes once, and every block comes back."""
    rng = random.Random(0)
    eng = engine(model_dir, num_blocks=12, max_num_seqs=4)
    live: dict[str, GenerationRequest] = {}
    finished: dict[str, list[int]] = {}
    aborted: set[str] = set()
    for t in range(150):
        roll = rng.random()
        if roll < 0.2 and len(live) < 8:
            rid = f"q{t}"
            prompt = [rng.randrange(3, 250) for _ in range(rng.randint(1, 20))]
            live[rid] = GenerationRequest(rid, prompt, replace(GREEDY, max_new_tokens=rng.randint(1, 12), ignore_eos=True))
            eng.add(live[rid])
        elif roll < 0.25 and live:
            rid = rng.choice(sorted(live))
            eng.abort([rid])
            aborted.add(live.pop(rid).request_id)
        elif roll < 0.32 and live:
            rid = rng.choice(sorted(live))
            for part in eng.interrupt([rid], keep_kv=rng.random() < 0.5):
                if part.finish_reason == "interrupt":
                    eng.add(GenerationRequest(rid, part.prompt_ids, live[rid].params, part.output_ids,
                                              part.logprobs, part.versions))
                else:
                    finished[rid] = part.output_ids
                    live.pop(rid)
        for result in eng.step():
            assert result.request_id not in finished
            finished[result.request_id] = result.output_ids
            request = live.pop(result.request_id)
            assert result.output_ids == hf_greedy_ignore_eos(hf, request.prompt_ids, request.params.max_new_tokens)
    for result in drain(eng).values():
        request = live.pop(result.request_id)
        assert result.output_ids == hf_greedy_ignore_eos(hf, request.prompt_ids, request.params.max_new_tokens)
    assert not live and aborted and eng.scheduler.num_preemptions > 0
    assert eng.stats().kv_blocks_used == 0


@pytest.mark.cuda
def test_cuda_matches_cpu(model_dir):
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=1)
    cpu = engine(model_dir).generate(requests(PROMPTS, params))
    cuda = NativeEngine(model_dir, EngineConfig(num_blocks=128, block_size=4), device="cuda").generate(requests(PROMPTS, params))
    assert [r.output_ids for r in cuda] == [r.output_ids for r in cpu]
