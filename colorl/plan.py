"""`colorl plan`: the memory one device needs for a run, per phase, before anything starts.

Per device (one rank, `launch.nproc` ranks), in bytes:
- trainer weights, gradients and AdamW state (exp_avg, exp_avg_sq), FSDP2-sharded over the ranks;
  gradients and optimizer state only for the trainable parameters (LoRA: the adapters);
- FSDP2's unsharded layer during forward/backward: the current and the prefetched decoder
  layer in the compute dtype, plus one layer's gradient in float32 for the reduce-scatter;
- activations kept for backward for one micro-batch at the longest sequence (longest prompt +
  `rollout.max_new_tokens`), per token (b = compute dtype bytes):
      per layer  2·norm + 5b·hidden + mlp   (attention: rotated q, GQA-expanded k and v, output,
                 the varlen concat)
      norm       b·hidden + 4 (colorl's lean RMSNorm keeps its input and a float32 1/rms);
                 8·hidden, + 2b·hidden below float32, for a norm transformers' way (its input and a
                 float32 normalised copy; in bf16 also the float32 cast and the cast back)
      mlp        2b·intermediate (the lean SwiGLU keeps gate and up; 3b· when LoRA wraps the down
                 projection, which keeps the product); 4b· transformers' way (also act(gate) and
                 act(gate)·up)
      LoRA       below float32 compute, 4·in_features per adapted module (peft casts each
                 module's input to the adapters' float32 and keeps that copy)
      once       norm + 2b·hidden + 12 (embedding output, final norm, the hidden states the head
                 picks, three float32 per-token results), + 3b·intermediate with the lean MLP
                 (its backward, at the top layer, holds three [T, intermediate] rows at once)
  with `train.activation_checkpointing` each layer keeps only its input (b·hidden) and backward
  recomputes one layer at a time: layers·b·hidden + one layer's part (its LoRA casts included) + once;
  plus the LM head's logits for `train.logits_chunk_tokens` rows at a time, (b + 16)·vocab each
  (logits, their float32 copy at the temperature, the entropy's softmax and product);
  Checked against a measured CPU training step (tests/test_plan.py): per-layer slope within 1%,
  total within 10%;
- the engine: full weights (tensor-parallel size 1) and the KV pool. The native engine sizes its
  pool so that everything resident when it starts plus the pool is `engine.memory_fraction` of the
  device: KV = f·M − trainer weights − engine weights (never more than its sequences can fill, or
  `engine.num_blocks` when set). SGLang 0.5.23 keeps (1 − f) of the memory free before it loads
  and takes the rest after loading: KV = f·(M − trainer weights − context) − engine weights.
  vLLM 0.32 takes f of the whole device, which must all be free when it starts, and its pool is
  what its weights leave of it: KV = f·M − engine weights (v1/worker/utils.py `request_memory`,
  gpu_worker.py `determine_available_memory`); on CPU its pool is `engine.num_blocks` MiB, else
  1 GiB. colorl keeps a checkpoint-format copy of the engine's weights next to it (vLLM reloads
  from it: colorl/engines/vllm.py), resident in every phase;
- with LoRA the checkpoint engine's copies of the adapted base weights (W0), and two sync
  buckets of `sync.bucket_mb` while weights travel;
- on CUDA a reserve for the context, NCCL and allocator slack (and SGLang's scheduler process).
On CPU the "device" is this host's available memory shared by the ranks.

Phases (colocated mode; bounded-lag keeps the engine awake while training):
    rollout  weights + optimizer (unless offloaded) + engine static pool
    train    weights + gradients + optimizer + activations + unsharded layers + engine weights
             (sleep level 1; released at level 2) [+ KV cache in bounded-lag mode]
    sync     weights + optimizer (unless offloaded) + engine weights + buckets
The run fits when the largest phase fits the device; when it does not, the plan names the fewest
knobs that make it fit (one, else two or three set together), if any do.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from colorl import precision
from colorl.config import micro_batch_tokens
from colorl.engines.vllm import CPU_KV_BYTES_PER_BLOCK as VLLM_CPU_KV_BYTES_PER_BLOCK
from colorl.engines.vllm import CPU_KV_DEFAULT_BYTES as VLLM_CPU_KV_DEFAULT_BYTES
from colorl.exits import fail
from colorl.machine import resolve_device

GiB = 2**30
RESERVE_BYTES = 1 * GiB  # CUDA context, NCCL buffers, allocator fragmentation
SGLANG_RESERVE_BYTES = 1 * GiB  # SGLang's scheduler process: its own context and CUDA graphs
ASSUMED_GPU_BYTES = 80 * GiB
ASSUMED_PROMPT_TOKENS = 256
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
UNITS = {"": GiB, "b": 1, "kib": 2**10, "mib": 2**20, "gib": GiB, "tib": 2**40}
# "80GB" is how a card is sold, not what torch reports: an 80 GB H100 reports 79.1-79.2 GiB of
# total memory (the driver keeps the rest), so N GB counts as N GiB less 1.1%
CARD_GB_REPORTED = 0.989 * GiB


class PlanError(ValueError):
    """Bad input for a plan; one line for the terminal."""


@dataclass(frozen=True)
class Architecture:
    """What the arithmetic needs from a model config, counted on the `meta` device."""

    params: int
    layer_params: int  # one decoder layer
    lora_params: int  # adapters for the configured targets (0 without LoRA)
    adapted_params: int  # base weights the adapters modify (W0 copies)
    lora_inputs: int  # in_features summed over the adapted modules (peft casts each input to fp32)
    layers: int
    hidden: int
    intermediate: int
    kv_dim: int  # num_key_value_heads · head_dim
    vocab: int
    max_positions: int
    lean_norms: bool = False  # the trainer's RMSNorms keep their input and 1/rms only (train/lean_layers.py)
    lean_mlps: bool = False  # its SiLU-gated MLPs keep gate and up only
    lora_down: bool = False  # LoRA wraps the down projection: it keeps the gated product as well

    @classmethod
    def from_hf_config(cls, hf_config, lora_targets: list[str] | None = None, lora_r: int = 0) -> "Architecture":
        from colorl.models import meta_model
        from colorl.train.fsdp import decoder_layers
        from colorl.train.lean_layers import lean_modules

        model = meta_model(hf_config)
        norms, mlps = lean_modules(model)
        lora = adapted = inputs = 0
        for name, module in model.named_modules():
            if lora_targets and isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in lora_targets:
                lora += lora_r * (module.in_features + module.out_features)
                adapted += module.weight.numel()
                inputs += module.in_features
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        return cls(
            params=sum(p.numel() for p in model.parameters()),
            layer_params=sum(p.numel() for p in decoder_layers(model)[0].parameters()),
            lora_params=lora, adapted_params=adapted, lora_inputs=inputs, layers=hf_config.num_hidden_layers,
            hidden=hf_config.hidden_size, intermediate=hf_config.intermediate_size,
            kv_dim=kv_heads * head_dim, vocab=hf_config.vocab_size,
            max_positions=hf_config.max_position_embeddings,
            lean_norms=bool(norms), lean_mlps=bool(mlps), lora_down="down_proj" in (lora_targets or ()),
        )

    def activation_bytes_per_token(self, b: int, lora: bool = False, checkpointed: bool = False) -> int:
        """Kept for backward per token of a micro-batch, LM head's chunked logits apart.
        checkpointed: per-layer activation checkpointing (train.activation_checkpointing)."""
        if self.lean_norms:  # the input and a float32 1/rms per token
            norm = b * self.hidden + 4
        else:
            norm = (8 + (2 * b if b < 4 else 0)) * self.hidden
        if self.lean_mlps:  # gate and up; a LoRA-wrapped down projection keeps the product too
            mlp = (3 if lora and self.lora_down else 2) * b * self.intermediate
        else:
            mlp = 4 * b * self.intermediate
        # + b * hidden: the packed (varlen) attention concatenates its per-sequence outputs
        per_layer = 2 * norm + 5 * b * self.hidden + mlp
        # peft's lora.Linear.forward casts its input to the adapters' float32 (`_cast_input_dtype`)
        # and lora_A keeps that copy for backward: one per adapted module, below float32 compute
        lora_casts = 4 * self.lora_inputs if lora and b < 4 else 0
        if checkpointed:  # every layer's input, and the one layer backward is recomputing
            layers = self.layers * b * self.hidden + per_layer + lora_casts // self.layers
        else:
            layers = self.layers * per_layer + lora_casts
        # once: the final norm, the embedding output, the hidden states the head picks, and its
        # float32 log-prob, entropy and log-normaliser; the top layer's lean MLP backward holds
        # three [T, intermediate] rows at once (silu(gate) rebuilt, the product's gradient, up's)
        backward = 3 * b * self.intermediate if self.lean_mlps else 0
        return layers + norm + 2 * b * self.hidden + 12 + backward

    def activation_bytes(self, tokens: int, b: int, chunk: int, lora: bool = False, checkpointed: bool = False) -> int:
        """A micro-batch of `tokens`: the per-token part, and the LM head's logits, which exist
        for `chunk` rows at a time (colorl/train/head.py): logits, their float32 copy at the
        temperature, and the entropy's softmax and product, alive together."""
        return (tokens * self.activation_bytes_per_token(b, lora, checkpointed)
                + min(tokens, chunk) * (b + 16) * self.vocab)

    def kv_bytes_per_token(self, b: int) -> int:
        return 2 * self.layers * self.kv_dim * b


@dataclass(frozen=True)
class Line:
    name: str
    bytes: int
    note: str = ""


@dataclass(frozen=True)
class Phase:
    name: str
    parts: tuple[str, ...]  # names of the lines alive in this phase


@dataclass
class MemoryPlan:
    device_bytes: int
    lines: dict[str, Line]
    phases: list[Phase]
    kv_tokens: int
    kv_tokens_wanted: int
    notes: list[str]
    advice: str = ""

    def phase_bytes(self, phase: Phase) -> int:
        return sum(self.lines[name].bytes for name in phase.parts)

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=self.phase_bytes)

    @property
    def fits(self) -> bool:
        return self.kv_tokens > 0 and self.phase_bytes(self.peak) <= self.device_bytes

    def verdict(self) -> str:
        peak = self.peak
        if self.kv_tokens <= 0:
            head = (f"does not fit: engine.memory_fraction leaves no KV cache "
                    f"({_gib(self.lines['engine KV cache'].bytes)} after the weights resident at engine start)")
        elif self.fits:
            return (f"fits: the {peak.name} phase needs {_gib(self.phase_bytes(peak))} of "
                    f"{_gib(self.device_bytes)} per device")
        else:
            head = (f"does not fit: the {peak.name} phase needs {_gib(self.phase_bytes(peak))} of "
                    f"{_gib(self.device_bytes)} per device")
        return f"{head}; {self.advice}" if self.advice else head

    def render(self) -> str:
        width = max(len(name) for name in self.lines)
        rows = [f"memory per device ({_gib(self.device_bytes)}):"]
        for line in self.lines.values():
            if line.bytes == 0:
                continue
            rows.append(f"  {line.name:<{width}}  {_gib(line.bytes):>10}  {line.note}".rstrip())
        rows.append("phases:")
        for phase in self.phases:
            rows.append(f"  {phase.name:<8} {_gib(self.phase_bytes(phase)):>10}")
        rows += [f"note: {note}" for note in self.notes]
        rows.append(self.verdict())
        return "\n".join(rows)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def plan_memory(cfg, arch: Architecture, device_bytes: int, prompt_tokens: int) -> MemoryPlan:
    """The arithmetic of the module docstring for one config; no advice (see `plan_with_advice`)."""
    world = cfg.launch.nproc
    w = DTYPE_BYTES[cfg.model.dtype]
    device = device_type(cfg)
    on_cpu = device == "cpu"
    chosen = precision.choose(cfg, device)
    b = DTYPE_BYTES[chosen.compute] if chosen.compute else w
    from colorl.train.fsdp import gathers_once

    gathered_once = gathers_once(device, chosen.compute)
    lora = cfg.model.lora is not None
    trainable = arch.lora_params if lora else arch.params
    a = 4 if lora else w  # peft keeps adapters in float32 over a 16-bit base
    trainer_params = arch.params + arch.lora_params
    seq = prompt_tokens + cfg.rollout.max_new_tokens
    per_rank_concurrency = min(cfg.engine.max_num_seqs, -(-cfg.rollout.concurrency // world))
    weights = -(-(arch.params * w + arch.lora_params * 4) // world)
    reference = weights if cfg.loss.kl_coef > 0 and not lora else 0
    e = DTYPE_BYTES[chosen.served or cfg.model.dtype]  # what the engine serves (and keeps W0 in)
    engine_weights = arch.params * e
    if cfg.engine.num_blocks and cfg.rollout.engine == "native":
        kv = cfg.engine.num_blocks * cfg.engine.block_size * arch.kv_bytes_per_token(e)
        kv_note = f"engine.num_blocks={cfg.engine.num_blocks}"
    elif cfg.rollout.engine == "vllm" and on_cpu:
        kv = (cfg.engine.num_blocks * VLLM_CPU_KV_BYTES_PER_BLOCK if cfg.engine.num_blocks
              else VLLM_CPU_KV_DEFAULT_BYTES)
        kv_note = "vLLM on CPU: engine.num_blocks MiB, else 1 GiB"
    elif cfg.rollout.engine == "vllm":
        kv = int(cfg.engine.memory_fraction * device_bytes) - engine_weights
        kv_note = f"engine.memory_fraction={cfg.engine.memory_fraction} of the device (vLLM's budget), less its weights"
    elif cfg.rollout.engine == "sglang":
        # SGLang 0.5.23 (model_runner_components/kv_pool_runtime.py): the pool is what is free after
        # it loads its weights, less (1 - f) of what was free before: f·(M − resident) − weights
        resident = weights + reference + RESERVE_BYTES
        kv = int(cfg.engine.memory_fraction * (device_bytes - resident)) - engine_weights
        kv_note = (f"engine.memory_fraction={cfg.engine.memory_fraction} of the memory free when SGLang starts, "
                   f"less its weights")
    else:
        kv = int(cfg.engine.memory_fraction * device_bytes) - weights - reference - engine_weights
        kv_note = f"engine.memory_fraction={cfg.engine.memory_fraction} of the device, less the weights"
    if cfg.rollout.engine == "native":  # the native engine never allocates more than its sequences can use
        cap = per_rank_concurrency * arch.max_positions * arch.kv_bytes_per_token(e)
        kv = min(kv, cap) if kv > 0 else kv
    kv_tokens = kv // arch.kv_bytes_per_token(e)
    reserve = 0 if on_cpu else RESERVE_BYTES + (SGLANG_RESERVE_BYTES if cfg.rollout.engine == "sglang" else 0)
    offload = cfg.train.offload_optimizer
    budget = micro_batch_tokens(cfg.train, device)
    micro_tokens = max(budget, seq)  # a micro-batch packs whole sequences
    lines = [
        Line("trainer weights", weights, f"{_count(trainer_params)} params x {w} B / {world} ranks"),
        Line("reference model", reference, "loss.kl_coef > 0" if reference else ""),
        Line("gradients", -(-trainable * a // world), f"{_count(trainable)} trainable x {a} B / {world} ranks"),
        Line("optimizer state", -(-2 * trainable * a // world),
             "AdamW, 2 states; on the host between train phases" if offload else "AdamW, 2 states"),
        Line("activations", arch.activation_bytes(micro_tokens, b, cfg.train.logits_chunk_tokens, lora,
                                                  cfg.train.activation_checkpointing),
             f"train.max_tokens_per_micro_batch={budget}"
             + (" (null: this device's default)" if cfg.train.max_tokens_per_micro_batch is None else "")
             + f" (at least one {seq}-token sequence): {micro_tokens} packed tokens"
             + (", layers checkpointed" if cfg.train.activation_checkpointing else "")),
        Line("unsharded layers", (arch.params * b if gathered_once else arch.layer_params * 2 * b)
             + (arch.lora_params // arch.layers if lora else arch.layer_params) * 4,
             "FSDP2: every layer in the compute dtype, gathered once a step (CPU, mixed precision), fp32 grad"
             if gathered_once else "FSDP2: current + prefetched layer, fp32 grad"),
        Line("engine weights", engine_weights, "tensor-parallel size 1"),
        Line("engine KV cache", kv, f"{kv_note}: {max(kv_tokens, 0):,} tokens"),
        Line("LoRA W0 copies", arch.adapted_params * e if lora else 0, "checkpoint engine, for merging"),
        Line("engine staging copy", engine_weights if cfg.rollout.engine == "vllm" else 0,
             "colorl's copy vLLM reloads from" if cfg.rollout.engine == "vllm" else ""),
        Line("sync buckets", int(2 * cfg.sync.bucket_mb * 2**20) if world > 1 else 0, "two of sync.bucket_mb"),
        Line("reserve", reserve, "CUDA context, NCCL, allocator" + (", SGLang's process" if reserve > RESERVE_BYTES else "")),
    ]
    always = ("trainer weights", "reference model", "LoRA W0 copies", "engine staging copy", "reserve")
    optimizer = () if offload else ("optimizer state",)
    train = always + ("gradients", "optimizer state", "activations", "unsharded layers")
    if cfg.mode == "bounded_lag":
        train += ("engine weights", "engine KV cache")
    elif cfg.sleep_level == 1:
        train += ("engine weights",)
    phases = [Phase("rollout", always + optimizer + ("engine weights", "engine KV cache")),
              Phase("train", train),
              Phase("sync", always + optimizer + ("engine weights", "sync buckets"))]
    wanted = per_rank_concurrency * seq
    notes = []
    if 0 < kv_tokens < wanted:
        notes.append(f"the KV cache holds {kv_tokens:,} tokens but {per_rank_concurrency} sequences of up to {seq} "
                     f"want {wanted:,}: the engine will queue or preempt (raise engine.memory_fraction or lower "
                     f"rollout.concurrency)")
    notes.append(f"longest sequence: {prompt_tokens} prompt + {cfg.rollout.max_new_tokens} new tokens")
    return MemoryPlan(device_bytes, {line.name: line for line in lines}, phases, kv_tokens, wanted, notes)


def _with(cfg, section: str, **values):
    return cfg.model_copy(update={section: getattr(cfg, section).model_copy(update=values)})


def _nproc(cfg, nproc: int):
    groups = cfg.rollout.batch_groups if cfg.rollout.batch_groups % nproc == 0 else nproc
    return _with(_with(cfg, "launch", nproc=nproc), "rollout", batch_groups=groups)


def knobs(cfg) -> list[list[tuple[str, Callable]]]:
    """The changes that lower the peak, one list per knob, most specific first: (description, a
    function that applies it to a config). Activation checkpointing comes first: where
    activations are what does not fit, it frees the most for the least (one more forward per
    step) without changing the batch."""
    families = []
    if not cfg.train.activation_checkpointing:
        families.append([("train.activation_checkpointing=true",
                          lambda c: _with(c, "train", activation_checkpointing=True))])
    budgets, budget = [], micro_batch_tokens(cfg.train, device_type(cfg))
    while budget > 256:
        budget //= 2
        budgets.append((f"train.max_tokens_per_micro_batch={budget}",
                        lambda c, b=budget: _with(c, "train", max_tokens_per_micro_batch=b)))
    families.append(budgets)
    if not cfg.train.offload_optimizer:
        families.append([("train.offload_optimizer=true", lambda c: _with(c, "train", offload_optimizer=True))])
    if cfg.sleep_level == 1 and cfg.mode == "colocated":
        families.append([("engine.sleep_level=2", lambda c: _with(c, "engine", sleep_level=2))])
    families.append([(f"engine.memory_fraction={f}", lambda c, f=f: _with(c, "engine", memory_fraction=f))
                     for f in (0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2) if f != cfg.engine.memory_fraction])
    sizes, nproc = [], cfg.launch.nproc
    while nproc < 64:
        nproc *= 2
        moved = _nproc(cfg, nproc).rollout.batch_groups != cfg.rollout.batch_groups
        sizes.append((f"launch.nproc={nproc}" + (f" with rollout.batch_groups={nproc}" if moved else ""),
                      lambda c, n=nproc: _nproc(c, n)))
    families.append(sizes)
    return [family for family in families if family]


def plan_with_advice(cfg, arch: Architecture, device_bytes: int, prompt_tokens: int) -> MemoryPlan:
    """The plan; when it does not fit, the advice names the fewest knobs that make it fit (one if
    one does, else the first pair, else the first three, in `knobs` order)."""
    plan = plan_memory(cfg, arch, device_bytes, prompt_tokens)
    if plan.fits:
        return plan
    families = knobs(cfg)
    for count in range(1, min(3, len(families)) + 1):
        for chosen in itertools.combinations(families, count):
            for changes in itertools.product(*chosen):
                changed = cfg
                for _, apply in changes:
                    changed = apply(changed)
                other = plan_memory(changed, arch, device_bytes, prompt_tokens)
                if other.fits:
                    names = " and ".join(description for description, _ in changes)
                    together = " together" if count > 1 else ""
                    plan.advice = (f"set {names}{together} (then the {other.peak.name} phase needs "
                                   f"{_gib(other.phase_bytes(other.peak))})")
                    return plan
    instead = "use LoRA (model.lora) or a larger device" if cfg.model.lora is None else "use a larger device"
    plan.advice = f"no combination of up to three knobs makes it fit: {instead}"
    return plan


# -- inputs ----------------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """Bytes of one device: exact in B/KiB/MiB/GiB/TiB (a bare number is GiB); in GB, the total
    memory torch reports for a card sold as that many GB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or (unit not in UNITS and unit != "gb"):
        raise PlanError(f"--gpu-memory {text!r}: expected a card's size such as 80GB, or an exact one such as 79.2GiB")
    return int(float(match.group(1)) * (CARD_GB_REPORTED if unit == "gb" else UNITS[unit]))


def device_type(cfg) -> str:
    """"cpu" or "cuda": where launch.device would put the ranks on this machine."""
    return resolve_device(cfg.launch.device)


def device_memory(cfg, requested: str | None) -> tuple[int, str]:
    """Bytes per device, and where the figure comes from."""
    if requested is not None:
        return parse_size(requested), "--gpu-memory"
    if device_type(cfg) == "cpu":
        from colorl.engines.native.model_runner import _host_available_bytes

        return _host_available_bytes() // cfg.launch.nproc, "available host memory / launch.nproc"
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, f"{torch.cuda.get_device_name(0)}"
    return ASSUMED_GPU_BYTES, "assumed (no CUDA device here; pass --gpu-memory)"


def longest_prompt(cfg, tokenizer, samples: int = 64) -> int:
    from colorl.tasks.chat import problem_ids
    from colorl.tasks import build_task

    task = build_task(cfg.task, cfg.run.seed)
    return max(len(problem_ids(tokenizer, task.train_problem(i), cfg.model.system_prompt))
               for i in range(samples))


def architecture_for(cfg, model_config: str | None):
    """(Architecture, model folder or None). `model_config`: a config.json to use instead of model.path."""
    from transformers import AutoConfig

    from colorl.models import ModelNotFound, resolve_model_path

    folder = None
    if model_config is not None:
        hf_config = _read_model_config(model_config, "--model-config")
    else:
        try:
            folder = resolve_model_path(cfg.model.path)
        except ModelNotFound as exc:
            if cfg.model.architecture is None:
                raise PlanError(f"{exc} (or pass --model-config with the model's config.json, "
                                f"or set model.architecture)") from None
            hf_config = _read_model_config(cfg.model.architecture, "model.architecture")
        else:
            hf_config = AutoConfig.from_pretrained(folder)
    lora = cfg.model.lora
    arch = Architecture.from_hf_config(hf_config, lora.targets if lora else None, lora.r if lora else 0)
    return arch, folder


def _read_model_config(path: str, key: str):
    from transformers import AutoConfig

    if not Path(path).is_file():
        raise PlanError(f"{key} {path!r}: file not found")
    return AutoConfig.from_pretrained(Path(path))


def plan_for_run(cfg, model_dir: Path, device_bytes: int) -> MemoryPlan:
    """The check `colorl train` runs on CUDA before launching."""
    from transformers import AutoConfig

    from colorl.models import load_tokenizer

    lora = cfg.model.lora
    arch = Architecture.from_hf_config(AutoConfig.from_pretrained(model_dir), lora.targets if lora else None,
                                       lora.r if lora else 0)
    return plan_with_advice(cfg, arch, device_bytes, longest_prompt(cfg, load_tokenizer(model_dir)))


# -- command ---------------------------------------------------------------------------------------

def cmd_plan(args) -> int:
    from colorl.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, list(args.set or []))
        memory, source = device_memory(cfg, args.gpu_memory)
        arch, folder = architecture_for(cfg, args.model_config)
        if args.prompt_tokens is not None:
            prompt, prompt_source = args.prompt_tokens, "--prompt-tokens"
        elif folder is not None:
            from colorl.models import load_tokenizer

            prompt, prompt_source = longest_prompt(cfg, load_tokenizer(folder)), "longest of 64 task prompts"
        else:
            prompt, prompt_source = ASSUMED_PROMPT_TOKENS, "assumed (no tokenizer here; --prompt-tokens to change)"
    except (ConfigError, PlanError, ValueError) as exc:
        return fail(str(exc))
    plan = plan_with_advice(cfg, arch, memory, prompt)
    print(f"# {args.config}: {cfg.launch.nproc} x {cfg.launch.device}, {cfg.mode}, engine {cfg.rollout.engine}")
    print(f"# device memory: {source}; prompt length: {prompt_source}")
    engine_note = engine_check_note(cfg)
    if engine_note:
        print(f"# {engine_note}")
    print(plan.render())
    return 0 if plan.fits else 1


def engine_check_note(cfg) -> str | None:
    """For --dry-run and plan: a config naming SGLang validates anywhere, the engine only where it runs."""
    if cfg.rollout.engine != "sglang":
        return None
    from colorl.engines.sglang import unavailable_reason

    reason = unavailable_reason()
    return f"the SGLang engine itself could not be checked on this machine: {reason}" if reason else None


def add_plan_parser(sub) -> None:
    parser = sub.add_parser("plan", help="memory per device before launch, and whether the run fits")
    parser.add_argument("config")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    parser.add_argument("--gpu-memory", metavar="SIZE", help="memory of one device: a card's size as sold (80GB: "
                                                             "what torch reports for it) or an exact one (79.2GiB); "
                                                             "default: this GPU")
    parser.add_argument("--model-config", metavar="CONFIG_JSON", help="the model's config.json, when model.path "
                                                                      "is not available on this machine")
    parser.add_argument("--prompt-tokens", type=int, metavar="N", help="longest prompt (default: measured)")
    parser.set_defaults(func=cmd_plan)

