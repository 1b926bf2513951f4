"""RMSNorm and the SwiGLU MLP with the same maths as transformers' modules, saving less for backward.

A decoder layer's autograd graph, as transformers writes it, keeps for each token of a SmolLM2-135M
layer: the normalized stream twice (each norm's `x * rsqrt` and its input), and in the MLP the SiLU
output and the gated product besides the two projections (measured: 1.20 GB saved for one
888-token micro-batch). These functions save only what backward cannot recompute cheaply:

- `RMSNormFn` keeps the input and the per-token 1/rms; backward rebuilds the normalized rows;
- `SwiGLUDownFn` keeps the gate and up projections; backward rebuilds silu(gate) * up (two
  elementwise passes) for the down projection's weight gradient. Without a plain down projection
  (LoRA wraps it), `SwiGLUFn` keeps the same two and lets the wrapper save the product.

That is 0.43 GB (36 %) less per 888 tokens on SmolLM2-135M, the same as Liger's fused RMSNorm and
SwiGLU kernels do on GPU. The maths follow transformers' forward step for step (statistics in
float32, the normalized rows cast back before the weight, products through `kernels.training_linear`), so
the outputs are bit-equal and the gradients agree up to the order of float32 sums.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from colorl.kernels import training_linear

# transformers classes whose forward is exactly `weight * (x * rsqrt(mean(x²) + eps))` (Gemma's adds 1)
RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})
# ... and exactly `down(act(gate(x)) * up(x))`
GATED_MLPS = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"})


class RMSNormFn(torch.autograd.Function):
    """(x [..., H], weight [H], eps) -> weight * (x / rms(x)), statistics in float32."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        wide = x.float()
        rstd = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
        ctx.save_for_backward(x, weight, rstd)
        return weight * (wide * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd  # [..., H]
        grad_normed = (grad * weight).float()
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            # d/dx of x·rstd(x): rstd · (g − x̂ · mean(g · x̂))
            grad_x = (rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed.to(x.dtype)).reshape(-1, weight.shape[0]).sum(0).to(weight.dtype)
        return grad_x, grad_weight, None


class SwiGLUFn(torch.autograd.Function):
    """(gate, up) -> silu(gate) * up."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)


class SwiGLUDownFn(torch.autograd.Function):
    """(gate [..., I], up [..., I], down weight [H, I], bias [H] | None) -> (silu(gate) * up) @ down.T + bias."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias):
        ctx.save_for_backward(gate, up, weight)
        ctx.has_bias = bias is not None
        return training_linear(F.silu(gate) * up, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        gate, up, weight = ctx.saved_tensors
        activated = F.silu(gate)
        grad_flat = grad.reshape(-1, grad.shape[-1])  # [N, H]
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[2]:
            product = (activated * up).reshape(-1, up.shape[-1])  # [N, I], rebuilt
            grad_weight = training_linear(grad_flat.t(), product.t())  # dY^T P: [H, I]
            del product
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = grad_flat.sum(0)
        # at most three [N, I] tensors at once: the top layer's backward sets the step's peak
        grad_product = training_linear(grad, weight.t())  # dY W: [..., I]
        grad_up = grad_product * activated
        del activated
        return torch.ops.aten.silu_backward(grad_product.mul_(up), gate), grad_up, grad_weight, grad_bias


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return RMSNormFn.apply(hidden_states, self.weight, self.variance_epsilon)


def _gated_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if type(self.down_proj) is torch.nn.Linear:
        return SwiGLUDownFn.apply(gate, up, self.down_proj.weight, self.down_proj.bias)
    return self.down_proj(SwiGLUFn.apply(gate, up))


def lean_modules(model: torch.nn.Module) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """(RMSNorms, SiLU-gated MLPs) of `model` whose forward the lean functions reproduce; other norm and
    MLP classes (Gemma's 1 + weight, GELU MLPs) are not among them."""
    silu = getattr(model.config, "hidden_act", None) == "silu"
    norms = [m for m in model.modules() if type(m).__name__ in RMS_NORMS]
    mlps = [m for m in model.modules() if type(m).__name__ in GATED_MLPS] if silu else []
    return norms, mlps


def use_lean_layers(model: torch.nn.Module) -> int:
    """Give the model's `lean_modules` the lean forwards above, per instance.

    Before FSDP wraps the model (its hooks still run around `forward`); LoRA may wrap the
    projections before or after (a wrapped down projection keeps its own forward). Returns how
    many modules were switched.
    """
    norms, mlps = lean_modules(model)
    for norm in norms:
        norm.forward = types.MethodType(_rms_norm_forward, norm)
    for mlp in mlps:
        mlp.forward = types.MethodType(_gated_mlp_forward, mlp)
    return len(norms) + len(mlps)
