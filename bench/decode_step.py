"""Where a native decode step's time goes on CPU, and what each of its CPU-side choices is worth, side by side
in one process on SmolLM2-135M (issue 31 item 1).

    python bench/decode_step.py                    # 1 thread, float32, batches 1, 4 and 8, 5 rounds (~5 min)
    python bench/decode_step.py --threads 2 --rounds 7
    python bench/decode_step.py --dtype bfloat16   # the engine serving bf16 weights

Three choices, each against its baseline, the rounds interleaved so that both see the same neighbours on a
shared machine (the verdict is the median of the rounds' ratios):
- pages: the engine's weights in one mapping advised for huge pages (colorl's default,
  engines/native/host_memory.py) against the same weights copied onto the heap's small pages; the
  `sum` of a 512 MiB tensor on either kind of page is printed beside it (bench/limits.py);
- sampler: the compiled plain sampler (cpu_decode.c, `sample_plain`) against torch's operators
  (`Sampler._inverse_cdf_two_level`), timed as the step's sampling call;
- few rows: every product of a step of 1-8 sequences over the weights' panels against all on the rows kernel
  (COLORL_CPU_DECODE_PANEL_ROWS=all / none; unset, the machine's race picks per row count, as in the other
  columns);
- head: the final norm and the LM head run in the layers' compiled call (the engine's default for a step whose
  every token samples, model.py) against after it, in Python (the same loops, called one by one);
- bursts: the engine's decode steps in bursts of engine.decode_burst (8) per compiled call, each drawing its
  tokens and feeding them to the next in C (its default, engine.py) against one step per call, timed per step.
The other columns run one step per call, and each step is also split into the model's forward and the rest
(scheduling, sampling, results).

Results: bench/results/decode_step.json; summary in bench/README.md.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import torch

from engine import decode_bench_args, native_on_smollm2, timed_call  # bench/
from limits import MemoryReader  # bench/
from machine import cpu_model  # bench/

ROOT = Path(__file__).resolve().parent


def place_weights(model, huge: bool) -> None:
    """The model's weights on huge pages (as the engine places them) or copied onto the heap."""
    from colorl.engines.native.host_memory import mapped_tensors

    params = dict(model.named_parameters())
    dtype = next(iter(params.values())).dtype
    placed = mapped_tensors({n: tuple(p.shape) for n, p in params.items()}, dtype) if huge else {}
    for name, param in params.items():
        param.data = placed[name].copy_(param.data) if huge else param.data.clone()


@contextlib.contextmanager
def panel_rows(value: str | None):
    """COLORL_CPU_DECODE_PANEL_ROWS for the steps inside (None: unset, the race decides)."""
    name = "COLORL_CPU_DECODE_PANEL_ROWS"
    before = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if before is not None:
            os.environ[name] = before


def timed_steps(engine, prompt: list[int], batch: int, tag: str, compiled_sampler: bool,
                head_in_call: bool = True, burst: int = 1) -> dict:
    """One decode run of `batch` sequences: median step, forward and sampling times (ms) after a warm-up; burst:
    decode steps per engine call (engine.decode_burst; a step of a burst counts the call's time over its steps,
    and then no forward or sampling is timed: the burst's call does both)."""
    import dataclasses

    from colorl.engines.base import GenerationRequest, SamplingParams

    forward, sample = [], []
    model_forward, sampler, prepare = engine.model.forward, engine.sampler, engine.runner.prepare

    def timed_forward(*args, **kwargs):
        started = time.perf_counter()
        try:
            return model_forward(*args, **kwargs)
        finally:
            forward.append(time.perf_counter() - started)

    def timed_sampler(logits, rows, compiled=None):
        started = time.perf_counter()
        try:
            return sampler(logits, rows, compiled if compiled_sampler else None)
        finally:
            sample.append(time.perf_counter() - started)

    def head_after_call(batch):  # the step's logits made after the layers' call, in Python
        step, rows = prepare(batch)
        return dataclasses.replace(step, every_token_samples=False), rows

    engine.model.forward, engine.sampler = timed_forward, timed_sampler
    if not head_in_call:
        engine.runner.prepare = head_after_call
    engine.decode_burst, bursts = burst, engine.decode_burst
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=30 if burst == 1 else 2 + 4 * burst, ignore_eos=True)
        for i in range(batch):
            engine.add(GenerationRequest(f"{tag}-{i}", prompt, params))
        engine.step()  # prefill
        steps = []
        while engine.has_unfinished():
            seconds, count = timed_call(engine, batch)
            steps += [seconds] * count
    finally:
        engine.model.forward, engine.sampler, engine.runner.prepare = model_forward, sampler, prepare
        engine.decode_burst = bursts
    skip = 3 if burst == 1 else burst  # the first call's steps: a warm-up
    if burst > 1:
        return {"step_ms": statistics.median(steps[skip:]) * 1e3}
    return {"step_ms": statistics.median(steps[skip:]) * 1e3, "forward_ms": statistics.median(forward[1 + skip:]) * 1e3,
            "sampling_ms": statistics.median(sample[1 + skip:]) * 1e3}


def main() -> None:
    args = decode_bench_args(__doc__, 1, 5, "1,4,8", "float32", ROOT / "results" / "decode_step.json")
    dtype = getattr(torch, args.dtype)
    engine, _, prompt = native_on_smollm2("decode_step", dtype)
    burst = engine.decode_burst
    reader = MemoryReader()
    batches = [int(b) for b in args.batches.split(",")]
    rounds = []
    for index in range(args.rounds):
        heap_sum, huge_sum = reader.each()
        record = {"heap_sum_gb_s": heap_sum / 1e9, "huge_sum_gb_s": huge_sum / 1e9}
        for batch in batches:
            for huge in (False, True):
                place_weights(engine.model, huge)
                for compiled_sampler in ((False, True) if huge else (True,)):
                    key = f"b{batch}_{'huge' if huge else 'heap'}_{'compiled' if compiled_sampler else 'torch'}_sampler"
                    with panel_rows(None):
                        record[key] = timed_steps(engine, prompt, batch, f"{index}-{key}", compiled_sampler)
            for products, value in (("rows_kernel", "none"), ("panels", "all")):
                with panel_rows(value):
                    key = f"b{batch}_huge_{products}"
                    record[key] = timed_steps(engine, prompt, batch, f"{index}-{key}", True)
            key = f"b{batch}_huge_head_in_python"
            with panel_rows(None):
                record[key] = timed_steps(engine, prompt, batch, f"{index}-{key}", True, head_in_call=False)
                key = f"b{batch}_huge_bursts"
                record[key] = timed_steps(engine, prompt, batch, f"{index}-{key}", True, burst=burst)
        rounds.append(record)
    place_weights(engine.model, True)

    summary = {}
    print(f"{cpu_model()}, {args.threads} threads, {args.dtype}, SmolLM2-135M, {args.rounds} rounds (median of per-round ratios)")
    print(f"sum of 512 MiB: heap pages {statistics.median(r['heap_sum_gb_s'] for r in rounds):.1f} GB/s, huge pages "
          f"{statistics.median(r['huge_sum_gb_s'] for r in rounds):.1f} GB/s, huge / heap "
          f"{statistics.median(r['huge_sum_gb_s'] / r['heap_sum_gb_s'] for r in rounds):.2f}x")
    print("| batch | step, heap pages | step, huge pages | heap / huge | sampling, torch | sampling, compiled | torch / compiled "
          "| step, rows kernel | step, panels | rows kernel / panels | step, head in Python | head in Python / in the call "
          f"| forward share of the step | step, bursts of {burst} | one per call / bursts |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for batch in batches:
        heap, huge, torch_sampler = (f"b{batch}_heap_compiled_sampler", f"b{batch}_huge_compiled_sampler",
                                     f"b{batch}_huge_torch_sampler")
        row = {
            "step_heap_ms": statistics.median(r[heap]["step_ms"] for r in rounds),
            "step_huge_ms": statistics.median(r[huge]["step_ms"] for r in rounds),
            "pages_speedup": statistics.median(r[heap]["step_ms"] / r[huge]["step_ms"] for r in rounds),
            "sampling_torch_ms": statistics.median(r[torch_sampler]["sampling_ms"] for r in rounds),
            "sampling_compiled_ms": statistics.median(r[huge]["sampling_ms"] for r in rounds),
            "sampler_speedup": statistics.median(r[torch_sampler]["sampling_ms"] / r[huge]["sampling_ms"] for r in rounds),
            "step_rows_kernel_ms": statistics.median(r[f"b{batch}_huge_rows_kernel"]["step_ms"] for r in rounds),
            "step_panels_ms": statistics.median(r[f"b{batch}_huge_panels"]["step_ms"] for r in rounds),
            "panels_speedup": statistics.median(r[f"b{batch}_huge_rows_kernel"]["step_ms"] / r[f"b{batch}_huge_panels"]["step_ms"]
                                                for r in rounds),
            "step_head_in_python_ms": statistics.median(r[f"b{batch}_huge_head_in_python"]["step_ms"] for r in rounds),
            "head_in_call_speedup": statistics.median(r[f"b{batch}_huge_head_in_python"]["step_ms"] / r[huge]["step_ms"]
                                                      for r in rounds),
            "forward_share": statistics.median(r[huge]["forward_ms"] / r[huge]["step_ms"] for r in rounds),
            "step_bursts_ms": statistics.median(r[f"b{batch}_huge_bursts"]["step_ms"] for r in rounds),
            "bursts_speedup": statistics.median(r[huge]["step_ms"] / r[f"b{batch}_huge_bursts"]["step_ms"] for r in rounds),
        }
        summary[batch] = row
        print(f"| {batch} | {row['step_heap_ms']:.1f} ms | {row['step_huge_ms']:.1f} ms | {row['pages_speedup']:.2f}x | "
              f"{row['sampling_torch_ms']:.2f} ms | {row['sampling_compiled_ms']:.2f} ms | {row['sampler_speedup']:.1f}x | "
              f"{row['step_rows_kernel_ms']:.1f} ms | {row['step_panels_ms']:.1f} ms | {row['panels_speedup']:.2f}x | "
              f"{row['step_head_in_python_ms']:.1f} ms | {row['head_in_call_speedup']:.2f}x | "
              f"{100 * row['forward_share']:.0f} % | {row['step_bursts_ms']:.1f} ms | {row['bursts_speedup']:.2f}x |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": cpu_model(), "threads": args.threads, "dtype": args.dtype, "burst": burst,
                               "summary": summary, "rounds": rounds},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
