"""Checkpoint-engine benchmark (issue 4): bucketed, pipelined sync vs the naive path vs memcpy.

    python bench/sync.py            # smollm2 and a random ~0.5B Llama; native and hf engines; world 1, 2
    python bench/sync.py --models smollm2 --engines native --worlds 2 --bucket-mb 64 --repeats 5

For each model, engine and world size, every rank holds an FSDP2-sharded trainer model and an
engine: `native` (the default rollout engine; it keeps linear weights transposed, so every copy
into it transposes) or `hf` (row-major HF modules). Per rank, as the median of --repeats
interleaved runs (one thread per rank; the machine is shared):
- `sync`: CheckpointEngine.sync (all-gather of flat buckets, written in place into the engine),
  at world size 2 through /dev/shm (`shm`, the default on one host) and gloo broadcasts (`gloo`);
- `naive`: naive_sync, per-parameter `full_tensor()` then a state-dict load into the engine;
- `memcpy`: a plain copy of the same number of bytes between preallocated buffers.
It also checks the engine bit for bit after `sync` and measures the peak extra memory of the
first sync (torch allocations on the syncing thread). Rows merge into bench/results/sync.json;
each row is the slowest rank's.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from colorl.config import EngineConfig, SyncConfig
from colorl.distributed import run_world
from colorl.engines.hf import HFEngine
from colorl.engines.native.engine import NativeEngine
from colorl.models import SMOLLM2_ALIAS, cache_root, load_model, resolve_model_path
from colorl.sync import CheckpointEngine, naive_sync
from colorl.train.fsdp import make_mesh, shard_model

RESULTS = Path(__file__).parent / "results" / "sync.json"
# ~0.5B class (454M parameters, 1.8 GB in fp32) in the Llama layout, random weights: no download.
LLAMA_05B = dict(vocab_size=32000, hidden_size=1280, intermediate_size=3456, num_hidden_layers=24,
                 num_attention_heads=20, num_key_value_heads=4, max_position_embeddings=2048,
                 tie_word_embeddings=True)


def model_folder(name: str) -> Path:
    """A HF folder per benchmark model; the random 0.5B one is saved once into the colorl cache."""
    if name == "smollm2":
        return resolve_model_path(SMOLLM2_ALIAS)
    folder = cache_root() / "bench" / name
    if not (folder / "config.json").is_file():
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        config = AutoConfig.for_model("llama", **LLAMA_05B)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def build_engine(kind: str, folder: Path):
    if kind == "hf":
        return HFEngine(folder, EngineConfig(), "cpu", torch.float32)
    return NativeEngine(folder, EngineConfig(num_blocks=4, max_num_seqs=1), "cpu", torch.float32)


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def memcpy_fn(nbytes: int):
    """A plain copy of `nbytes` between preallocated buffers (in 256 MiB slices: bounded memory)."""
    chunk = min(nbytes, 256 * 2**20)
    src, dst = torch.ones(chunk, dtype=torch.uint8), torch.zeros(chunk, dtype=torch.uint8)

    def run() -> None:
        for start in range(0, nbytes, chunk):
            n = min(chunk, nbytes - start)
            dst[:n].copy_(src[:n])

    return run


def peak_extra_bytes(fn) -> int:
    """Peak of torch allocations minus frees on this thread while `fn` runs (profiler events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    level = peak = 0
    for event in events:
        level += event.nbytes()
        peak = max(peak, level)
    return peak


def worker(rank: int, world: int, name: str, folder: str, kind: str, bucket_mbs: list[float], repeats: int,
           out: str) -> None:
    torch.set_num_threads(1)  # the copies are memory-bound; the other core is shared with others
    engine = build_engine(kind, Path(folder))
    model = shard_model(load_model(Path(folder)), make_mesh("cpu"))
    live = engine.named_weights()
    model_bytes = sum(t.nbytes for t in live.values())
    version = iter(range(1, 10**6))

    transports = ["shm", "gloo"] if world > 1 else ["local"]
    ckpts, startup, peak = {}, {}, {}
    for key in itertools.product(transports, bucket_mbs):
        transport, mb = key
        start = time.perf_counter()
        ckpts[key] = CheckpointEngine(model, engine, SyncConfig(bucket_mb=mb), shared_memory=transport != "gloo")
        startup[key] = time.perf_counter() - start
        peak[key] = peak_extra_bytes(lambda: ckpts[key].sync(engine, next(version)))  # the first sync allocates
    # interleaved, so that load from other processes on this shared machine hits every method alike
    memcpy = memcpy_fn(model_bytes)
    times: dict = {"memcpy": [], "naive": [], **{key: [] for key in ckpts}}
    for _ in range(repeats):
        times["memcpy"].append(timed(memcpy))
        times["naive"].append(timed(lambda: naive_sync(model, engine, next(version))))
        for key, ckpt in ckpts.items():
            times[key].append(timed(lambda: ckpt.sync(engine, next(version))))
    t_memcpy, t_naive = statistics.median(times["memcpy"]), statistics.median(times["naive"])

    rows = []
    for (transport, mb), ckpt in ckpts.items():
        stats = ckpt.sync(engine, next(version))
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        bit_exact = all(torch.equal(live[n].reshape(-1).view(torch.int32), full[n].reshape(-1).view(torch.int32))
                        for n in full)
        del full
        t_sync = statistics.median(times[transport, mb])
        rows.append(dict(
            model=name, engine=kind, world=world, transport=transport, rank=rank,
            params=sum(t.numel() for t in live.values()), model_bytes=model_bytes, bucket_mb=mb,
            buckets=stats.buckets, bytes_moved=stats.bytes_moved, startup_s=startup[transport, mb],
            sync_s=t_sync, naive_s=t_naive, memcpy_s=t_memcpy,
            sync_gb_per_s=stats.bytes_moved / t_sync / 1e9, naive_gb_per_s=model_bytes / t_naive / 1e9,
            memcpy_gb_per_s=model_bytes / t_memcpy / 1e9, speedup_vs_naive=t_naive / t_sync,
            ratio_to_memcpy=t_sync / t_memcpy, peak_extra_mb=peak[transport, mb] / 2**20,
            two_buckets_mb=2 * max(b.nbytes for b in ckpt.buckets) / 2**20, bit_exact=bit_exact))
    Path(out, f"{rank}.json").write_text(json.dumps(rows))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,llama-0.5b")
    parser.add_argument("--worlds", default="1,2")
    parser.add_argument("--engines", default="native,hf")
    parser.add_argument("--bucket-mb", default="16,64", help="comma list; 64 is configs/quickstart.yaml's")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    bucket_mbs = [float(b) for b in args.bucket_mb.split(",")]
    rows = []
    for name, kind, world in itertools.product(args.models.split(","), args.engines.split(","),
                                               map(int, args.worlds.split(","))):
        with tempfile.TemporaryDirectory() as out:
            run_world(worker, world, name, str(model_folder(name)), kind, bucket_mbs, args.repeats, out)
            ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]
        for per_rank in zip(*ranks):
            row = dict(max(per_rank, key=lambda r: r["sync_s"]))  # the slowest rank bounds the switch
            row["bit_exact"] = all(r["bit_exact"] for r in per_rank)
            rows.append(row)
            print(f"{name:10s} {kind:6s} world={world} {row['transport']:5s} bucket={row['bucket_mb']:g}MB  sync {row['sync_s']:.3f}s "
                  f"({row['sync_gb_per_s']:.2f} GB/s)  naive {row['naive_s']:.3f}s  memcpy {row['memcpy_s']:.3f}s  "
                  f"= x{row['speedup_vs_naive']:.2f} vs naive, {row['ratio_to_memcpy']:.2f}x memcpy  "
                  f"peak +{row['peak_extra_mb']:.0f} MB (two buckets {row['two_buckets_mb']:.0f} MB)  "
                  f"bit-exact {row['bit_exact']}", flush=True)
    save(rows)


def save(rows: list[dict]) -> None:
    """Merge into bench/results/sync.json: a rerun replaces the rows of the same configuration."""
    def key(row: dict) -> tuple:
        return row["model"], row["engine"], row["world"], row["transport"], row["bucket_mb"]

    kept = json.loads(RESULTS.read_text())["rows"] if RESULTS.is_file() else []
    fresh = {key(row) for row in rows}
    merged = sorted([r for r in kept if key(r) not in fresh] + rows, key=key)
    machine = dict(cpus=os.cpu_count(), torch=torch.__version__, python=sys.version.split()[0])
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(dict(machine=machine, rows=merged), indent=2) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
