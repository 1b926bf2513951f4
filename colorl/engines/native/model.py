"""Llama / Qwen2 / Qwen3 decoder for the native engine, over a paged KV cache.

The math follows the Hugging Face modules of these families (RMSNorm in float32, RoPE tables as
HF computes them, GQA, Qwen2's q/k/v bias, Qwen3's per-head q_norm/k_norm), and the weights are
addressed by their Hugging Face names (`hf_weights`), so an HF folder or the trainer's state
dict loads without conversion. Layout choices, invisible from outside:
- matrices keep the HF [out, in] layout, with q/k/v and gate/up fused (one matmul instead of
  three / two): the HF-named tensors (`hf_weights`) are row slices of the fused storage, so
  in-place copies update what runs. On CPU the products run through oneDNN over packed copies
  of these matrices (`colorl/kernels.py`); `repack` refreshes them after the weights change.
- tokens of one step are flattened across sequences ([T, ...]): every projection runs once over
  all of them; only attention is per group of sequences (see `AttentionGroup`).
- float32 or bfloat16 on CPU, the decode step's loops run compiled for this machine where it has
  a C compiler (`cpu_decode.py`): products over a few rows, RoPE with the KV write, the residual
  add fused with the next RMSNorm, SiLU-gating, and attention read straight from the block
  table; a step of one-token decodes runs all its layers in one compiled call. The torch operators
  below are the same maths for every other case (and the reference the tests hold the compiled
  loops to).
"""
from __future__ import annotations

import ctypes

import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from colorl.engines.native import cpu_decode
from colorl.engines.native.cpu_decode import CpuDecode
from colorl.engines.weights import copy_rows
from colorl.kernels import PackedLinears

FAMILIES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelSpec:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    hidden_act: str
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, config) -> "ModelSpec":
        family = config.model_type
        if family not in FAMILIES:
            raise ValueError(f"native engine supports model families {FAMILIES}, not {family!r}; use rollout.engine=hf")
        layer_types = getattr(config, "layer_types", None) or []
        if getattr(config, "use_sliding_window", False) and "sliding_attention" in layer_types:
            raise NotImplementedError(f"{family} with sliding-window attention is not supported by the native engine")
        attention_bias = bool(getattr(config, "attention_bias", False))
        num_heads = config.num_attention_heads
        return cls(
            family=family,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family == "qwen2" else attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=family == "qwen3",
            hidden_act=config.hidden_act,
            max_position_embeddings=config.max_position_embeddings,
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_matrix_elements(self) -> int:
        """The elements of one decoder layer's matrices (q/k/v, o, gate/up, down): what its products read."""
        return self.hidden_size * (2 * self.q_size + 2 * self.kv_size + 3 * self.intermediate_size)


# ---------------------------------------------------------------- attention metadata


@dataclass
class AttentionGroup:
    """Sequences whose attention runs as one call.

    The group's query tokens are rows [start, end) of the step's flattened tokens. Either padded
    SDPA (queries padded to [batch, q_len], keys/values gathered from the cache to [batch, kv_len]),
    or, for one-token decodes with the compiled loops, attention over each sequence's own blocks.
    """

    start: int
    end: int
    batch: int
    q_len: int
    kv_len: int
    q_pad_index: torch.Tensor | None = None  # [end - start] rows of the padded [batch * q_len] layout; None if q_len == 1
    kv_slots: torch.Tensor | None = None  # [batch * kv_len] cache slots (padding points at slot 0 and is masked)
    mask: torch.Tensor | None = None  # [batch, 1, q_len, kv_len] bool, True = attend
    block_tables: torch.Tensor | None = None  # compiled decode: [batch, blocks] block ids
    lengths: torch.Tensor | None = None  # compiled decode: [batch] context tokens
    context_tokens: int = 0  # compiled decode: the sum of lengths
    block_size: int = 0


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    groups: list[AttentionGroup]
    logit_rows: torch.Tensor  # [N] rows of the T tokens whose next-token logits are needed
    max_position: int
    every_token_samples: bool = False  # logit_rows is every row, in order: the compiled decode's call makes the logits


@dataclass
class DecodeBurst:
    """What a burst of decode steps (`CausalLM.decode_burst`) needs beyond its first step's inputs: each step's K/V
    slot of each row, and each row's draws and temperature, the rows in the first step's order."""

    slots: torch.Tensor  # [steps, T] int64, row 0 the first step's slot_mapping
    draws: list[float]  # steps * T uniforms in (0, 1] (sampler.uniform), step by step
    temperatures: list[float]  # [T], each above 0
    stops: list[frozenset[int]]  # [T]: the tokens that end each row's sequence (the burst ends at the first drawn)


# ---------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor | None,
                    compiled: CpuDecode | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)) for the residual stream x [T, hidden]; compiled, x is
        updated in place (the stream is the forward's own tensor)."""
        if compiled is not None:
            return x, compiled.add_rms_norm(x, delta, self.weight, self.eps)
        if delta is not None:
            x = x + delta
        return x, self(x)


class Rotary(nn.Module):
    """cos/sin tables by position, built the way HF builds them (float32, then cast)."""

    def __init__(self, config, spec: ModelSpec) -> None:
        super().__init__()
        params = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            dim = spec.head_dim
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            scaling = 1.0
        elif rope_type == "dynamic":
            raise NotImplementedError("rope_type 'dynamic' (length-dependent) is not supported by the native engine")
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        if inv_freq.numel() * 2 != spec.head_dim:
            raise NotImplementedError("partial rotary embeddings are not supported by the native engine")
        self.inv_freq = nn.Buffer(inv_freq.float(), persistent=False)
        self.scaling = float(scaling)
        self.cos = nn.Buffer(torch.empty(0), persistent=False)  # [P, D] float32
        self.sin = nn.Buffer(torch.empty(0), persistent=False)
        self.build(spec.max_position_embeddings)

    def build(self, length: int) -> None:
        positions = torch.arange(length, device=self.inv_freq.device).float()
        freqs = positions[:, None] * self.inv_freq.float()[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos = emb.cos() * self.scaling
        self.sin = emb.sin() * self.scaling

    def forward(self, positions: torch.Tensor, max_position: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        self.cover(max_position)
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)  # [T, D] each

    def cover(self, max_position: int) -> None:
        if max_position >= self.cos.shape[0]:
            self.build(max(2 * self.cos.shape[0], max_position + 1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def paged_attention(q: torch.Tensor, cache: torch.Tensor, group: AttentionGroup, scale: float) -> torch.Tensor:
    """q: [T_g, H, D] of one group; cache: [slots, 2, Hkv, D] of one layer. Returns [T_g, H*D]."""
    heads, dim = q.shape[1], q.shape[2]
    b, q_len, kv_len = group.batch, group.q_len, group.kv_len
    if group.q_pad_index is None:
        q_pad = q.view(b, 1, heads, dim)
    else:
        q_pad = q.new_zeros(b * q_len, heads, dim).index_copy_(0, group.q_pad_index, q).view(b, q_len, heads, dim)
    kv = cache.index_select(0, group.kv_slots).view(b, kv_len, 2, cache.shape[2], dim)
    k = kv[:, :, 0].transpose(1, 2)  # [B, Hkv, L, D]
    v = kv[:, :, 1].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), k, v, attn_mask=group.mask, scale=scale, enable_gqa=k.shape[1] != heads
    )  # [B, H, Q, D]
    out = out.transpose(1, 2).reshape(b * q_len, heads * dim)
    return out if group.q_pad_index is None else out.index_select(0, group.q_pad_index)


class Products:
    """Where the engine's matrix products run: the compiled loops for a decode step's rows (up to MAX_ROWS
    the rows kernel or the panels, whichever won this machine's race, the panels above: at the row counts
    where they beat the alternative in that race, per dtype; the panels above MAX_PANEL_ROWS too, prefill
    included, when they won there), oneDNN over packed weights otherwise (`PackedLinears`; where the loops won every row count,
    none is made). Both copies are dropped with every weight version and made again when needed."""

    def __init__(self) -> None:
        self.packed = PackedLinears()
        self.panels = cpu_decode.PanelCopies()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               compiled: CpuDecode | None = None) -> torch.Tensor:
        """x: [T, in]; weight: [out, in] (HF layout); returns [T, out]."""
        rows = x.shape[0]
        if compiled is not None and compiled.takes(rows, x.dtype) and x.is_contiguous():
            if compiled.on_panels(rows, x.dtype):
                return compiled.panel_linear(x, self.panels.of(weight, compiled), weight.shape[0], bias)
            return compiled.linear(x, weight, bias)
        return self.packed.linear(x, weight, bias)

    def clear(self) -> None:
        """Forget every packed and panel copy (the weights changed, or the engine sleeps)."""
        self.packed.clear()
        self.panels.clear()


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, linears: Products) -> None:
        super().__init__()
        self.spec = spec
        self.linears = linears
        width = spec.q_size + 2 * spec.kv_size
        self.w_qkv = nn.Parameter(torch.empty(width, spec.hidden_size))  # [q | k | v, hidden]
        self.b_qkv = nn.Parameter(torch.zeros(width)) if spec.qkv_bias else None
        self.w_o = nn.Parameter(torch.empty(spec.hidden_size, spec.q_size))
        self.b_o = nn.Parameter(torch.zeros(spec.hidden_size)) if spec.o_bias else None
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.scale = spec.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                step: StepInputs, compiled: CpuDecode | None) -> torch.Tensor:
        """cos/sin: per token [T, 1, D]; compiled: the tables [P, D], indexed by step.positions."""
        s = self.spec
        tokens = x.shape[0]
        qkv = self.linears.linear(x, self.w_qkv, self.b_qkv, compiled)  # [T, q | k | v]
        q = qkv[:, :s.q_size].view(tokens, s.num_heads, s.head_dim)  # [T, H, D]
        k = qkv[:, s.q_size:s.q_size + s.kv_size].view(tokens, s.num_kv_heads, s.head_dim)  # [T, Hkv, D]
        v = qkv[:, s.q_size + s.kv_size:].view(tokens, s.num_kv_heads, s.head_dim)
        if self.q_norm is not None:
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        # Every new K/V of the step is written before any group reads: a group may read blocks
        # another sequence of the same step fills (prefix sharing within one step).
        if compiled is not None:
            compiled.rope_write_kv(qkv, s.num_heads, s.num_kv_heads, s.head_dim, cos, sin, step.positions,
                                   step.slot_mapping, cache)
        else:
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            cache.index_copy_(0, step.slot_mapping, torch.stack((k, v), dim=1))
        outs = [compiled.paged_decode(q[g.start:g.end], cache, g.block_tables, g.lengths, g.block_size, self.scale)
                if g.block_tables is not None else paged_attention(q[g.start:g.end], cache, g, self.scale)
                for g in step.groups]
        return self.linears.linear(outs[0] if len(outs) == 1 else torch.cat(outs), self.w_o, self.b_o, compiled)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, linears: Products) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        inter = spec.intermediate_size
        self.linears = linears
        self.w_gate_up = nn.Parameter(torch.empty(2 * inter, spec.hidden_size))  # [gate | up, hidden]
        self.b_gate_up = nn.Parameter(torch.zeros(2 * inter)) if spec.mlp_bias else None
        self.w_down = nn.Parameter(torch.empty(spec.hidden_size, inter))
        self.b_down = nn.Parameter(torch.zeros(spec.hidden_size)) if spec.mlp_bias else None
        self.act = ACT2FN[spec.hidden_act]
        self.silu = spec.hidden_act == "silu"

    def forward(self, x: torch.Tensor, compiled: CpuDecode | None) -> torch.Tensor:
        gate_up = self.linears.linear(x, self.w_gate_up, self.b_gate_up, compiled)  # [T, 2I]
        if compiled is not None and self.silu:
            hidden = compiled.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = self.act(gate) * up
        return self.linears.linear(hidden, self.w_down, self.b_down, compiled)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, linears: Products) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, linears)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec, linears)
        self._parameters_by_role: dict[str, torch.Tensor | None] | None = None

    def forward(self, x, delta, cos, sin, cache, step, compiled):
        """x: the residual stream before `delta` (the previous layer's MLP output, None for the first
        layer) is added: the add runs fused with this layer's first norm. Returns (stream, MLP output)."""
        x, h = self.input_layernorm.add_forward(x, delta, compiled)
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn(h, cos, sin, cache, step, compiled), compiled)
        return x, self.mlp(h, compiled)

    def compiled_tensors(self, cache: torch.Tensor, compiled: CpuDecode, on_panels: bool) -> cpu_decode.DecodeLayer:
        """This layer's tensors for the compiled whole-layer decode (`CpuDecode.decode_layers`): with its
        matrices' panels when the step's products run over them (`CpuDecode.on_panels`: above the rows kernel's
        MAX_ROWS, and below where this machine's race chose them), every tensor checked. The model keeps the
        result while no pointer in it changes (`CausalLM._compiled_layers`)."""
        if self._parameters_by_role is None:  # the Parameter objects stay; their storage may not
            attn, mlp = self.self_attn, self.mlp
            self._parameters_by_role = dict(
                input_norm=self.input_layernorm.weight, w_qkv=attn.w_qkv, b_qkv=attn.b_qkv, w_o=attn.w_o, b_o=attn.b_o,
                post_norm=self.post_attention_layernorm.weight, w_gate_up=mlp.w_gate_up, b_gate_up=mlp.b_gate_up,
                w_down=mlp.w_down, b_down=mlp.b_down)
        tensors = self._parameters_by_role
        panels = None
        if on_panels:
            copies = self.mlp.linears.panels
            panels = {name: copies.of(tensors[name], compiled) for name in cpu_decode.LAYER_MATRICES}
        return cpu_decode.layer_tensors(cache.dtype, cache, panels, **tensors)


class CausalLM(nn.Module):
    def __init__(self, config, spec: ModelSpec | None = None) -> None:
        super().__init__()
        self.spec = spec = spec or ModelSpec.from_hf_config(config)
        self.linears = Products()
        self.embed = nn.Parameter(torch.empty(spec.vocab_size, spec.hidden_size))  # [V, hidden]
        self.layers = nn.ModuleList(DecoderLayer(spec, self.linears) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = None if spec.tie_word_embeddings else nn.Parameter(torch.empty(spec.vocab_size, spec.hidden_size))
        self.rotary = Rotary(config, spec)
        self.use_compiled = True  # False: torch's operators only (the reference the tests compare with)
        self._layers_array: tuple[tuple, ctypes.Array] | None = None  # _compiled_layers' last
        self._decode_parameters: list[nn.Parameter] | None = None

    def compiled(self, dtype: torch.dtype, device: torch.device) -> CpuDecode | None:
        """The compiled decode loops when they serve this step: float32 or bfloat16 on a CPU that
        could build them."""
        if self.use_compiled and dtype in cpu_decode.DTYPES and device.type == "cpu":
            return cpu_decode.load()
        return None

    def forward(self, step: StepInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        """kv_cache: [layers, slots, 2, Hkv, D]. Returns float32 logits [N, V] for step.logit_rows."""
        x = self.embed.index_select(0, step.input_ids)  # [T, hidden]
        compiled = self.compiled(x.dtype, x.device)
        if compiled is not None:
            self.rotary.cover(step.max_position)
            cos, sin = self.rotary.cos, self.rotary.sin  # [P, D] tables
        else:
            cos, sin = self.rotary(step.positions, step.max_position, x.dtype)
            cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D]
        delta = None
        started = time.perf_counter()
        inputs = self._whole_layers(step, compiled, x, kv_cache.shape[1])
        if inputs is not None:  # one compiled call for every layer
            if step.every_token_samples:  # the logits come from the same call
                layers, head, scratch = self._compiled_call(inputs, compiled, x, kv_cache)
                logits = compiled.decode_layers(x, layers, inputs, scratch, head)
                self._observe_decode(step, compiled, x.dtype, time.perf_counter() - started, head=True)
                return logits
            layers, _, scratch = self._compiled_call(inputs, compiled, x, kv_cache, head=False)
            delta = compiled.decode_layers(x, layers, inputs, scratch)
        else:
            for layer, cache in zip(self.layers, kv_cache):
                x, delta = layer(x, delta, cos, sin, cache, step, compiled)
        if compiled is not None:
            self._observe_decode(step, compiled, x.dtype, time.perf_counter() - started)
        rows = step.logit_rows
        _, x = self.norm.add_forward(x.index_select(0, rows), None if delta is None else delta.index_select(0, rows),
                                     compiled)  # [N, hidden]
        return self.linears.linear(x, self._head(), None, compiled).float()  # [N, V]

    def bursts(self, rows: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether `decode_burst` runs a decode step of `rows` sequences here: the compiled whole-layer decode serves
        it (`_whole_layers`)."""
        return self._whole_layers_serve(self.compiled(dtype, device), rows, dtype)

    @torch.inference_mode()
    def decode_burst(self, step: StepInputs, kv_cache: torch.Tensor,
                     burst: DecodeBurst) -> tuple[list[int], list[float]]:
        """Up to burst.slots.shape[0] decode steps of the same sequences in one compiled call, from `step` (one-token
        decodes whose every token samples, `bursts` true for them): each step's tokens drawn from its logits over
        burst's draws, as the sampler's compiled draw does it, and fed to the next step, until a row draws one of
        its stops (cpu_decode's `decode_burst`). Returns the tokens and log-probs of the steps run, step by step, in
        step's row order."""
        x = self.embed.index_select(0, step.input_ids)  # [T, hidden]
        compiled = self.compiled(x.dtype, x.device)
        steps = burst.slots.shape[0]
        if compiled is not None:
            self.rotary.cover(step.max_position + steps - 1)
        started = time.perf_counter()
        inputs = self._whole_layers(step, compiled, x, kv_cache.shape[1])
        if inputs is None or not step.every_token_samples:
            raise ValueError("decode_burst: the compiled whole-layer decode does not serve this step (see `bursts`)")
        layers, head, scratch = self._compiled_call(inputs, compiled, x, kv_cache)
        tokens, logps = compiled.decode_burst(x, layers, inputs, scratch, head, self.embed, burst.temperatures,
                                              burst.slots, burst.draws, burst.stops)
        steps_run = len(tokens) // len(step.input_ids)
        self._observe_decode(step, compiled, x.dtype, (time.perf_counter() - started) / steps_run, head=True)
        return tokens, logps

    def _compiled_call(self, inputs: cpu_decode.DecodeStep, compiled: CpuDecode, x: torch.Tensor,
                       kv_cache: torch.Tensor, head: bool = True) -> tuple[ctypes.Array, cpu_decode.DecodeHead | None,
                                                                           torch.Tensor]:
        """The layers, the head (with head: the final norm and LM head, for a step whose every token samples) and
        the scratch of a compiled whole-layer decode call."""
        on_panels = compiled.on_panels(x.shape[0], x.dtype)  # the same for every layer of the step
        layers = self._compiled_layers(kv_cache, compiled, on_panels)
        tensors = None
        if head:
            tensors = cpu_decode.head_tensors(x.dtype, self.norm.weight, self._head(),
                                              self.linears.panels.of(self._head(), compiled) if on_panels else None)
        scratch = torch.empty(cpu_decode.decode_scratch_values(inputs, tensors, x.dtype), dtype=x.dtype)
        return layers, tensors, scratch

    def _compiled_layers(self, kv_cache: torch.Tensor, compiled: CpuDecode, on_panels: bool) -> ctypes.Array:
        """Every layer's tensors (`DecoderLayer.compiled_tensors`) as the array `decode_layers` takes, kept while no
        pointer in it can have changed: the cache's, every parameter's, and the panel copies' (whose generation
        moves with each one made or dropped). From one decode step to the next none does; building and checking
        every layer's tensors each step cost 2-3 ms of a 35 ms step at batch 1."""
        if self._decode_parameters is None:  # the Parameter objects stay; their storage may not
            self._decode_parameters = [p for layer in self.layers for p in layer.parameters()]
        key = lambda: (kv_cache.data_ptr(), tuple(kv_cache.shape), on_panels, self.linears.panels.generation,  # noqa: E731
                       *[p.data_ptr() for p in self._decode_parameters])
        if self._layers_array is None or self._layers_array[0] != key():
            layers = [layer.compiled_tensors(cache, compiled, on_panels) for layer, cache in zip(self.layers, kv_cache)]
            self._layers_array = (key(), (cpu_decode.DecodeLayer * len(layers))(*layers))  # after any panels made
        return self._layers_array[1]

    def _whole_layers(self, step: StepInputs, compiled: CpuDecode | None, x: torch.Tensor,
                      slots: int) -> cpu_decode.DecodeStep | None:  # slots: the KV cache's per layer
        """The step's inputs for the compiled whole-layer decode, when it serves this step:
        only one-token decodes, as many as the loops take at their won row counts, a plain
        SiLU-gated Llama/Qwen2 layer (Qwen3's q/k norms run through the per-operation path), and no
        bench collecting the per-kind split (which the per-operation path times)."""
        s = self.spec
        tokens = x.shape[0]
        if (not self._whole_layers_serve(compiled, tokens, x.dtype) or len(step.groups) != 1
                or step.groups[0].block_tables is None):
            return None
        group = step.groups[0]
        cpu_decode.check_tensors(torch.int64, positions=step.positions, slots=step.slot_mapping,
                                 tables=group.block_tables, lengths=group.lengths)
        cpu_decode.check_tensors(torch.float32, cos=self.rotary.cos, sin=self.rotary.sin)
        inputs = cpu_decode.DecodeStep(
            tokens=tokens, hidden=s.hidden_size, heads=s.num_heads, kv_heads=s.num_kv_heads, head_dim=s.head_dim,
            intermediate=s.intermediate_size, width=group.block_tables.shape[1], block_size=group.block_size,
            num_slots=slots, num_positions=self.rotary.cos.shape[0], cos=self.rotary.cos.data_ptr(), sin=self.rotary.sin.data_ptr(), positions=step.positions.data_ptr(),
            slots=step.slot_mapping.data_ptr(), tables=group.block_tables.data_ptr(), lengths=group.lengths.data_ptr(),
            eps=s.rms_norm_eps, scale=self.layers[0].self_attn.scale, threads=torch.get_num_threads())
        return inputs

    def _whole_layers_serve(self, compiled: CpuDecode | None, rows: int, dtype: torch.dtype) -> bool:
        return (compiled is not None and compiled.seconds is None and not self.spec.qk_norm
                and self.layers[0].mlp.silu and compiled.takes(rows, dtype))

    def _observe_decode(self, step: StepInputs, compiled: CpuDecode, dtype: torch.dtype, seconds: float,
                        head: bool = False) -> None:
        """Hands a step of one-token decodes' time over its layers (and the LM head, when the same call ran it) to
        the check of the rows verdict it ran by (`CpuDecode.observe_decode`), with the bytes they streamed: their
        weights, each sequence's K/V."""
        if not compiled.observation_due():  # first: after the step's stream every object this reads is cold
            return
        group = step.groups[0] if len(step.groups) == 1 else None
        if group is None or group.lengths is None or group.batch > cpu_decode.MAX_ROWS:
            return
        s = self.spec
        weight_bytes = (s.num_layers * s.layer_matrix_elements + head * s.vocab_size * s.hidden_size) * dtype.itemsize
        compiled.observe_decode(dtype, group.batch, seconds, weight_bytes,
                                lambda: group.context_tokens * 2 * s.kv_size * dtype.itemsize * s.num_layers)

    def _head(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head

    def repack(self) -> None:
        """Refresh the packed matmul weights: call after writing into `hf_weights()` in place.
        Only the matrices products use: an untied embedding is only looked up, never packed."""
        products = [p for layer in self.layers for p in layer.parameters() if p.dim() == 2] + [self._head()]
        self.linears.panels.clear()
        compiled = self.compiled(products[0].dtype, products[0].device)
        if compiled is not None and compiled.takes_every_count(products[0].dtype):
            self.linears.packed.clear()  # no product runs on them here: none is made (nor its memory)
        else:
            self.linears.packed.repack(products)

    # ------------------------------------------------------------ HF names
    def hf_weights(self) -> dict[str, torch.Tensor]:
        """Every weight under its Hugging Face name and [out, in] shape: views of the storage the
        model computes with (for q/k/v and gate/up, row slices of a fused matrix)."""
        s = self.spec
        out = {"model.embed_tokens.weight": self.embed.data, "model.norm.weight": self.norm.weight.data}
        if self.lm_head is not None:
            out["lm_head.weight"] = self.lm_head.data
        q, kv, inter = s.q_size, s.kv_size, s.intermediate_size
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            out[p + "input_layernorm.weight"] = layer.input_layernorm.weight.data
            out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight.data
            for name, cols in (("q_proj", slice(0, q)), ("k_proj", slice(q, q + kv)), ("v_proj", slice(q + kv, q + 2 * kv))):
                out[p + f"self_attn.{name}.weight"] = attn.w_qkv.data[cols]
                if attn.b_qkv is not None:
                    out[p + f"self_attn.{name}.bias"] = attn.b_qkv.data[cols]
            out[p + "self_attn.o_proj.weight"] = attn.w_o.data
            if attn.b_o is not None:
                out[p + "self_attn.o_proj.bias"] = attn.b_o.data
            if attn.q_norm is not None:
                out[p + "self_attn.q_norm.weight"] = attn.q_norm.weight.data
                out[p + "self_attn.k_norm.weight"] = attn.k_norm.weight.data
            for name, cols in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
                out[p + f"mlp.{name}.weight"] = mlp.w_gate_up.data[cols]
                if mlp.b_gate_up is not None:
                    out[p + f"mlp.{name}.bias"] = mlp.b_gate_up.data[cols]
            out[p + "mlp.down_proj.weight"] = mlp.w_down.data
            if mlp.b_down is not None:
                out[p + "mlp.down_proj.bias"] = mlp.b_down.data
        return out

    @torch.no_grad()
    def load_hf_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> None:
        """Copy HF-named tensors in place. With strict, every weight must be given exactly once."""
        targets = self.hf_weights()
        seen: set[str] = set()
        for name, tensor in named_tensors:
            if name not in targets:
                if _ignorable(name, self.spec):
                    continue
                raise KeyError(f"weight {name!r} has no place in the native {self.spec.family} model")
            if name in seen:
                raise KeyError(f"weight {name!r} given twice")
            target = targets[name]
            if tensor.shape != target.shape:
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            copy_rows(target, 0, tensor)
            seen.add(name)
        missing = targets.keys() - seen
        if strict and missing:
            raise KeyError(f"{len(missing)} weights missing, e.g. {sorted(missing)[:3]}")
        self.linears.clear()  # packed again by `repack` (the engine's version setter) or on first use


def _ignorable(name: str, spec: ModelSpec) -> bool:
    """Checkpoint entries that are not weights of this model: tied heads, cached RoPE buffers."""
    return (name == "lm_head.weight" and spec.tie_word_embeddings) or name.endswith("rotary_emb.inv_freq")


def read_hf_folder(folder) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from an HF folder's safetensors (single or sharded) or pytorch .bin files."""
    from pathlib import Path

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                names = list(handle.keys())
            for name in names:  # reopened per tensor: only one tensor's pages of the mapping are resident
                with safe_open(str(file), framework="pt") as handle:
                    yield name, handle.get_tensor(name)
        return
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"{folder}: no *.safetensors or pytorch_model*.bin weights")
    for file in bins:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()
