"""The lean RMSNorm and SwiGLU MLP: transformers' outputs and gradients, for less saved activation.

Each module is built twice from the same weights, once as transformers leaves it and once with
`use_lean_layers`; the same inputs must give bit-equal outputs, gradients equal to float32 rounding
(bf16: to bf16 rounding), and fewer bytes kept between forward and backward. A real decoder layer
in float32 and bf16, with LoRA on the down projection, and the whole trainer at world size 1.
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from colorl.kernels import use_onednn_linears
from colorl.models import tiny_config
from colorl.train.lean_layers import use_lean_layers


def saved_bytes(run, module: torch.nn.Module) -> tuple[object, int]:
    """run()'s result and the bytes autograd saved for backward, the module's weights aside (F.linear saves
    a transposed view of its weight, oneDNN's product the weight itself)."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    return out, sum(seen.values())


def twin(module: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(transformers' module, a copy with the lean forwards); products on oneDNN in both where it runs."""
    lean = copy.deepcopy(module)
    use_onednn_linears(module, "cpu")
    use_onednn_linears(lean, "cpu")
    lean.config = module.config = getattr(module, "config", None) or tiny_config(64)
    assert use_lean_layers(lean) >= 1
    return module, lean


def forward_backward(module, inputs: list[torch.Tensor], **kwargs):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    module.zero_grad(set_to_none=True)
    out, kept = saved_bytes(lambda: module(*leaves, **kwargs), module)
    out = out[0] if isinstance(out, tuple) else out
    torch.manual_seed(1)
    out.backward(torch.randn_like(out))
    grads = {name: p.grad for name, p in module.named_parameters() if p.grad is not None}
    grads.update({f"input{i}": leaf.grad for i, leaf in enumerate(leaves)})
    return out.detach(), grads, kept


def assert_twins_agree(module, lean, inputs, tolerance: float, **kwargs) -> tuple[int, int]:
    out, grads, kept = forward_backward(module, inputs, **kwargs)
    lean_out, lean_grads, lean_kept = forward_backward(lean, inputs, **kwargs)
    assert torch.equal(lean_out, out)
    assert grads.keys() == lean_grads.keys() and grads
    for name, grad in grads.items():
        error = (lean_grads[name].float() - grad.float()).norm() / grad.float().norm().clamp_min(1e-30)
        assert error <= tolerance, (name, float(error))
    return kept, lean_kept


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rms_norm_matches_transformers_and_keeps_input_and_inverse_rms_only(dtype, tolerance):
    torch.manual_seed(0)
    norm = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    norm, lean = twin(norm)
    x = (torch.randn(2, 9, 48) * 3).to(dtype)
    kept, lean_kept = assert_twins_agree(norm, lean, [x], tolerance)
    row = 48 * x.element_size()
    assert lean_kept == 2 * 9 * (row + 4)  # x, and one float32 1/rms per token
    assert kept >= 2 * 9 * 2 * row  # transformers keeps x and the normalized rows


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_gated_mlp_matches_transformers_and_keeps_gate_and_up_only(dtype, tolerance):
    torch.manual_seed(0)
    config = tiny_config(64, hidden_size=40, intermediate_size=72)
    mlp, lean = twin(LlamaMLP(config).to(dtype))
    x = torch.randn(3, 11, 40).to(dtype)
    kept, lean_kept = assert_twins_agree(mlp, lean, [x], tolerance)
    tokens, width = 3 * 11, 72 * x.element_size()
    x_bytes = tokens * 40 * x.element_size()
    assert lean_kept == x_bytes + 2 * tokens * width  # x for the projections, gate and up
    assert kept == x_bytes + 4 * tokens * width  # ... and silu(gate), the product


def test_gated_mlp_with_lora_on_the_down_projection_keeps_its_wrapper():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = tiny_config(64, hidden_size=40, intermediate_size=72)

    class Holder(torch.nn.Module):  # peft wants a model with a config
        def __init__(self):
            super().__init__()
            self.config = config
            self.mlp = LlamaMLP(config)

        def forward(self, x):
            return self.mlp(x)

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["down_proj", "gate_proj"], init_lora_weights=False)
    holder, lean = twin(Holder())
    holder, lean = peft.get_peft_model(holder, lora), peft.get_peft_model(lean, copy.deepcopy(lora))
    lean.base_model.model.mlp.down_proj.load_state_dict(holder.base_model.model.mlp.down_proj.state_dict())
    lean.base_model.model.mlp.gate_proj.load_state_dict(holder.base_model.model.mlp.gate_proj.state_dict())
    assert type(lean.base_model.model.mlp.down_proj) is not torch.nn.Linear
    kept, lean_kept = assert_twins_agree(holder, lean, [torch.randn(2, 5, 40)], 1e-6)
    assert lean_kept < kept


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_decoder_layer_keeps_a_third_less(dtype, tolerance):
    torch.manual_seed(0)
    config = tiny_config(64, hidden_size=64, intermediate_size=160)
    config._attn_implementation = "sdpa"
    layer, lean = twin(LlamaDecoderLayer(config, layer_idx=0).to(dtype))
    x = torch.randn(1, 24, 64).to(dtype)
    position_ids = torch.arange(24)[None]
    rotary = LlamaRotaryEmbedding(config)
    cos, sin = (t.to(dtype) for t in rotary(x, position_ids))
    kept, lean_kept = assert_twins_agree(layer, lean, [x], tolerance, position_embeddings=(cos, sin),
                                         attention_mask=None, position_ids=position_ids)
    assert lean_kept <= 0.7 * kept, (lean_kept, kept)


def test_other_norms_and_activations_are_left_as_transformers_writes_them():
    config = tiny_config(64, hidden_act="gelu")
    mlp = LlamaMLP(config)

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = config
            self.mlp, self.norm = mlp, torch.nn.LayerNorm(8)

    holder = Holder()
    assert use_lean_layers(holder) == 0
    assert "forward" not in vars(mlp) and "forward" not in vars(holder.norm)
