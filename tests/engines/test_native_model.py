"""Model code per family (Llama, Qwen2, Qwen3) against the Hugging Face modules, through the engine."""
from __future__ import annotations

import pytest
import torch

from colorl.config import EngineConfig
from colorl.engines.base import GenerationRequest, SamplingParams
from colorl.engines.native import NativeEngine
from colorl.engines.native.model import ModelSpec
from colorl.engines.native.model_runner import bucket_by_length
from colorl.models import load_model, save_tiny_model

PROMPTS = [list(range(10, 23)), [50, 51, 52, 53, 54], list(range(70, 75))]
VARIANTS = {
    # Llama with llama3 RoPE scaling, attention bias and mlp bias
    "llama": dict(family="llama", attention_bias=True, mlp_bias=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(family="qwen2", tie_word_embeddings=False),  # q/k/v bias, separate lm_head
    "qwen3": dict(family="qwen3", head_dim=24),  # q_norm / k_norm, head_dim != hidden / heads
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def family_dir(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    save_tiny_model(out, initializer_range=0.3, **VARIANTS[request.param])
    model = load_model(out)
    with torch.no_grad():  # HF initialises biases and norms to constants: make every weight matter
        generator = torch.Generator().manual_seed(0)
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(out)
    return out


def test_spec_reads_family_fields(family_dir):
    model = load_model(family_dir)
    spec = ModelSpec.from_hf_config(model.config)
    assert spec.family == model.config.model_type
    assert spec.qk_norm == (spec.family == "qwen3")
    assert spec.qkv_bias == (spec.family in ("qwen2", "llama"))
    assert spec.num_kv_heads == 2 and spec.num_heads == 4


def test_greedy_and_logprobs_match_hf(family_dir):
    model = load_model(family_dir).eval()
    eng = NativeEngine(family_dir, EngineConfig(num_blocks=64, block_size=4, max_prefill_tokens=16))
    assert set(eng.named_weights()) == set(model.state_dict()) - (
        {"lm_head.weight"} if model.config.tie_word_embeddings else set())
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    results = eng.generate([GenerationRequest(str(i), p, params) for i, p in enumerate(PROMPTS)])
    with torch.no_grad():
        for prompt, result in zip(PROMPTS, results):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
            assert result.output_ids == out[0, len(prompt):].tolist()
            logits = model(torch.tensor([prompt + result.output_ids])).logits[0, len(prompt) - 1:-1]
            expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(result.output_ids)[:, None])
            assert torch.allclose(torch.tensor(result.logprobs), expected.squeeze(-1), atol=1e-4, rtol=0)


def test_bfloat16_runs_close_to_hf(tmp_path):
    """bf16 serving, on a model with large weights where bf16's roundings show: torch's operators
    (rounding where HF's modules do) stay within 0.1 of HF's bf16 log-probs; the compiled loops
    (float32 inside each loop, fewer roundings) are at least as close to HF's float32 result as
    HF's own bf16 model is."""
    out = save_tiny_model(tmp_path, initializer_range=0.3)
    hf = {dtype: load_model(out, dtype=dtype).eval() for dtype in (torch.bfloat16, torch.float32)}

    def hf_logprobs(dtype, output_ids):
        with torch.no_grad():
            logits = hf[dtype](torch.tensor([PROMPTS[0] + output_ids])).logits[0, len(PROMPTS[0]) - 1:-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(output_ids)[:, None]).squeeze(-1)

    for use_compiled in (False, True):
        eng = NativeEngine(out, EngineConfig(num_blocks=32, block_size=4), dtype=torch.bfloat16)
        eng.model.use_compiled = use_compiled
        assert eng.named_weights()["model.norm.weight"].dtype == torch.bfloat16
        params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=0)
        result = eng.generate([GenerationRequest("b", PROMPTS[0], params)])[0]
        native, hf_bf16, hf_fp32 = torch.tensor(result.logprobs), *(hf_logprobs(dtype, result.output_ids)
                                                                      for dtype in (torch.bfloat16, torch.float32))
        if not use_compiled:
            assert torch.allclose(native, hf_bf16, atol=0.1)
        else:
            assert (native - hf_fp32).abs().mean() <= 1.1 * (hf_bf16 - hf_fp32).abs().mean()
            assert torch.allclose(native, hf_bf16, atol=0.3)


def test_unsupported_family_is_a_clear_error():
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="native engine supports"):
        ModelSpec.from_hf_config(AutoConfig.for_model("gpt2"))


def test_bucket_by_length_splits_only_when_padding_costs_more():
    assert bucket_by_length([10, 11, 12, 13], group_cost=256) == [4]
    assert bucket_by_length([10] * 8 + [1000], group_cost=256) == [8, 9]
    assert bucket_by_length([], group_cost=256) == []


@pytest.mark.parametrize("verdict", ["onednn", "torch"])
def test_cpu_matmuls_follow_the_verdict_and_the_version(family_dir, monkeypatch, verdict):
    """Whichever library this machine's race picks (forced here, so every CPU tests both): with oneDNN the
    projections use packed copies (colorl/kernels.py) that equal F.linear on the plain weights and follow
    an in-place write when the version is set; with torch's kernels nothing is packed. Either way a
    written weight reaches the model once the version moves."""
    from colorl import kernels

    if verdict == "onednn" and not kernels.onednn_enabled():
        pytest.skip("oneDNN off here (not in this torch, not x86, or COLORL_ONEDNN=0): only torch's kernels run")
    monkeypatch.setattr(kernels, "onednn_chosen",
                        lambda dtype, use=kernels.SERVING: verdict == "onednn" and dtype in kernels.onednn_dtypes())
    eng = NativeEngine(family_dir, EngineConfig(num_blocks=64, block_size=4, max_prefill_tokens=16))
    eng.model.use_compiled = False  # the loops read the plain weights or panels (tests/engines/test_cpu_decode.py)
    eng.model.repack()  # without the loops, oneDNN serves every product: all packed
    packed_linears = eng.model.linears.packed
    model = eng.model
    used = [p for layer in model.layers for p in layer.parameters() if p.dim() == 2]
    used.append(model.embed if model.lm_head is None else model.lm_head)
    if verdict == "onednn":
        assert packed_linears.enabled and set(packed_linears._packed) == {id(p) for p in used}  # packed at load
    else:
        assert not packed_linears._packed  # an untied embedding is never packed, nor anything under torch's kernels
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    packed = eng.generate([GenerationRequest("a", PROMPTS[0], params)])[0]
    packed_linears.enabled = False
    plain = eng.generate([GenerationRequest("b", PROMPTS[0], params)])[0]
    assert packed.output_ids == plain.output_ids
    assert max(abs(a - b) for a, b in zip(packed.logprobs, plain.logprobs)) < 1e-4
    packed_linears.enabled = True
    with torch.no_grad():
        eng.named_weights()["model.layers.0.mlp.down_proj.weight"].mul_(-4.0)
    gap = lambda x, y: max(abs(a - b) for a, b in zip(x.logprobs, y.logprobs))  # noqa: E731
    if verdict == "onednn":
        stale = eng.generate([GenerationRequest("c", PROMPTS[0], params)])[0]
        assert gap(stale, packed) < 1e-4  # not yet: the writer has not set the version
    eng.version += 1
    fresh = eng.generate([GenerationRequest("d", PROMPTS[0], params)])[0]
    packed_linears.enabled = False
    expected = eng.generate([GenerationRequest("e", PROMPTS[0], params)])[0]
    assert fresh.output_ids == expected.output_ids and gap(fresh, expected) < 1e-4
    assert gap(fresh, packed) > 1e-2  # the write changed the model, and the packed copies followed
