"""Native engine vs the hf backend or vLLM on SmolLM2-135M: rollout tokens/s, start-up, memory, decode floor.

    python bench/engine.py                  # both workloads, both engines, decode floor (~5 min)
    python bench/engine.py --quick          # 4 prompts x 2 samples, mean 32: a smoke run
    .venv-vllm/bin/python bench/engine.py --engines native,vllm --threads 2 --split
                                            # against vLLM's CPU build (colorl's adapter, in process,
                                            # eager; --vllm-compiled: its default torch.compile set-up)
    python bench/engine.py --engines native,native-stepwise --floor-rounds 0
                                            # bursts of decode steps against one step per call

Workloads (8 prompts x 4 samples, temperature 1, top-p 1, a GRPO rollout batch):
- long_tail: `ignore_eos`, each request's max_new_tokens drawn from the capped lognormal of
  `rollout.length_override` (mean 64, tailness 90, cap 512; seeded, same lengths for both engines);
- natural: stop at EOS, max_new_tokens 256.
Each engine runs in its own process (clean peak RSS), one thread by default (the machine is shared),
after a short warm-up; the best of --repeats runs (default 2) counts. tokens/s counts only returned
tokens (the hf backend pads every batch to its longest request; the padding is not counted).

Decode floor: a decode step must read every weight once, plus the KV of every running sequence,
so step time >= (weight bytes + KV bytes) / memory bandwidth, with the bandwidth measured here
(a sum over a 512 MiB tensor on the heap's pages and on huge pages, the faster, same thread count:
bench/limits.py). The ratio step / floor says how far the native decode step is from memory-bound
ideal at batch 1, 8 and 32. The engine runs its decode steps in bursts (engine.decode_burst, 8 by default:
one compiled call each); each call is followed by one reading of the bandwidth, and each of its steps takes the
call's time over its steps and is judged against that reading; a round's ratio is the median over its steps
(--floor-rounds, default 5, interleaved over the batches), and the verdict is the median of the rounds' ratios,
with their range.

With --split each rollout also runs once more under torch.profiler, and the decode time is split
by what the operators do (products, attention, KV writes, elementwise, sampling; the rest of the
wall time is Python and dispatch), for every engine whose work is torch operators (vLLM's CPU
build is: its kernels are registered torch ops).

With --isa avx2 every library in both engines' processes runs its AVX2 code on an AVX-512 machine
(torch's ATen and oneDNN held to AVX2, the native loops built for x86-64-v3, vLLM's AVX2 kernel
library loaded instead of its AVX-512 one, its torch.compile graphs vectorised 256 bits wide): what an AVX2-only CPU would run, on this machine's
memory and cores. It is an emulation; a real AVX2 CPU's own figures may differ.

Results: bench/results/engine.json; summary in bench/README.md ("Native engine (issue 3)").
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from limits import MemoryReader, matmul_rate  # bench/
from machine import cpu_model  # bench/

ROOT = Path(__file__).resolve().parent
QUESTIONS = [
    "What is 17 + 25? Explain step by step.",
    "Name three primary colors and describe each one.",
    "Write a short poem about the sea.",
    "What is the capital of France, and why is it famous?",
    "Explain what a prime number is, with examples.",
    "Give me a recipe for a simple salad.",
    "Why is the sky blue?",
    "Describe your ideal weekend in a few sentences.",
]


def lengths_for(n: int, mean: float, tailness: float, cap: int, seed: int) -> list[int]:
    from colorl.staleness.formula import LengthModel

    model, rng = LengthModel(mean=mean, tailness=tailness, cap=cap), random.Random(seed)
    return [model.draw(rng) for _ in range(n)]


def build_requests(args, engine_name: str, model_dir: Path):
    from colorl.engines.base import GenerationRequest, SamplingParams
    from colorl.models import encode_chat, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    prompts = [encode_chat(tokenizer, q) for q in QUESTIONS[:args.prompts]]
    n = args.prompts * args.samples
    budgets = lengths_for(n, args.mean, args.tailness, args.cap, args.seed) if args.workload == "long_tail" else [args.natural_max] * n
    requests = []
    for i in range(n):
        # The hf backend batches only requests with equal params, and seeds a batch from one
        # generator, so it gets no per-request seed; the native engine gets one per request.
        seed = None if engine_name == "hf" else args.seed * 1000 + i
        params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=budgets[i],
                                ignore_eos=args.workload == "long_tail", seed=seed)
        requests.append(GenerationRequest(f"p{i // args.samples}s{i % args.samples}", prompts[i // args.samples], params))
    return requests, budgets


AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "COLORL_CPU_DECODE_ARCH": "x86-64-v3"}


def make_engine(name: str, model_dir: Path, dtype: torch.dtype, vllm_compiled: bool = False):
    from colorl.config import EngineConfig
    from colorl.engines import build_engine

    if name == "vllm" and os.environ.get("COLORL_CPU_DECODE_ARCH") == AVX2_ENV["COLORL_CPU_DECODE_ARCH"]:
        # --isa avx2: vLLM picks its kernel library by what torch says the CPU has, and its compiled
        # graphs take the vector width inductor is given
        import torch._inductor.config

        torch.cpu._is_avx512_supported = torch.cpu._is_avx512_bf16_supported = lambda: False
        torch._inductor.config.cpp.simdlen = 256
    if name == "vllm" and vllm_compiled:
        from colorl.engines.vllm import VLLMEngine

        return VLLMEngine(model_dir, EngineConfig(), "cpu", dtype, compile_on_cpu=True)
    if name == STEPWISE:
        return build_engine("native", model_dir, EngineConfig(decode_burst=1), "cpu", dtype)
    return build_engine(name, model_dir, EngineConfig(), "cpu", dtype)


STEPWISE = "native-stepwise"  # the native engine with one decode step per call (engine.decode_burst: 1)


def timed_call(engine, batch: int) -> tuple[float, int]:
    """One `engine.step()` of `batch` decoding sequences: seconds per decode step, and the decode steps it ran (a
    burst's, engine.decode_burst)."""
    computed, started = engine.num_computed_tokens, time.perf_counter()
    engine.step()
    count = (engine.num_computed_tokens - computed) // batch
    return (time.perf_counter() - started) / count, count


def decode_bench_args(doc: str, threads: int, rounds: int, batches: str, dtype: str, out: Path) -> argparse.Namespace:
    """The arguments of a bench over native decode steps (bench/decode_step.py, bench/step_team.py), with these
    defaults, parsed; torch then runs at --threads."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--threads", type=int, default=threads)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--batches", default=batches)
    parser.add_argument("--dtype", default=dtype, choices=["float32", "bfloat16"])
    parser.add_argument("--out", default=str(out))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


def native_on_smollm2(bench: str, dtype: torch.dtype):
    """The native engine on SmolLM2-135M, its compiled loops, and QUESTIONS[0] as a chat prompt; exits, naming the
    bench, where the loops are not used (nothing to compare)."""
    from colorl.models import encode_chat, load_tokenizer, resolve_model_path

    model_dir = resolve_model_path("smollm2-135m-instruct")
    engine = make_engine("native", model_dir, dtype)
    compiled = engine.model.compiled(dtype, torch.device("cpu"))
    if compiled is None:
        sys.exit(f"{bench}: the native engine's compiled loops are not used here; nothing to compare")
    return engine, compiled, encode_chat(load_tokenizer(model_dir), QUESTIONS[0])


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS counter (VmHWM), so the rollout's own peak can be read."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def worker_rollout(args) -> dict:
    from colorl.engines.base import GenerationRequest, SamplingParams
    from colorl.models import resolve_model_path

    model_dir = resolve_model_path(args.model)
    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()
    engine = make_engine(args.engine, model_dir, dtype, args.vllm_compiled)
    startup_s = time.perf_counter() - started
    warm = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    engine.generate([GenerationRequest(f"warm{i}", [1, 2, 3, 4, 5], warm) for i in range(2)])
    rss_loaded = rss_bytes()
    load_peak = peak_rss_bytes()
    can_reset = reset_peak_rss()
    runs = []  # the best of --repeats runs: the machine is shared
    for repeat in range(args.repeats):
        requests, budgets = build_requests(args, args.engine, model_dir)
        for request in requests:
            request.request_id = f"r{repeat}-{request.request_id}"
        started = time.perf_counter()
        results = engine.generate(requests)
        runs.append((time.perf_counter() - started, results))
    seconds, results = min(runs, key=lambda run: run[0])
    lengths = [len(r.output_ids) for r in results]
    out = {
        "engine": args.engine, "workload": args.workload, "startup_s": startup_s, "seconds": seconds,
        "run_seconds": [run[0] for run in runs],
        "generated_tokens": sum(lengths),
        "tokens_per_s": sum(lengths) / seconds, "mean_length": sum(lengths) / len(lengths), "max_length": max(lengths),
        "rss_after_load_gb": rss_loaded / 1e9,
        "peak_rss_load_gb": load_peak / 1e9,  # includes the mmapped checkpoint while loading
        "peak_rss_rollout_gb": peak_rss_bytes() / 1e9 if can_reset else None,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
        "finish_reasons": {r: sum(1 for x in results if x.finish_reason == r) for r in {x.finish_reason for x in results}},
    }
    if args.engine in ("native", STEPWISE):
        stats = engine.stats()
        from colorl.engines.native.model_runner import kv_bytes_per_block

        touched = engine.blocks.num_touched_blocks
        out.update(prefix_hit_tokens=engine.scheduler.num_prefix_hit_tokens, preemptions=engine.scheduler.num_preemptions,
                   computed_tokens=engine.num_computed_tokens, kv_blocks_total=stats.kv_blocks_total,
                   kv_blocks_touched=touched, kv_touched_gb=touched * kv_bytes_per_block(engine.spec, engine.blocks.block_size, dtype) / 1e9)
    if args.workload == "long_tail":
        assert lengths == budgets, "long-tail workload: every request must produce exactly its drawn length"
    if args.split:
        out["split"] = time_split(engine, build_requests(args, args.engine, model_dir)[0])
    return out


SPLIT = {  # operator-name fragments -> what the time is spent on (first match wins)
    "products": ("linear", "mm", "matmul", "addmm", "bmm", "gemm"),
    "attention": ("attention", "sdpa", "softmax", "paged", "flash"),
    "kv_writes": ("index_put", "index_copy", "scatter", "reshape_and_cache", "copy_"),
    "sampling": ("multinomial", "sort", "cumsum", "searchsorted", "topk", "argmax", "log_softmax", "exponential"),
    "elementwise": ("mul", "add", "silu", "rms", "norm", "rsqrt", "pow", "mean", "cat", "neg", "cos", "sin",
                    "exp", "div", "sub", "where", "to", "gather", "index_select", "embedding", "clone", "contiguous"),
}


def time_split(engine, requests) -> dict:
    """One more rollout under torch.profiler: the operators' own CPU time by kind, and the rest of
    the wall time (Python, dispatch, scheduling) as `python`. Profiling slows the run; the split is
    what counts here, not the absolute times."""
    from torch.profiler import ProfilerActivity, profile

    for request in requests:
        request.request_id = "split-" + request.request_id
    model = getattr(engine, "model", None)  # the native engine's: its compiled loops, if built
    compiled = model.compiled(engine.dtype, engine.device) if hasattr(model, "compiled") else None
    if compiled is not None:
        compiled.seconds = {}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        engine.generate(requests)
        wall = time.perf_counter() - started
    kinds = dict.fromkeys([*SPLIT, "other_ops"], 0.0)
    for event in prof.key_averages():
        name = event.key.lower()
        kind = next((k for k, parts in SPLIT.items() if any(part in name for part in parts)), "other_ops")
        kinds[kind] += event.self_cpu_time_total / 1e6
    if compiled is not None:  # the compiled decode loops: ctypes calls, unseen by the profiler
        for kind, seconds in compiled.seconds.items():
            kinds[kind] += seconds
        compiled.seconds = None
    ops = sum(kinds.values())
    return {"wall_s": wall, **{f"{k}_s": v for k, v in kinds.items()}, "python_s": max(wall - ops, 0.0)}


FLOOR_BARS = {1: ("floor", 1.2), 8: ("floor", 1.5), 32: ("rate", 0.5)}  # issue 31: what each batch is held to


def worker_floor(args) -> dict:
    """Native decode steps at batch 1, 8, 32 against the machine's own limits, measured in the same process:
    memory ((weights + KV bytes) / read bandwidth: a step that reads each once can be no faster) and
    arithmetic (the step's FLOPs / the dtype's large-matmul rate: the share of the machine's compute the
    step uses, which is what bounds a batch of 32).

    A shared machine's bandwidth moves by half between minutes (10.5 to 15.9 GB/s here) and a step's time by
    a fifth between seconds, so each engine call (a burst of decode steps) is followed by one reading of the read
    rate (MemoryReader.once, about a step's time) and its steps are judged against the floor of that reading; a
    round's ratio is the median over its steps, the rounds are interleaved over the batches, and the verdict is
    the median of the rounds' ratios (each round's kept). The matmul rate is measured just before each round of the batch it judges."""
    import statistics

    from colorl.engines.base import GenerationRequest, SamplingParams
    from colorl.engines.native.model_runner import kv_bytes_per_block
    from colorl.models import encode_chat, load_tokenizer, resolve_model_path

    model_dir = resolve_model_path(args.model)
    dtype = getattr(torch, args.dtype)
    engine = make_engine("native", model_dir, dtype)
    tokenizer = load_tokenizer(model_dir)
    prompt = encode_chat(tokenizer, QUESTIONS[0])
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    spec = engine.spec
    product_params = spec.num_layers * spec.layer_matrix_elements + spec.vocab_size * spec.hidden_size  # + LM head
    kv_per_token = kv_bytes_per_block(spec, 1, dtype)
    context = len(prompt) + 20  # median context during the timed steps
    reader = MemoryReader()
    rounds: dict[int, list[dict]] = {batch: [] for batch in FLOOR_BARS}
    for _ in range(args.floor_rounds):
        for batch in FLOOR_BARS:
            rate = matmul_rate(0.3, dtype=dtype) if FLOOR_BARS[batch][0] == "rate" else None
            params = SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True)
            for i in range(batch):
                engine.add(GenerationRequest(f"f{batch}-{len(rounds[batch])}-{i}", prompt, params))
            engine.step()  # prefill
            steps, readings = [], []
            while engine.has_unfinished():
                seconds, count = timed_call(engine, batch)
                reading = reader.once()
                steps += [seconds] * count
                readings += [reading] * count
            steps, readings = steps[8:], readings[8:]  # the first burst's steps: a warm-up
            floor_bytes = weight_bytes + batch * context * kv_per_token
            step, bandwidth = statistics.median(steps), statistics.median(readings)
            flops = batch * (2 * product_params + 4 * spec.num_layers * spec.num_heads * spec.head_dim * context)
            rounds[batch].append({
                "step_ms": step * 1e3, "bandwidth_gb_s": bandwidth / 1e9, "floor_ms": floor_bytes / bandwidth * 1e3,
                "step_over_floor": statistics.median(t * r / floor_bytes for t, r in zip(steps, readings)),
                "gflop_s": flops / step / 1e9,
                **({"matmul_gflop_s": rate / 1e9, "share_of_matmul_rate": flops / step / rate} if rate else {})})
    rows = []
    for batch, runs in rounds.items():
        row = {"batch": batch, "tokens_per_s": batch / statistics.median(r["step_ms"] for r in runs) * 1e3,
               "rounds": runs}
        for key in runs[0]:
            row[key] = statistics.median(r[key] for r in runs)
        rows.append(row)
    every = [r for runs in rounds.values() for r in runs]
    return {"bandwidth_gb_s": statistics.median(r["bandwidth_gb_s"] for r in every),
            "matmul_gflop_s": statistics.median(r["matmul_gflop_s"] for r in every if "matmul_gflop_s" in r),
            "weight_bytes": weight_bytes, "rounds": args.floor_rounds, "decode": rows}


def floor_verdicts(floor: dict) -> list[str]:
    """One line per batch: the median of its rounds' ratios against the bar issue 31 holds it to, the
    rounds' range, and how many rounds met the bar."""
    lines = []
    for row in floor["decode"]:
        kind, bar = FLOOR_BARS[row["batch"]]
        runs = row.get("rounds", [row])
        if kind == "floor":
            ratios = [r["step_over_floor"] for r in runs]
            met = row["step_over_floor"] <= bar
            # the step's FLOPs at the machine's large-matmul rate: no kernel on this CPU computes them faster
            arithmetic_ms = row["gflop_s"] * row["step_ms"] / floor["matmul_gflop_s"]
            beyond = arithmetic_ms > bar * row["floor_ms"]
            lines.append(f"decode batch {row['batch']:2d}: {row['step_ms']:6.1f} ms/step = {row['step_over_floor']:.2f}x "
                         f"its memory floor {row['floor_ms']:.1f} ms (rounds {min(ratios):.2f}-{max(ratios):.2f}x, "
                         f"{sum(r <= bar for r in ratios)} of {len(ratios)} within; bar {bar}x: "
                         f"{'met' if met else 'NOT met'}); its FLOPs at the matmul rate {arithmetic_ms:.1f} ms = "
                         f"{arithmetic_ms / row['floor_ms']:.2f}x the memory floor"
                         + (" (the bar is below this CPU's arithmetic)" if beyond else ""))
        else:
            shares = [r["share_of_matmul_rate"] for r in runs]
            met = row["share_of_matmul_rate"] >= bar
            bar_ms = row["gflop_s"] * row["step_ms"] / (bar * row["matmul_gflop_s"])  # the step's FLOPs at the bar
            lines.append(f"decode batch {row['batch']:2d}: {row['step_ms']:6.1f} ms/step = {row['gflop_s']:.0f} GFLOP/s, "
                         f"{100 * row['share_of_matmul_rate']:.0f} % of the matmul rate {row['matmul_gflop_s']:.0f} "
                         f"(rounds {100 * min(shares):.0f}-{100 * max(shares):.0f} %, {sum(x >= bar for x in shares)} of "
                         f"{len(shares)} at or above; bar {100 * bar:.0f} %: {'met' if met else 'NOT met'}); "
                         f"{row['step_over_floor']:.1f}x the memory floor; a step at the bar takes {bar_ms:.1f} ms = "
                         f"{bar_ms / row['floor_ms']:.2f}x the memory floor"
                         + (" (the bar is beyond this CPU's memory: no step reads its weights that fast)"
                            if bar_ms < row["floor_ms"] else ""))
    return lines


def run_worker(args) -> None:
    torch.set_num_threads(args.threads)
    result = worker_floor(args) if args.worker == "floor" else worker_rollout(args)
    print("RESULT " + json.dumps(result), flush=True)


def spawn(args, worker: str, **extra) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", worker, "--threads", str(args.threads),
           "--model", args.model, "--dtype", args.dtype, "--prompts", str(args.prompts), "--samples", str(args.samples),
           "--mean", str(args.mean), "--tailness", str(args.tailness), "--cap", str(args.cap),
           "--natural-max", str(args.natural_max), "--seed", str(args.seed), "--repeats", str(args.repeats),
           "--floor-rounds", str(args.floor_rounds)]
    for key, value in extra.items():
        cmd += [f"--{key}", str(value)]
    if args.split and worker != "floor":
        cmd.append("--split")
    if args.vllm_compiled:
        cmd.append("--vllm-compiled")
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
           **(AVX2_ENV if args.isa == "avx2" else {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{worker} {extra} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--mean", type=float, default=64)
    parser.add_argument("--tailness", type=float, default=90)
    parser.add_argument("--cap", type=int, default=512)
    parser.add_argument("--natural-max", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engines", default="native,hf")
    parser.add_argument("--workloads", default="long_tail,natural")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per engine and workload; the best counts")
    parser.add_argument("--out", default=str(ROOT / "results" / "engine.json"))
    parser.add_argument("--split", action="store_true", help="also split each rollout's time by operator kind")
    parser.add_argument("--vllm-compiled", action="store_true",
                        help="vLLM with its default CPU set-up (torch.compile, ~90 s warm-up) instead of eager mode")
    parser.add_argument("--isa", default="native", choices=["native", "avx2"],
                        help="avx2: run both engines' AVX2 code on this (AVX-512) machine, an emulated AVX2-only CPU")
    parser.add_argument("--floor-rounds", type=int, default=5,
                        help="decode floor: rounds of each batch, each after its own limits are measured again "
                             "(0: no decode floor)")
    parser.add_argument("--worker", choices=["native", STEPWISE, "hf", "vllm", "floor"], help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor_rounds < 0:
        parser.error(f"--floor-rounds must be 0 (no decode floor) or more, not {args.floor_rounds}")
    if args.worker:
        if args.worker != "floor":
            args.engine = args.worker
        run_worker(args)
        return
    if args.quick:
        args.prompts, args.samples, args.mean, args.natural_max = 4, 2, 32, 64
    engines = args.engines.split(",")
    report = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": args.threads,
                    "torch": torch.__version__, "load_avg_at_start": os.getloadavg()},
        "model": args.model, "dtype": args.dtype, "vllm_compiled": args.vllm_compiled, "isa": args.isa,
        "prompts": args.prompts, "samples": args.samples,
        "length_model": {"mean": args.mean, "tailness": args.tailness, "cap": args.cap, "seed": args.seed},
        "workloads": {},
    }
    for workload in [w for w in args.workloads.split(",") if w]:  # --workloads "": the decode floor only
        entry: dict = {}
        if workload == "long_tail":
            entry["lengths"] = lengths_for(args.prompts * args.samples, args.mean, args.tailness, args.cap, args.seed)
        for name in engines:
            entry[name] = spawn(args, name, workload=workload)
            print(f"{workload:9s} {name:6s} {entry[name]['tokens_per_s']:8.1f} tok/s  "
                  f"{entry[name]['generated_tokens']} tokens in {entry[name]['seconds']:.1f} s  "
                  f"rollout peak RSS {entry[name]['peak_rss_rollout_gb'] or entry[name]['peak_rss_gb']:.2f} GB", flush=True)
        for other in ("hf", "vllm", STEPWISE):
            if "native" in entry and other in entry:
                entry[f"native_over_{other}"] = entry["native"]["tokens_per_s"] / entry[other]["tokens_per_s"]
                print(f"{workload:9s} native / {other} = {entry[f'native_over_{other}']:.2f}x tokens/s; start-up "
                      f"{entry['native']['startup_s']:.1f} s vs {entry[other]['startup_s']:.1f} s", flush=True)
        for name in engines:
            if "split" in entry[name]:
                split = entry[name]["split"]
                print(f"{workload:9s} {name:6s} split of {split['wall_s']:.1f} s (profiled): " + ", ".join(
                    f"{key[:-2]} {100 * value / split['wall_s']:.0f}%" for key, value in split.items() if key != "wall_s"))
        report["workloads"][workload] = entry
    if "native" in engines and args.floor_rounds > 0:
        report["decode_floor"] = spawn(args, "floor")
        floor = report["decode_floor"]
        print(f"{cpu_model()}, {args.threads} threads, {args.dtype}: read bandwidth {floor['bandwidth_gb_s']:.1f} GB/s, "
              f"matmul rate {floor['matmul_gflop_s']:.0f} GFLOP/s, weights {floor['weight_bytes'] / 1e6:.0f} MB")
        for line in floor_verdicts(floor):
            print(line)
    report["machine"]["load_avg_at_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.rename(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
