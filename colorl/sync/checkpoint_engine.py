"""The checkpoint engine: moves the trainer's FSDP2 shards into every rank's inference engine.

Per switch (`sync`), for each bucket of the fixed layout (colorl/sync/buckets.py):

    pack    this rank's rows of every tensor in the bucket -> its segment of the flat bucket
    gather  every rank broadcasts its segment to all (= an all-gather of the bucket)
    write   the engine copies each tensor's rows out of the bucket into its live weights, in place

Two bucket buffers (slots) are used in turn, so at most two buckets are in flight and the extra
memory is two gathered buckets of at most `sync.bucket_mb`. How the gather is done:
- CUDA: one in-place `all_gather_into_tensor` per bucket, async, on NCCL's own stream (the side
  stream): bucket k+1 travels while the compute stream writes bucket k.
- CPU, ranks on one host (colorl's case): the slots live in /dev/shm, mapped by every rank. Each
  rank packs its segment straight into the shared bucket; after a barrier every rank reads the
  whole bucket. Nothing crosses a socket: half the time of the gloo path on this kind of host.
- CPU otherwise (or `shared_memory=False`): one async gloo broadcast per rank into the bucket
  (gloo's all-gather would stage through a second buffer); bucket k+1 is packed and sent while
  bucket k is written.
- World size 1: gathering is the identity; `sync` copies the trainer's tensors straight into the
  engine, bucket by bucket.
On CPU the slots are kept between syncs (first-touch page faults cost more than the copies).

Engines whose `named_weights()` are live tensors (native, hf) are written in place through them,
then their `version` is set (the native engine drops its prefix cache on a version change). An
engine that can only take whole tensors (SGLang: `update_weights_from_tensor`) returns meta
tensors from `named_weights()` — used for the start-up check only — and receives, once per
bucket, the (name, full tensor) pairs that bucket completed through `load_weights`; the tensors
may be views into the bucket or the trainer, valid during the call only.

Bounded-lag mode splits the same transfer in two: `publish(version)` gathers on the trainer
thread into a `StagedUpdate` that keeps its buckets; the rollout thread calls
`apply_pending(engine)` at a step boundary (the newest published version wins).

`enable_verification()` (on in `colorl doctor`) follows every sync and every applied version with
the bit-exact comparison of the engine's weights with the trainer's (colorl/sync/verify.py).
"""
from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from colorl.engines.base import Engine
from colorl.sync.buckets import (
    Assembler, Bucket, ShardedParam, copy_rows, local_blocks, pack, plan_buckets, row_blocks,
)
from colorl.sync.lora import LoraTarget, find_lora_targets, is_adapter_param, merge_into
from colorl.sync.name_maps import NameMap, NameMapError, TensorSpec, name_map_for, route
from colorl.sync.verify import SyncVerifier

if TYPE_CHECKING:
    from colorl.config import LoraConfig, SyncConfig

Blocks = Iterable[tuple[int, int, torch.Tensor]]  # one bucket: (param index, first row, rows)
SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class SyncStats:
    """One transfer, as logged per step (metrics.jsonl: time_sync_s, sync_bytes, sync_gb_per_s)."""

    version: int
    time_sync_s: float
    bytes_moved: int  # bytes of the buckets this rank received (padding of uneven shards included)
    buckets: int

    @property
    def gb_per_s(self) -> float:
        return self.bytes_moved / self.time_sync_s / 1e9 if self.time_sync_s > 0 else 0.0


@dataclass
class StagedUpdate:
    """A published version whose gathered buckets wait for the engine's next step boundary.

    Keeps one gathered copy of everything that travels (the whole model; with LoRA only the
    adapters) until `apply` writes it into an engine. Applying twice is harmless.
    """

    version: int
    buckets: list[tuple[Bucket, torch.Tensor]]
    stats: SyncStats  # the gather, on the trainer side
    owner: "CheckpointEngine" = field(repr=False)
    expected: dict[str, torch.Tensor] | None = field(default=None, repr=False)  # with verification on
    # CUDA: recorded on the trainer's stream once the buckets are written; None on CPU
    written: "torch.cuda.Event | None" = field(default=None, repr=False)

    def apply(self, engine: Engine) -> SyncStats:
        """Write into `engine` and set its version; only where the engine is between steps.

        On CUDA the copies are queued on the caller's stream (the rollout thread's): it waits for
        the trainer's stream only up to the moment the buckets were written (an event, not the
        whole stream), and the buckets are marked as used by it, so the caching allocator does not
        hand their memory out again before these copies ran — no CPU-side synchronize."""
        start = time.perf_counter()
        if self.written is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(self.written)
            for _, flat in self.buckets:
                flat.record_stream(stream)
        specs = self.owner._plan.specs
        self.owner._write(engine, (row_blocks(bucket, specs, flat) for bucket, flat in self.buckets))
        engine.version = self.version
        stats = SyncStats(self.version, time.perf_counter() - start, self.stats.bytes_moved, len(self.buckets))
        if self.expected is not None:
            self.owner.verifier.check(engine, self.expected, self.version)
        return stats


class _Mesh:
    """The 1-D FSDP mesh the shards live on (world 1 and no group for an unsharded model)."""

    def __init__(self, params: Sequence[tuple[str, torch.Tensor]]):
        dtensors = [(name, p) for name, p in params if isinstance(p, DTensor)]
        if not dtensors:
            self.group, self.rank, self.world = None, 0, 1
            return
        if len(dtensors) != len(params):
            plain = next(name for name, p in params if not isinstance(p, DTensor))
            raise ValueError(f"checkpoint engine: {plain} is not sharded while other parameters are")
        mesh = dtensors[0][1].device_mesh
        for name, p in dtensors:
            if p.device_mesh != mesh or tuple(p.placements) != (Shard(0),):
                raise ValueError(
                    f"checkpoint engine: {name} is sharded as {p.placements} on {p.device_mesh}; "
                    f"only FSDP2's Shard(0) on one 1-D mesh is supported"
                )
        self.group, self.rank, self.world = mesh.get_group(), mesh.get_local_rank(), mesh.size()


class _Plan:
    """Tensors that travel together: their shard geometry, live parameters and bucket layout.

    The parameters are the FSDP2 sharded ones the optimizer updates, kept from start-up: they
    hold the current values even while FSDP has the unsharded ones registered on the module.
    """

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]], mesh: _Mesh, bucket_bytes: int):
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.specs = [ShardedParam(name, tuple(p.shape), p.dtype, mesh.world) for name, p in named]
        for spec, shard in zip(self.specs, self.local_shards()):
            rows = shard.shape[0] if shard.dim() else 1
            if rows != spec.local_rows(mesh.rank):
                raise ValueError(
                    f"checkpoint engine: {spec.name} has {rows} local rows on rank {mesh.rank}, expected "
                    f"{spec.local_rows(mesh.rank)} (FSDP2 chunking of {spec.rows} rows over {mesh.world})"
                )
        self.buckets = plan_buckets(self.specs, bucket_bytes)

    def local_shards(self) -> list[torch.Tensor]:
        with torch.no_grad():
            return [p.to_local() if isinstance(p, DTensor) else p.detach() for p in self.params]

    def full_specs(self) -> dict[str, TensorSpec]:
        return {spec.name: TensorSpec(spec.shape, spec.dtype) for spec in self.specs}

    @property
    def nbytes(self) -> int:
        return sum(bucket.nbytes for bucket in self.buckets)


def _writes_in_place(weights: Mapping[str, torch.Tensor]) -> bool:
    """Live `named_weights()` are targets for in-place loads; meta ones mean whole tensors only."""
    return not any(tensor.is_meta for tensor in weights.values())


class CheckpointEngine:
    """Built once at start-up on every rank (collective); then `sync` after each optimizer step.

    `model`: the FSDP2-sharded trainer model (a peft model with LoRA) or, at world size 1, the
    plain one. `cfg`: SyncConfig. `lora`: the run's LoRA config or None; it must agree with the
    model. With LoRA, construction moves the frozen base weights once, keeps the adapted ones
    (W0) for merging, and writes W0 + s·BA of the current adapters into the engine.
    `shared_memory`: on CPU, gather through /dev/shm when every rank runs on this host (None,
    the default) or never (False: gloo broadcasts).
    """

    def __init__(self, model: nn.Module, engine: Engine, cfg: SyncConfig, lora: LoraConfig | None = None,
                 shared_memory: bool | None = None):
        named = list(model.named_parameters())
        self._model = model
        self._mesh = _Mesh(named)
        self._bucket_bytes = int(cfg.bucket_mb * 2**20)
        self._name_map: NameMap = name_map_for(model.config.model_type)
        self._lora: list[LoraTarget] = find_lora_targets(model)
        if bool(self._lora) != (lora is not None):
            raise ValueError(
                "checkpoint engine: model.lora is set but the model has no LoRA layers" if lora is not None
                else "checkpoint engine: the model has LoRA layers but model.lora is not set"
            )
        engine_weights = engine.named_weights()
        self.device = self._device(engine_weights, named)
        self._engine_specs = {name: TensorSpec.of(t) for name, t in engine_weights.items()}
        self._slots: list[torch.Tensor] = []
        self._shared = False
        if self.device.type == "cpu" and self._mesh.world > 1 and shared_memory is not False:
            self._shared = _can_share_memory(self._mesh, 2 * self._bucket_bytes)
        self._lock = threading.Lock()
        self._pending: StagedUpdate | None = None
        self._w0: dict[str, torch.Tensor] = {}
        self.verifier: SyncVerifier | None = None  # the bit-exact check after each sync, when enabled
        if not self._lora:
            self._plan = _Plan(named, self._mesh, self._bucket_bytes)
            self._routes = route(self._name_map, self._plan.full_specs(), self._engine_specs)
            return

        trainable = [name for name, p in named if p.requires_grad and not is_adapter_param(name)]
        if trainable:
            raise NotImplementedError(f"LoRA sync moves adapters only, but base weight {trainable[0]} is trainable")
        base = _Plan([(n, p) for n, p in named if not is_adapter_param(n)], self._mesh, self._bucket_bytes)
        self._plan = _Plan([(n, p) for n, p in named if is_adapter_param(n)], self._mesh, self._bucket_bytes)
        self._routes = route(self._name_map, base.full_specs(), self._engine_specs)
        adapters = self._plan.full_specs()
        for target in self._lora:
            w0, a, b = self._engine_specs[target.engine_name], adapters[target.a_name], adapters[target.b_name]
            # peft keeps adapters in float32 over a bf16/fp16 base (autocast_adapter_dtype): the
            # merge computes in the adapters' dtype and rounds once into the engine's
            if w0.shape != (b.shape[0], a.shape[1]) or a.dtype != b.dtype:
                raise NameMapError(
                    f"LoRA target {target.engine_name} is {w0} in the engine but B @ A is "
                    f"{TensorSpec((b.shape[0], a.shape[1]), a.dtype)}"
                )
            self._w0[target.engine_name] = torch.empty(w0.shape, dtype=w0.dtype, device=self.device)
        self._write_plan(engine, base, self._stream(base), keep_w0=True)
        self._write(engine, self._stream(self._plan))

    def enable_verification(self) -> SyncVerifier:
        """From now on every sync (and every applied published version) is followed by the bit-exact
        check of colorl/sync/verify.py; a difference raises WeightMismatch. Costs a copy of the weights."""
        self.verifier = SyncVerifier(self._model, self._name_map, self._lora, self._engine_specs)
        return self.verifier

    @property
    def transport(self) -> str:
        """How buckets travel: "local" (world size 1), "shared_memory" (/dev/shm, ranks of one
        node) or "process_group" (collectives)."""
        return "local" if self._mesh.world == 1 else "shared_memory" if self._shared else "process_group"

    @property
    def buckets(self) -> list[Bucket]:
        """The fixed layout of what travels at each sync (with LoRA: the adapters)."""
        return self._plan.buckets

    # -- colocated mode --------------------------------------------------------------------------

    def sync(self, engine: Engine, version: int) -> SyncStats:
        """Gather every bucket into `engine` and set its version (collective: all ranks call it)."""
        start = time.perf_counter()
        self._write(engine, self._stream(self._plan))
        engine.version = version
        stats = SyncStats(version, time.perf_counter() - start, self._plan.nbytes, len(self._plan.buckets))
        if self.verifier is not None:
            self.verifier.check(engine, self.verifier.expected(), version)
        return stats

    # -- bounded-lag mode ------------------------------------------------------------------------

    def publish(self, version: int) -> StagedUpdate:
        """Gather `version` into a StagedUpdate and make it the pending one (collective)."""
        start = time.perf_counter()
        buckets = [(bucket, flat.clone()) for bucket, flat in self._gathered(self._plan)]
        stats = SyncStats(version, time.perf_counter() - start, self._plan.nbytes, len(buckets))
        expected = self.verifier.expected() if self.verifier is not None else None
        written = None
        if buckets and buckets[0][1].is_cuda:
            written = torch.cuda.Event()
            written.record()  # on the trainer's stream, after the gathers and clones
        staged = StagedUpdate(version, buckets, stats, self, expected, written)
        with self._lock:
            self._pending = staged
        return staged

    def apply_pending(self, engine: Engine) -> SyncStats | None:
        """At an engine step boundary (rollout thread): apply the newest published version, if any."""
        with self._lock:
            staged, self._pending = self._pending, None
        if staged is None:
            return None
        return staged.apply(engine)

    @property
    def pending_version(self) -> int | None:
        with self._lock:
            return self._pending.version if self._pending is not None else None

    # -- transfer --------------------------------------------------------------------------------

    @staticmethod
    def _device(engine_weights, named) -> torch.device:
        """Buckets live where the engine's weights are (the trainer's device for a meta-only engine)."""
        for tensor in engine_weights.values():
            if not tensor.is_meta:
                return tensor.device
        first = named[0][1]
        return (first.to_local() if isinstance(first, DTensor) else first).device

    def _stream(self, plan: _Plan) -> Iterator[Blocks]:
        """Each bucket's row blocks, gathered from every rank (at world size 1: the tensors' own)."""
        if self._mesh.world == 1:
            local = plan.local_shards()
            return (local_blocks(bucket, plan.specs, local) for bucket in plan.buckets)
        return (row_blocks(bucket, plan.specs, flat) for bucket, flat in self._gathered(plan))

    def _gathered(self, plan: _Plan) -> Iterator[tuple[Bucket, torch.Tensor]]:
        """(bucket, gathered flat tensor) in plan order; each view is valid until the next one."""
        if not plan.buckets:
            return iter(())
        gather = _gather_in_shared_memory if self._shared else _gather_by_broadcast
        return gather(self._mesh, plan, self._slots_for(plan))

    def _slots_for(self, plan: _Plan) -> list[torch.Tensor]:
        """The two bucket buffers; kept for the per-sync plan on CPU, where first-touch page faults
        cost more than the copies; on CUDA the caching allocator keeps them cheap to re-take."""
        size = max(bucket.nbytes for bucket in plan.buckets)
        if plan is self._plan and self._slots and self._slots[0].numel() >= size:
            return self._slots
        if self._shared:
            slots = _shared_slots(self._mesh, size)
        else:
            slots = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        if plan is self._plan and self.device.type == "cpu":
            self._slots = slots
        return slots

    def _write(self, engine: Engine, stream: Iterable[Blocks]) -> None:
        """Put one version into `engine`: the tensors themselves, or with LoRA the merged adapters."""
        if not self._lora:
            self._write_plan(engine, self._plan, stream)
            return
        adapters = [torch.empty(spec.shape, dtype=spec.dtype, device=self.device) for spec in self._plan.specs]
        _unpack(stream, [[t] for t in adapters], [[] for _ in adapters], self._plan, engine)
        by_name = dict(zip(self._plan.names, adapters))
        merged = ((t, by_name[t.a_name], by_name[t.b_name]) for t in self._lora)
        weights = engine.named_weights()
        if _writes_in_place(weights):
            with torch.no_grad():
                for target, a, b in merged:
                    w = self._checked(weights, target.engine_name)
                    merge_into(w, self._w0[target.engine_name], a, b, target.scaling)
            return
        pairs, size = [], 0  # merged weights handed over in groups of about one bucket
        for target, a, b in merged:
            w0 = self._w0[target.engine_name]
            pairs.append((target.engine_name, merge_into(torch.empty_like(w0), w0, a, b, target.scaling)))
            size += w0.nbytes
            if size >= self._bucket_bytes:
                engine.load_weights(pairs)
                pairs, size = [], 0
        if pairs:
            engine.load_weights(pairs)

    def _write_plan(self, engine: Engine, plan: _Plan, stream: Iterable[Blocks], keep_w0: bool = False) -> None:
        """Route each tensor to its engine weights (in place) or to `load_weights` (per bucket).

        `keep_w0`: the LoRA base pass, where adapted weights go to the kept W0 copies instead.
        Without LoRA the plan covers every engine weight (checked at start-up), so this is a full
        load: an engine that released its weights while asleep takes them back through it.
        """
        weights = engine.named_weights() if self._lora else engine.full_load_targets()
        in_place = _writes_in_place(weights)
        copies: list[list[torch.Tensor]] = []
        emits: list[list[str]] = []
        for name in plan.names:
            engine_names = self._routes[name]
            if keep_w0 and engine_names[0] in self._w0:
                copies.append([self._w0[engine_names[0]]])
                emits.append([])
            elif in_place:
                copies.append([self._checked(weights, n) for n in engine_names])  # copy_ casts
                emits.append([])
            else:
                copies.append([])
                emits.append([(n, self._engine_specs[n].dtype) for n in engine_names])
        _unpack(stream, copies, emits, plan, engine)

    def _checked(self, weights: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
        """An engine weight by name, re-checked: an engine may reallocate its weights on wake."""
        tensor = weights.get(name)
        if tensor is None or TensorSpec.of(tensor) != self._engine_specs[name]:
            found = "missing" if tensor is None else str(TensorSpec.of(tensor))
            raise NameMapError(f"engine weight {name} is {found}, was {self._engine_specs[name]} at start-up")
        return tensor


def _pack_into(mesh: _Mesh, plan: _Plan, local: Sequence[torch.Tensor], bucket: Bucket, raw: torch.Tensor) -> int:
    """Pack this rank's segment of `bucket` into its place in `raw` (bytes); return the segment size."""
    segment_bytes = bucket.segment_numel * bucket.dtype.itemsize
    own = raw[mesh.rank * segment_bytes : (mesh.rank + 1) * segment_bytes].view(bucket.dtype)
    pack(bucket, plan.specs, local, mesh.rank, own)
    return segment_bytes


def _gather_by_broadcast(mesh: _Mesh, plan: _Plan, slots: list[torch.Tensor]) -> Iterator[tuple[Bucket, torch.Tensor]]:
    """Collectives, two buckets in flight: bucket k+1 is packed into the slot of bucket k-1 (which
    the consumer has finished with when this generator resumes) and its gather started before
    bucket k is handed out. CUDA: one in-place all-gather on NCCL's stream; CPU: one async gloo
    broadcast per rank (gloo's all-gather would stage through a second buffer)."""
    local = plan.local_shards()
    in_flight: deque[tuple[Bucket, torch.Tensor, list[dist.Work]]] = deque()

    def launch(k: int) -> None:
        bucket = plan.buckets[k]
        raw = slots[k % 2][: bucket.nbytes]
        seg = _pack_into(mesh, plan, local, bucket, raw)
        if mesh.world == 1:  # publish at world size 1: the packed bucket is the gathered one
            works = []
        elif raw.is_cuda:
            own = raw[mesh.rank * seg : (mesh.rank + 1) * seg]
            works = [dist.all_gather_into_tensor(raw, own, group=mesh.group, async_op=True)]
        else:
            works = [dist.broadcast(raw[r * seg : (r + 1) * seg], group=mesh.group, group_src=r, async_op=True)
                     for r in range(mesh.world)]
        in_flight.append((bucket, raw, works))

    launch(0)
    for k in range(len(plan.buckets)):
        if k + 1 < len(plan.buckets):
            launch(k + 1)
        bucket, raw, works = in_flight.popleft()
        for work in works:
            work.wait()
        yield bucket, raw.view(bucket.dtype)


def _gather_in_shared_memory(mesh: _Mesh, plan: _Plan, slots: list[torch.Tensor]) -> Iterator[tuple[Bucket, torch.Tensor]]:
    """Ranks of one host: each packs its segment into a shared slot, and after a barrier every rank
    reads the whole bucket from it. No bytes cross a socket; what remains is the pack and the
    unpack. Barrier k+1 is entered once bucket k+1 is packed and bucket k has been read, so a
    slot is never rewritten while another rank still reads it."""
    local = plan.local_shards()
    _pack_into(mesh, plan, local, plan.buckets[0], slots[0])
    barrier = dist.barrier(group=mesh.group, async_op=True)
    for k, bucket in enumerate(plan.buckets):
        barrier.wait()  # every rank packed bucket k and has read bucket k-1
        if k + 1 < len(plan.buckets):
            _pack_into(mesh, plan, local, plan.buckets[k + 1], slots[(k + 1) % 2])
        yield bucket, slots[k % 2][: bucket.nbytes].view(bucket.dtype)
        barrier = dist.barrier(group=mesh.group, async_op=True)
    barrier.wait()  # the next sync may rewrite slot 0 only once every rank is done


def _shared_slots(mesh: _Mesh, size: int) -> list[torch.Tensor]:
    """Two `size`-byte slots in one /dev/shm file mapped by every rank (collective); the file is
    unlinked at once, so the memory goes away with the last mapping."""
    name = [f"{SHM_DIR}/colorl-sync-{os.getpid()}-{uuid.uuid4().hex[:12]}" if mesh.rank == 0 else None]
    dist.broadcast_object_list(name, group=mesh.group, group_src=0)
    if mesh.rank == 0:
        shared = torch.from_file(name[0], shared=True, size=2 * size, dtype=torch.uint8)
    dist.barrier(group=mesh.group)
    if mesh.rank != 0:
        shared = torch.from_file(name[0], shared=True, size=2 * size, dtype=torch.uint8)
    dist.barrier(group=mesh.group)
    if mesh.rank == 0:
        os.unlink(name[0])
    return [shared[:size], shared[size:]]


def node_id() -> tuple[str, str]:
    """Which node this rank belongs to: host name and torchrun's node index (GROUP_RANK), so
    two torchrun "nodes" on one host still count as two (colorl's own launcher: one node)."""
    return socket.gethostname(), os.environ.get("GROUP_RANK", "0")


def _can_share_memory(mesh: _Mesh, need_bytes: int) -> bool:
    """Every rank runs on this node and /dev/shm has room for the slots (collective)."""
    free = 0
    if os.path.isdir(SHM_DIR):
        stat = os.statvfs(SHM_DIR)
        free = stat.f_bavail * stat.f_frsize
    views: list = [None] * mesh.world
    dist.all_gather_object(views, (node_id(), free >= need_bytes), group=mesh.group)
    return len({node for node, _ in views}) == 1 and all(ok for _, ok in views)


def _unpack(stream: Iterable[Blocks], copies: Sequence[Sequence[torch.Tensor]],
            emits: Sequence[Sequence[tuple[str, torch.dtype]]], plan: _Plan, engine: Engine) -> None:
    """Copy rows into `copies[i]` in place; hand whole tensors `emits[i]` (engine name, the dtype it
    serves) to the engine per bucket, cast where the engine serves another dtype."""
    assembler = Assembler(plan.specs)
    with torch.no_grad():
        for blocks in stream:
            pairs = []
            for index, row, block in blocks:
                for target in copies[index]:
                    copy_rows(target, row, block)
                if emits[index]:
                    full = assembler.add(index, row, block)
                    if full is not None:
                        pairs.extend((name, full if full.dtype == dtype else full.to(dtype))
                                     for name, dtype in emits[index])
            if pairs:
                engine.load_weights(pairs)


def naive_sync(model: nn.Module, engine: Engine, version: int) -> SyncStats:
    """Baseline and oracle: per-parameter `full_tensor()`, then one state-dict load into the engine."""
    start = time.perf_counter()
    name_map = name_map_for(model.config.model_type)
    if find_lora_targets(model):
        raise NotImplementedError("naive_sync moves full weights; it does not merge LoRA adapters")
    state: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            state[name_map.engine_name(name)] = p.full_tensor() if isinstance(p, DTensor) else p.detach()
    weights = engine.named_weights()
    for engine_name, source in name_map.tied:
        if engine_name in weights and engine_name not in state and source in state:
            state[engine_name] = state[source]
    engine.update_weights(state.items(), version)
    return SyncStats(version, time.perf_counter() - start, sum(t.nbytes for t in state.values()), 0)
