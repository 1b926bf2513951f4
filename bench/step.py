"""One colocated GRPO step, phase by phase, before/after packing (issue 13), and TRL at equal work.

Workloads (SmolLM2-135M-Instruct, fp32, 8 prompts x 4 samples, T = 1, one rank):
- two_digit: "What is a + b? Put the final answer after ####.", two-digit operands, <= 64 new tokens.
- long_tail: the same prompts, lengths from `rollout.length_override {mean: 64, tailness: 90, cap: 512}`.

`before` is the padded trainer at --before (default 8c04575, the commit issue 13 started from),
checked out into a temporary git worktree; `after` is this tree. Each run is its own process
(PYTHONPATH picks the tree), driving the real phases (rollout, train, sync) of `colorl.modes`
for --steps steps; the first step is warm-up, the rest are reported. Runs are interleaved
(before, after, before, after ...) because the machine is shared: quote the ratios.

Per phase: seconds, peak resident memory (VmHWM, reset at each phase start), and for training
train tokens/s (prompt + response tokens of the batch) and FLOP utilisation: the FLOPs the loss
needs (6 x non-embedding params per token, causal attention, LM head at response tokens only)
over the phase time, against the fp32 matmul rate measured in the same process.

With --engines native,vllm the runs are this tree's with each rollout engine instead of before/after
(start it with a Python that has every engine: vLLM's CPU build is in .venv-vllm), on the
quickstart workload (configs/quickstart.yaml's one-digit sums, <= 24 new tokens) and long_tail;
engine start-up (building the run's context, the first weight sync) is reported apart from the
steps, and ratios are against the first engine named.

With --trl-site DIR (a `pip install --target DIR --no-deps trl` next to this venv's packages), TRL's
GRPOTrainer runs the same prompts at equal work (8 x 4, <= 64 new tokens, T = 1, beta 0, one
optimizer step per generation batch) and reports step time, completion tokens/s and peak memory.

With --frontier (issue 31), two_digit only: both systems at each micro-batch setting (TRL: 8
completions x 4 accumulation steps and 32 x 1; colorl: the token budget of TRL's 8 padded
completions, its default, and any --budgets) x activation checkpointing off / on, each repeat
interleaved, each colorl point against TRL at the same checkpointing; --systems and --add-to let
one system's runs be taken at another time into the same JSON.

    flock /tmp/colorl-cpu.lock python bench/step.py [--repeats 2] [--steps 2] [--trl-site /tmp/trl-site]
    flock /tmp/colorl-cpu.lock python bench/step.py --frontier --trl-site /tmp/trl-site --steps 3 --repeats 2
    .venv-vllm/bin/python bench/step.py --engines native vllm --workloads quickstart long_tail --steps 3
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from limits import matmul_rate, read_bandwidth  # bench/
from machine import cpu_model  # bench/

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "8c04575"
SUFFIX = "Put the final answer after ####."
WORKLOADS = {
    "quickstart": {"rollout.max_new_tokens": 24, "task.name": "arithmetic", "task.options": {"digits": 1}},
    "two_digit": {"rollout.max_new_tokens": 64},
    "long_tail": {"rollout.max_new_tokens": 512, "rollout.length_override": {"mean": 64, "tailness": 90, "cap": 512}},
}


def write_prompts(path: Path, n: int = 64, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            f.write(json.dumps({"prompt": f"What is {a} + {b}? {SUFFIX}", "answer": str(a + b)}) + "\n")
    return path


def config(workload: str, prompts: Path, run_dir: Path, precision: str | None, model: str,
           engine: str = "native") -> dict:
    cfg = {
        "run": {"name": "bench-step", "dir": str(run_dir.parent), "seed": 0, "steps": 100, "save_every": 0,
                "eval_every": 0},
        "model": {"path": model, "dtype": "float32"},
        "task": {"name": "jsonl", "path": str(prompts), "options": {"eval_fraction": 0.0}},
        "rollout": {"engine": engine, "group_size": 4, "batch_groups": 8, "temperature": 1.0, "concurrency": 32},
        "train": {"lr": 2.0e-5, "grad_clip": 1.0, "mixed_precision": precision},
        "engine": {"block_size": 16, "max_num_seqs": 32},
        "sync": {"bucket_mb": 64},
    }
    for key, value in WORKLOADS[workload].items():
        section, name = key.split(".")
        cfg[section][name] = value
    if cfg["task"]["name"] != "jsonl":
        cfg["task"].pop("path")
    return cfg


# -- inside a run's process (PYTHONPATH = the tree under test) --------------------------------------

def peak_mb() -> float:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


_EARLIER_PEAK_MB = 0.0  # the highest peak a reset cleared: clear_refs also clears what ru_maxrss reports


def reset_peak() -> None:
    global _EARLIER_PEAK_MB
    _EARLIER_PEAK_MB = max(_EARLIER_PEAK_MB, peak_mb())
    Path("/proc/self/clear_refs").write_text("5")


def lifetime_peak_mb() -> float:
    """The process's peak resident memory over its whole life, phase resets included."""
    return max(_EARLIER_PEAK_MB, peak_mb())


class RolloutProfile:
    """Times the native engine's model calls and sampler inside the real rollout, and the floor its
    steps imply: (weights + KV of the batch) / read bandwidth per decode step (bench/engine.py's
    floor) and 2 x params x tokens / matmul rate per prefill token. The physical floor also lets a
    decode step be compute-bound: max(that read time, 2 x params x rows / matmul rate)."""

    def __init__(self, engine, bandwidth: float, rate: float) -> None:
        from colorl.engines.native.model_runner import kv_bytes_per_block

        self.engine, self.bandwidth, self.rate = engine, bandwidth, rate
        self.weight_bytes = sum(t.numel() * t.element_size() for t in engine.model.state_dict().values())
        self.params = sum(t.numel() for t in engine.model.state_dict().values())
        self.kv_per_token = kv_bytes_per_block(engine.spec, 1, engine.dtype)
        self.model_s = self.sample_s = self.floor_s = self.physical_s = 0.0
        self.decode_steps = self.decode_rows = self.prefill_tokens = 0
        run, sample = engine.runner.run, engine.sampler

        def timed_run(batch):
            started = time.perf_counter()
            out = run(batch)
            self.model_s += time.perf_counter() - started
            decodes = [i for i in range(len(batch)) if batch.num_tokens[i] == 1]
            prefill = sum(n for n in batch.num_tokens if n > 1)
            if decodes:
                self.decode_steps += 1
                self.decode_rows += len(decodes)
                context = sum(batch.starts[i] + 1 for i in decodes)
                memory = (self.weight_bytes + context * self.kv_per_token) / self.bandwidth
                self.floor_s += memory
                self.physical_s += max(memory, 2 * self.params * len(decodes) / self.rate)
            self.prefill_tokens += prefill
            self.floor_s += 2 * self.params * prefill / self.rate
            self.physical_s += 2 * self.params * prefill / self.rate
            return out

        def timed_sample(*args, **kwargs):  # whatever the engine's sampler takes
            started = time.perf_counter()
            out = sample(*args, **kwargs)
            self.sample_s += time.perf_counter() - started
            return out

        engine.runner.run, engine.sampler = timed_run, timed_sample

    def take(self) -> dict:
        row = {"rollout_model_s": self.model_s, "rollout_sample_s": self.sample_s, "rollout_floor_s": self.floor_s,
               "rollout_physical_floor_s": self.physical_s,
               "decode_steps": self.decode_steps, "decode_batch_mean": self.decode_rows / max(self.decode_steps, 1),
               "prefill_tokens": self.prefill_tokens}
        self.model_s = self.sample_s = self.floor_s = self.physical_s = 0.0
        self.decode_steps = self.decode_rows = self.prefill_tokens = 0
        return row


def holdings(engine, trainer, libraries_mb: float, activations_mb: float) -> dict:
    """What holds the rank's memory, in MB: tensors counted by their bytes (KV pool: only the blocks
    the engine ever handed out, the pages touched), activations and the LM head's logits chunk by
    `colorl plan`'s arithmetic (checked against measured steps, with and without checkpointing, in
    tests/test_plan.py), libraries as the resident memory before any model was loaded."""
    import torch

    def mb(tensors) -> float:
        return sum(t.numel() * t.element_size() for t in tensors) / 2**20

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    params = [local(p) for p in trainer.model.parameters()]
    out = {"libraries_mb": libraries_mb, "trainer_weights_mb": mb(params),
           "gradients_mb": mb(p for p in params if p.requires_grad),
           "optimizer_state_mb": mb(local(v) for state in trainer.optimizer.state.values() for v in state.values()
                                    if torch.is_tensor(v))}
    out["activations_mb"] = activations_mb
    model = getattr(engine, "model", None)
    if hasattr(model, "linears"):  # the native engine
        from colorl.engines.native.model_runner import kv_bytes_per_block

        out["engine_weights_mb"] = mb(model.parameters()) + mb(model.buffers())
        packed_linears = getattr(model.linears, "packed", model.linears)  # a tree before cpu_decode: the same object
        out["engine_packed_mb"] = mb(packed for _, packed in packed_linears._packed.values())
        block = kv_bytes_per_block(engine.spec, engine.blocks.block_size, engine.dtype)
        out["kv_touched_mb"] = engine.blocks.num_touched_blocks * block / 2**20
        out["kv_pool_mb"] = engine.blocks.num_blocks * block / 2**20
    return out


def planned_activations_mb(cfg, model, groups) -> float:
    """colorl plan's activations for the step's largest micro-batch (packed whole sequences)."""
    from colorl.config import micro_batch_tokens
    from colorl.plan import DTYPE_BYTES, Architecture

    lengths = sorted((len(r.prompt_ids) + len(r.output_ids) for g in groups for r in g.results), reverse=True)
    budget, tokens = micro_batch_tokens(cfg.train, "cpu"), 0
    for length in lengths:  # longest first, as colorl/train/packing.py plans them
        if tokens and tokens + length > budget:
            break
        tokens += length
    b = DTYPE_BYTES[cfg.train.mixed_precision or cfg.model.dtype]
    arch = Architecture.from_hf_config(model.config)
    return arch.activation_bytes(tokens, b, cfg.train.logits_chunk_tokens, cfg.model.lora is not None,
                                 cfg.train.activation_checkpointing) / 2**20


def rss_mb() -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def needed_flops(model, groups) -> float:
    """FLOPs the GRPO loss needs for one forward + backward over the batch (no padding, no prompt logits)."""
    cfg = model.config
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    flops = 0.0
    for g in groups:
        for r in g.results:
            length, response = len(r.prompt_ids) + len(r.output_ids), len(r.output_ids)
            flops += 6 * params * length  # every token through every layer
            flops += 6 * cfg.num_hidden_layers * 2 * cfg.num_attention_heads * head_dim * length * (length + 1) / 2
            flops += 6 * cfg.hidden_size * cfg.vocab_size * response  # logits of the trained tokens
    return flops


def step_inputs(ctx) -> tuple[list[int], int]:
    """Problem indices and sampling seed of the next step, in the API of the tree under test
    (per-step arguments since the resume work; none at 8c04575)."""
    try:
        return list(ctx.problem_indices(ctx.state.step)), ctx.sample_seed(ctx.state.step)
    except TypeError:
        return list(ctx.problem_indices()), ctx.sample_seed()


def prompt_ids(ctx, problem) -> list[int]:
    """A problem's prompt ids in the API of the tree under test (the problem since conversational
    datasets, its prompt text before)."""
    try:
        return ctx.prompt_ids(problem)
    except AttributeError:
        return ctx.prompt_ids(problem.prompt)


def run_worker(cfg_dict: dict, steps: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from colorl.config import validate
    from colorl.distributed import free_port, init_process_group
    from colorl.rollout.collect import collect_groups
    from colorl.train.batch import build_batch
    from colorl.worker import build_context, prepare_run_dir

    torch.set_num_threads(os.cpu_count() or 1)
    libraries_mb = rss_mb()  # the imports, before the probes (the heap keeps their buffers for reuse)
    rate, bandwidth = matmul_rate(), read_bandwidth()
    init_process_group(0, 1, free_port(), "cpu")
    cfg = validate(cfg_dict)
    run_dir = Path(cfg.run.dir) / cfg.run.name
    prepare_run_dir(cfg, run_dir, resume=False)
    started = time.perf_counter()
    ctx = build_context(cfg, 0, 1, "cpu", run_dir, resume=False)
    engine, trainer = ctx.engine, ctx.trainer
    ctx.weight_sync.sync(engine, 0)
    setup_s = time.perf_counter() - started  # engine start-up included, reported apart from the steps
    profile = RolloutProfile(engine, bandwidth, rate) if hasattr(engine, "runner") else None  # the native engine's
    try:
        from colorl.rollout.episodes import Rollouts

        rollouts = Rollouts(engine, ctx.episodes)
    except ImportError:  # a tree from before multi-turn episodes (--before): collect_groups took the engine
        rollouts = engine
    setup_mb = peak_mb()
    records = []
    for step in range(steps):
        row = {"step": step}
        reset_peak()
        started = time.perf_counter()
        engine.wake()
        indices, seed = step_inputs(ctx)
        problems = [ctx.task.train_problem(i) for i in indices]
        groups = collect_groups(rollouts, problems, [prompt_ids(ctx, p) for p in problems], cfg.rollout,
                                ctx.reward_fn, ctx.decode, seed, ctx.stop_ids)
        engine.sleep(cfg.engine.sleep_level or cfg.sleep_level)  # null: the level the tree chooses
        row["rollout_s"], row["rollout_peak_mb"] = time.perf_counter() - started, peak_mb()
        if profile is not None:
            row.update(profile.take())

        reset_peak()
        started = time.perf_counter()
        trainer.onload()
        batch = build_batch(groups, cfg.loss.std_norm, ctx.tokenizer.pad_token_id, cfg.filter.zero_variance)
        stats = trainer.train_step(batch)
        trainer.offload()
        row["train_s"], row["train_peak_mb"] = time.perf_counter() - started, peak_mb()
        row["activations_kept_mb"] = planned_activations_mb(cfg, trainer.model, groups)

        reset_peak()
        started = time.perf_counter()
        ctx.weight_sync.sync(engine, ctx.state.version + 1)
        row["sync_s"], row["sync_peak_mb"] = time.perf_counter() - started, peak_mb()
        ctx.state.step += 1
        ctx.state.version += 1
        ctx.state.data_position += cfg.rollout.batch_groups

        row["step_peak_mb"] = max(row["rollout_peak_mb"], row["train_peak_mb"], row["sync_peak_mb"])
        samples = [r for g in groups for r in g.results]
        row["completion_tokens"] = sum(len(r.output_ids) for r in samples)
        row["train_tokens"] = sum(len(r.prompt_ids) + len(r.output_ids) for r in samples)
        row["padded_tokens"] = len(samples) * max(len(r.prompt_ids) + len(r.output_ids) for r in samples)
        row["loss"], row["tokens_in_loss"] = stats.loss, stats.tokens
        row["needed_gflop"] = needed_flops(trainer.model, groups) / 1e9
        records.append(row)
    held = holdings(engine, trainer, libraries_mb, max(r["activations_kept_mb"] for r in records))
    dist.destroy_process_group()
    out.write_text(json.dumps({"matmul_gflops": rate / 1e9, "read_gb_s": bandwidth / 1e9, "setup_peak_mb": setup_mb,
                               "setup_s": setup_s, "holdings": held, "steps": records,
                               "lifetime_peak_mb": lifetime_peak_mb()}))


# -- TRL GRPOTrainer at equal work --------------------------------------------------------------------

def run_trl(steps: int, prompts: Path, out: Path, precision: str | None, model_path: str, micro: int = 32,
            checkpointing: bool = False) -> None:
    """TRL's GRPOTrainer over the same prompts: `micro` completions per forward/backward and 32 / micro
    accumulation steps (one generation of 8 x 4 and one optimizer step either way); TRL's own default
    turns gradient checkpointing on, so it is always set here."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from colorl.models import resolve_model_path

    torch.set_num_threads(os.cpu_count() or 1)
    model_dir = resolve_model_path(model_path)
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                              for r in rows[: 8 * steps]])

    def reward(completions, answer, **_):
        texts = [c[-1]["content"] for c in completions]
        return [float(t.rsplit("####", 1)[-1].strip().split()[:1] == [a]) if "####" in t else 0.0
                for t, a in zip(texts, answer)]

    timings: list[dict] = []

    class Phases(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            reset_peak()
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            timings.append({"step_s": time.perf_counter() - self.started, "step_peak_mb": peak_mb()})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs and timings:
                timings[-1]["completion_tokens"] = logs["completions/mean_length"] * 32
                timings[-1]["loss"] = logs.get("loss")

    args = GRPOConfig(
        output_dir=str(out.parent / "trl"), per_device_train_batch_size=micro, num_generations=4,
        gradient_accumulation_steps=32 // micro, gradient_checkpointing=checkpointing, max_completion_length=64, temperature=1.0, top_p=1.0, learning_rate=2e-5,
        beta=0.0, max_steps=steps, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        bf16=precision == "bfloat16", seed=0, dataloader_num_workers=0, shuffle_dataset=False,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer,
                          callbacks=[Phases()])
    trainer.train()
    out.write_text(json.dumps({"steps": timings, "lifetime_peak_mb": lifetime_peak_mb()}))


# -- the LM-head chunk size (train.logits_chunk_tokens) ---------------------------------------------

def chunk_sweep(out: Path, tokens: int = 1536, hidden: int = 576, vocab: int = 49152) -> None:
    """Forward + backward of the sampled-token head at SmolLM2's shapes, per chunk size: time, peak."""
    import torch

    from colorl.train.head import SampledTokenHead

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    weight = (torch.randn(vocab, hidden) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,))
    rows = []
    for repeat in range(2):
        for chunk in (256, 512, 1024, 2048):
            h = torch.randn(tokens, hidden, requires_grad=True)
            weight.grad = None
            reset_peak()
            base = peak_mb()
            started = time.perf_counter()
            logp, _ = SampledTokenHead.apply(h, weight, targets, 1.0, chunk)
            logp.sum().backward()
            rows.append({"repeat": repeat, "chunk": chunk, "seconds": time.perf_counter() - started,
                         "peak_above_start_mb": peak_mb() - base})
    out.write_text(json.dumps({"tokens": tokens, "rows": rows}))


# -- the parent: interleaved runs, table, JSON -------------------------------------------------------

def parse_variant(text: str) -> tuple[str, dict]:
    import yaml

    name, _, settings = text.partition("=")
    pairs = [item.split("=", 1) for item in settings.split(";") if item]
    return name, {key: yaml.safe_load(value) for key, value in pairs}


def spawn(tree: Path, argv: list[str], extra_path: str | None = None) -> dict:
    """A worker process, with the settings `colorl train` gives its CPU ranks (the heap kept:
    its memory stays at its peak, which the process's max RSS then shows as a user would see it)."""
    from colorl.launch import CPU_RANK_ENV

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(tree), extra_path) if p),
               HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1",
               TQDM_DISABLE="1", PYTHONWARNINGS="ignore")
    if "--worker" in argv and argv[argv.index("--worker") + 1] == "colorl":
        env = {**CPU_RANK_ENV, **env}  # a user's own settings win, as in colorl/launch.py
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        argv = [sys.executable, str(Path(__file__).resolve()), *argv, "--out", str(out)]
        child = subprocess.Popen(argv, env=env, cwd=tree, stdout=subprocess.DEVNULL)
        _, status, usage = os.wait4(child.pid, 0)  # the child's own rusage: its max RSS, as `time -v` reports it
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode:
            raise subprocess.CalledProcessError(child.returncode, argv)
        report = json.loads(out.read_text())
        # the phase resets (clear_refs) also reset the kernel's ru_maxrss: the worker keeps the peaks they cleared
        return {**report, "process_max_rss_mb": max(usage.ru_maxrss / 1024, report.get("lifetime_peak_mb", 0.0))}


def try_spawn(tree: Path, argv: list[str], extra_path: str | None = None) -> dict:
    """TRL is someone else's code: a failure there is reported, not fatal to the colorl figures."""
    try:
        return spawn(tree, argv, extra_path)
    except subprocess.CalledProcessError as exc:
        print(f"TRL run failed (exit {exc.returncode})", file=sys.stderr)
        return {"steps": [{"step_s": float("nan"), "step_peak_mb": float("nan"), "completion_tokens": float("nan")}]}


def before_tree(ref: str, tmp: Path) -> Path:
    path = tmp / "before"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), ref], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return path


def summarise(run: dict) -> dict:
    timed = run["steps"][1:] or run["steps"]
    mean = lambda key: statistics.mean(r[key] for r in timed)  # noqa: E731
    row = {k: mean(k) for k in timed[0] if isinstance(timed[0][k], (int, float)) and k != "step"}
    row["process_max_rss_mb"] = run.get("process_max_rss_mb", float("nan"))
    row.update(run.get("holdings", {}))
    if "train_s" in row:
        row["train_tokens_per_s"] = row["train_tokens"] / row["train_s"]
        row["step_s"] = row["rollout_s"] + row["train_s"] + row["sync_s"]
        row["flop_utilisation"] = row["needed_gflop"] / row["train_s"] / run["matmul_gflops"]
        row["matmul_gflops"] = run["matmul_gflops"]
        row["setup_peak_mb"] = run["setup_peak_mb"]
        row["setup_s"] = run.get("setup_s", float("nan"))
        row["read_gb_s"] = run["read_gb_s"]
        if "rollout_floor_s" in row:
            row["rollout_over_floor"] = row["rollout_s"] / row["rollout_floor_s"]
            row["rollout_over_physical_floor"] = row["rollout_s"] / row["rollout_physical_floor_s"]
    row["completion_tokens_per_s"] = row["completion_tokens"] / row["step_s"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="steps per run; the first is warm-up")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--before", default=BEFORE, help="git ref of the padded trainer ('none': no such run)")
    parser.add_argument("--results", default=None, help="file name under bench/results (default: step*.json)")
    parser.add_argument("--variant", action="append", default=[],
                        help="another run of this tree: NAME=section.key=value[;section.key=value...]")
    parser.add_argument("--engines", nargs="+", default=None,
                        help="compare rollout engines in this tree instead (e.g. native vllm); ratios vs the first")
    parser.add_argument("--precision", default=None, choices=["bfloat16"], help="train.mixed_precision")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model.path (tiny-random-llama: smoke test)")
    parser.add_argument("--trl-site", default=None, help="folder with TRL installed (--target); none: skip TRL")
    parser.add_argument("--chunk-sweep", action="store_true", help="time the LM-head chunk sizes and exit")
    parser.add_argument("--frontier", action="store_true",
                        help="speed and max RSS of both systems at each micro-batch x checkpointing setting (two_digit)")
    parser.add_argument("--systems", nargs="+", default=["colorl", "trl"], choices=["colorl", "trl"],
                        help="--frontier: which systems to run this time")
    parser.add_argument("--trl-micro", nargs="+", type=int, default=list(TRL_MICRO), choices=list(TRL_MICRO),
                        help="--frontier: TRL's completions per micro-batch to run (default: all)")
    parser.add_argument("--budgets", nargs="*", type=int, default=[],
                        help="--frontier: more colorl token budgets besides TRL's 8 padded completions and the default")
    parser.add_argument("--add-to", default=None,
                        help="--frontier: a frontier JSON under bench/results whose runs this one adds to")
    parser.add_argument("--worker", choices=["colorl", "trl", "chunks"], help=argparse.SUPPRESS)
    parser.add_argument("--micro", type=int, default=32, help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "colorl":
        run_worker(json.loads(args.config), args.steps, Path(args.out))
        return 0
    if args.worker == "chunks":
        chunk_sweep(Path(args.out))
        return 0
    if args.chunk_sweep:
        sweep = spawn(ROOT, ["--worker", "chunks"])
        for row in sweep["rows"]:
            print(row)
        (ROOT / "bench" / "results" / "step_chunks.json").write_text(json.dumps(sweep, indent=2))
        return 0
    if args.worker == "trl":
        run_trl(args.steps, Path(args.prompts), Path(args.out), args.precision, args.model, args.micro,
                args.checkpointing)
        return 0
    if args.frontier:
        return run_frontier(args)

    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        prompts = write_prompts(tmp / "prompts.jsonl")
        # name -> (tree, rollout engine, settings over the workload's config)
        if args.engines:
            trees = {engine: (ROOT, engine, {}) for engine in args.engines}
        else:
            trees = {} if args.before == "none" else {"before": (before_tree(args.before, tmp), "native", {})}
            trees["after"] = (ROOT, "native", {})
        trees.update({name: (ROOT, "native", sets) for name, sets in map(parse_variant, args.variant)})
        try:
            for repeat in range(args.repeats):
                for workload in args.workloads:
                    for name, (tree, engine, sets) in trees.items():
                        cfg = config(workload, prompts, tmp / f"{name}-{workload}-{repeat}" / "bench-step",
                                     args.precision, args.model, engine)
                        for key, value in sets.items():
                            section, field = key.split(".")
                            cfg[section][field] = value
                        run = spawn(tree, ["--worker", "colorl", "--steps", str(args.steps),
                                           "--config", json.dumps(cfg)])
                        results.setdefault(workload, {}).setdefault(name, []).append(summarise(run))
                        print(f"{workload} {name} repeat {repeat}: {results[workload][name][-1]}", flush=True)
                if args.trl_site and "two_digit" in args.workloads:
                    run = try_spawn(ROOT, ["--worker", "trl", "--steps", str(args.steps), "--prompts", str(prompts),
                                       "--model", args.model,
                                       *(["--precision", args.precision] if args.precision else [])], args.trl_site)
                    results.setdefault("two_digit", {}).setdefault("trl", []).append(summarise(run))
                    print(f"two_digit trl repeat {repeat}: {results['two_digit']['trl'][-1]}", flush=True)
        finally:
            if "before" in trees:
                subprocess.run(["git", "worktree", "remove", "--force", str(trees["before"][0])], cwd=ROOT, check=False)
    baseline = args.engines[0] if args.engines else "before" if "before" in trees else "after"
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(),
              "baseline": baseline if args.engines else args.before,
              "precision": args.precision or "float32", "steps": args.steps, "repeats": args.repeats,
              "workloads": results}
    print_table(results, baseline)
    name = "step.json" if not args.precision else f"step_{args.precision}.json"
    if args.engines:
        name = f"step_engines_{'_'.join(args.engines)}.json"
    name = args.results or name
    (ROOT / "bench" / "results" / name).write_text(json.dumps(report, indent=2))
    return 0


def print_table(results: dict, baseline: str = "before") -> None:
    columns = [("setup_s", "start-up s", ".1f"), ("step_s", "step s", ".1f"), ("rollout_s", "rollout s", ".1f"), ("train_s", "train s", ".1f"),
               ("sync_s", "sync s", ".2f"), ("completion_tokens_per_s", "compl tok/s", ".1f"),
               ("train_tokens_per_s", "train tok/s", ".0f"), ("flop_utilisation", "FLOP util", ".1%"),
               ("rollout_over_floor", "roll/floor", ".2f"),
               ("rollout_over_physical_floor", "roll/phys", ".2f"), ("rollout_peak_mb", "rollout MB", ".0f"),
               ("train_peak_mb", "train MB", ".0f"),
               ("step_peak_mb", "peak MB", ".0f"), ("process_max_rss_mb", "max RSS MB", ".0f")]
    for workload, runs in results.items():
        print(f"\n{workload}")
        print(f"{'':8}" + "".join(f"{title:>13}" for _, title, _ in columns))
        for name, rows in runs.items():
            cells = []
            for key, _, fmt in columns:
                values = [r[key] for r in rows if key in r]
                cells.append(f"{statistics.median(values):>13{fmt}}" if values else f"{'-':>13}")
            print(f"{name:8}" + "".join(cells))
        parts = ("libraries_mb", "trainer_weights_mb", "gradients_mb", "optimizer_state_mb", "activations_mb",
                 "engine_weights_mb", "engine_packed_mb", "kv_touched_mb")
        for name, rows in runs.items():
            if "trainer_weights_mb" in rows[0]:
                held = {key: statistics.median(r[key] for r in rows if key in r) for key in parts if key in rows[0]}
                print(f"  {name} holds (MB): " + ", ".join(f"{key[:-3]} {value:.0f}" for key, value in held.items())
                      + f"; max RSS {statistics.median(r['process_max_rss_mb'] for r in rows):.0f}")
        base = runs.get(baseline)
        if base is None:
            continue
        for name in [n for n in runs if n not in (baseline, "trl")]:
            ratios = {key: statistics.median(r[key] for r in base) / statistics.median(r[key] for r in runs[name])
                      for key in ("setup_s", "step_s", "rollout_s", "train_s") if key in runs[name][0]}
            ratios["completion_tokens_per_s"] = (statistics.median(r["completion_tokens_per_s"] for r in runs[name])
                                                 / statistics.median(r["completion_tokens_per_s"] for r in base))
            print(f"  {name} vs {baseline}: " + ", ".join(f"{k} x{v:.2f}" for k, v in ratios.items())
                  + "  (time ratios: baseline / this, above 1 = this is faster)")
        if "trl" in runs and "after" in runs:
            ratio = (statistics.median(r["completion_tokens_per_s"] for r in runs["after"])
                     / statistics.median(r["completion_tokens_per_s"] for r in runs["trl"]))
            print(f"  after vs TRL: completion tokens/s x{ratio:.2f}")


# -- the frontier: both systems at each micro-batch x checkpointing setting (issue 31 item 3) ---------

TRL_MICRO = (8, 32)  # completions per forward/backward; 32 / micro gradient accumulation steps


@dataclass(frozen=True)
class Point:
    """One setting of one system: TRL's completions per micro-batch, or colorl's token budget
    (None: its default), and activation checkpointing."""

    system: str
    micro: int | None
    checkpointing: bool

    @property
    def key(self) -> str:
        if self.system == "trl":
            size = f"{self.micro} x {32 // self.micro}"
        else:
            size = "default budget" if self.micro is None else f"budget {self.micro}"
        return f"{self.system} {size}, ckpt {'on' if self.checkpointing else 'off'}"


def padded_budget(prompts: Path, model: str, completions: int, max_new_tokens: int = 64) -> int:
    """TRL's micro-batch of `completions` in tokens: it pads every row to the longest prompt plus the
    longest completion, at most this many (the same prompts, rendered by the same chat template)."""
    from transformers import AutoTokenizer

    from colorl.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model))
    longest = max(len(tokenizer.apply_chat_template([{"role": "user", "content": json.loads(line)["prompt"]}],
                                                    add_generation_prompt=True, tokenize=True, return_dict=False))
                  for line in prompts.read_text().splitlines())
    return completions * (longest + max_new_tokens)


def run_frontier(args) -> int:
    """Every point, each repeat interleaved (TRL then colorl at each checkpointing setting); rows are
    added to --add-to's when given, so one system's runs can be taken at another time."""
    from colorl.config import MICRO_BATCH_TOKENS

    path = ROOT / "bench" / "results" / (args.results or "step_frontier.json")
    report = json.loads((ROOT / "bench" / "results" / args.add_to).read_text()) if args.add_to else {"points": {}}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        prompts = write_prompts(tmp / "prompts.jsonl")
        budgets = {n: padded_budget(prompts, args.model, n) for n in TRL_MICRO}
        points = []
        for checkpointing in (False, True):
            if "trl" in args.systems:
                points += [Point("trl", n, checkpointing) for n in args.trl_micro]
            if "colorl" in args.systems:
                points += [Point("colorl", budget, checkpointing) for budget in (budgets[8], *args.budgets, None)]
        for repeat in range(args.repeats):
            for point in points:
                if point.system == "trl":
                    run = try_spawn(ROOT, ["--worker", "trl", "--steps", str(args.steps), "--prompts", str(prompts),
                                           "--model", args.model, "--micro", str(point.micro),
                                           *(["--checkpointing"] if point.checkpointing else [])], args.trl_site)
                else:
                    cfg = config("two_digit", prompts, tmp / f"colorl-{len(points)}-{repeat}" / "bench-step",
                                 args.precision, args.model)
                    cfg["train"]["activation_checkpointing"] = point.checkpointing
                    if point.micro is not None:
                        cfg["train"]["max_tokens_per_micro_batch"] = point.micro
                    run = spawn(ROOT, ["--worker", "colorl", "--steps", str(args.steps), "--config", json.dumps(cfg)])
                row = summarise(run)
                entry = report["points"].setdefault(point.key, {**dataclasses.asdict(point), "runs": []})
                entry["runs"].append(row)
                print(f"{point.key} repeat {repeat}: step {row['step_s']:.1f} s, "
                      f"{row['completion_tokens_per_s']:.1f} compl tok/s, max RSS {row['process_max_rss_mb']:.0f} MB",
                      flush=True)
                path.write_text(json.dumps(report, indent=2))  # a long sweep keeps what it has
    report.update({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(),
                   "steps": args.steps, "repeats": args.repeats, "precision": args.precision or "float32",
                   "trl_padded_budgets": budgets, "default_budget": MICRO_BATCH_TOKENS["cpu"]})
    path.write_text(json.dumps(report, indent=2))
    print_frontier(report)
    return 0


def print_frontier(report: dict) -> None:
    """Medians per point; each colorl point against TRL at each micro-batch with the same checkpointing
    (speed: colorl / TRL completion tokens/s; memory: colorl / TRL max RSS)."""
    med = lambda entry, key: statistics.median(r[key] for r in entry["runs"])  # noqa: E731
    print(f"\n{report.get('cpu', '')}")
    print(f"{'point':34}{'runs':>5}{'step s':>8}{'compl tok/s':>13}{'max RSS GiB':>12}   vs TRL at the same checkpointing")
    for key, entry in report["points"].items():
        line = (f"{key:34}{len(entry['runs']):>5}{med(entry, 'step_s'):>8.1f}{med(entry, 'completion_tokens_per_s'):>13.1f}"
                f"{med(entry, 'process_max_rss_mb') / 1024:>12.2f}")
        if entry["system"] == "colorl":
            for n in TRL_MICRO:
                trl = report["points"].get(Point("trl", n, entry["checkpointing"]).key)
                if trl:
                    speed = med(entry, "completion_tokens_per_s") / med(trl, "completion_tokens_per_s")
                    memory = med(entry, "process_max_rss_mb") / med(trl, "process_max_rss_mb")
                    line += f"   TRL {n} x {32 // n}: speed x{speed:.2f}, memory x{memory:.2f}"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
