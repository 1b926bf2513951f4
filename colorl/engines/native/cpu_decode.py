"""The decode step's loops compiled for this CPU (cpu_decode.c, cpu_decode_loops.h), in float32 and
bfloat16: products over a few rows, paged attention over the block table, RoPE with the KV write,
residual add with RMSNorm, SiLU-gating.

Why: a decode step over 1-8 sequences is a string of matrix-vector products bound by memory
bandwidth, and the libraries torch ships read the weights at about half the bandwidth one core
reaches (oneDNN 15 GB/s, MKL 11 GB/s, against 24 GB/s for one sequential stream on the
project's Zen 4; bench/README.md, "The engines alone"). Around the products, the same step costs
about 40 torch operators per layer (norms, RoPE, the padded gather of every sequence's context
for SDPA, its mask): each is a dispatch of microseconds that does nanoseconds of work. In bf16
the torch path is slower still (its decode attention took 45 % of a step).

How it is built: on first use, with the machine's C compiler, for this CPU, into the user's cache, checked
in a child process before it is ever loaded here, and linked to torch's own OpenMP runtime
(cpu_build.py says how and why). No compiler, a failed build or check, a non-x86/ARM machine or
`COLORL_CPU_DECODE=0`: `load()` returns None, one line on stderr says why (`why_not()`; `colorl doctor
--kernels` too), and the engine runs torch's operators, with the same results to float32 rounding (to one
bf16 step in bf16; tests/engines/test_cpu_decode.py).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import statistics
import time
from typing import Callable, Iterable

import torch

from colorl.engines.native.host_memory import mapped_empty

MAX_ROWS = 8  # the rows kernel's limit: more rows make a product compute-bound, the panels' ground
MAX_PANEL_ROWS = 32  # the row counts raced one by one or between raced neighbours (a rollout batch decoding)
PREFILL_ROWS = 256  # raced for every count above MAX_PANEL_ROWS: prefill chunks, scoring, larger batches
_EVERY_ROWS = frozenset(range(1, MAX_PANEL_ROWS + 1)) | {PREFILL_ROWS}  # what COLORL_CPU_DECODE_ROWS may name
_EVERY_PANEL_ROWS = frozenset(range(1, MAX_ROWS + 1))  # ... and COLORL_CPU_DECODE_PANEL_ROWS
PANEL_RACE_ROWS = (12, 16, 24, 32, PREFILL_ROWS)  # the panel row counts raced; the counts between follow them
FEW_ROWS = 2  # products of this many rows or fewer ask for their weights ahead as the machine's race says
FEW_ROWS_ASKS = ("none", "nta", "l2")  # how (cpu_decode.c's ASK_*): not at all, non-temporally, into L2
PANEL_GROUP = 48  # outputs per group of the AVX-512 loops' panels (GROUP in cpu_decode_loops.h)
LAYER_MATRICES = ("w_qkv", "w_o", "w_gate_up", "w_down")  # a layer's matrices, each with its panels for many rows
# The race runs decoder layers of SmolLM2-135M's shapes, as a decode step does: the fused qkv, o, gate+up and down
# projections ([out, in]), with each sequence's attention over RACE_CONTEXT tokens. Kernels rank differently over
# them: over the down projection's long rows (K = 1536) 8 rows of x (48 KB in float32) leave L1 and the rows kernel
# reads them from L2 again for every weight row. On a Zen 4 at two threads it tied with the panels over [3072, 576]
# alone, the race's matrix until then, and got 8 rows; the decode step then took 1.23x the panels'
# (bench/README.md, "The race over whole decode steps").
RACE_MODEL = {"hidden": 576, "heads": 9, "kv_heads": 3, "head_dim": 64, "intermediate": 1536}
_C, _H, _HKV, _D, _I = RACE_MODEL.values()
RACE_LAYER = (((_H + 2 * _HKV) * _D, _C), (_C, _H * _D), (2 * _I, _C), (_C, _I))
RACE_CONTEXT = 64  # each raced sequence's context, in tokens
RACE_VOCAB = 8192  # the raced steps' LM head: about a fifth of their bytes, as SmolLM2's is of its steps'
RACE_BLOCK = 16  # tokens per KV block in the raced steps
RACE_LAYER_BYTES = 4 * sum(n_out * n_in for n_out, n_in in RACE_LAYER)  # one layer in float32, 14 MB
RACE_MIN_BYTES = 6 * RACE_LAYER_BYTES  # 85 MB: more than most last-level caches hold
RACE_MAX_BYTES = 2**30
RACE_ROUNDS = 3
# A run's decode steps are checked against their rows verdict (observe_decode) at most once in this many seconds:
# a check after a step that streamed the weights runs from cold caches, 0.1 ms, 1 % of a batch-1 step, and a
# window of VerdictWatch's five timings still fills in well under its ten seconds.
OBSERVE_EVERY_S = 0.05


@functools.cache
def race_bytes() -> int:
    """The weights a race item streams, in either dtype: twice what this CPU's last-level cache holds (at least
    RACE_MIN_BYTES, at most RACE_MAX_BYTES), so that they come from memory as a decode step's weights do. Over
    weights a cache holds other kernels win: on a Xeon with a 300 MB L3, MKL's products beat the loops' at
    1-2 rows over 85 MB and lost to them over 595 MB (bench/README.md, "Races over more than the cache")."""
    from colorl.machine import last_level_cache_bytes

    wanted = min(max(RACE_MIN_BYTES, 2 * (last_level_cache_bytes() or 0)), RACE_MAX_BYTES)
    return -(-wanted // RACE_LAYER_BYTES) * RACE_LAYER_BYTES


def race_weights(dtype: torch.dtype, size: int | None = None,
                 generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """The race's `dtype` matrices, layer after layer of RACE_LAYER: `size` bytes' worth of float32 ones
    (`race_bytes()`), the same bytes in either dtype. On small pages the rows kernel streamed them slower than the
    panels (which are on huge pages), and won fewer row counts than it wins in the engine's steps."""
    layers = (size or race_bytes()) // RACE_LAYER_BYTES * 4 // dtype.itemsize
    return [_race_matrix(shape, dtype, generator) for shape in RACE_LAYER * layers]


def _race_matrix(shape: tuple[int, int], dtype: torch.dtype, generator: torch.Generator | None) -> torch.Tensor:
    """A random race matrix on huge pages, as the engine's weights and every matrix's panels are, scaled so that a
    layer's outputs stay about unit."""
    matrix = mapped_empty(shape, dtype, huge=True)
    matrix.copy_(torch.randn(*shape, generator=generator) * _C**-0.5)
    return matrix


def race_inputs(rows: int, dtype: torch.dtype, generator: torch.Generator | None = None) -> dict[int, torch.Tensor]:
    """`rows` rows of x for each input width of RACE_LAYER, keyed by the width."""
    return {n_in: torch.randn(rows, n_in, generator=generator).to(dtype) for n_in in dict.fromkeys(
        n_in for _, n_in in RACE_LAYER)}


def race_products(product: Callable, xs: dict[int, torch.Tensor], weights: list[torch.Tensor],
                  operands: list[torch.Tensor] | None = None) -> Callable[[], list[torch.Tensor]]:
    """A race item's work: `product(x, operand, weight)` over each weight (its operand: the weight itself, or its
    panels), x of the weight's input width."""
    pairs = list(zip(weights, operands or weights))
    return lambda: [product(xs[weight.shape[1]], operand, weight) for weight, operand in pairs]

_p, _i64, _int, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class DecodeLayer(ctypes.Structure):
    """One decoder layer's tensors for `decode_layers` (cpu_decode.c's decode_layer_t): data pointers,
    None for an absent bias."""
    _fields_ = [(name, _p) for name in ("input_norm", "w_qkv", "b_qkv", "w_o", "b_o", "post_norm", "w_gate_up",
                                        "b_gate_up", "w_down", "b_down", "cache", "p_qkv", "p_o", "p_gate_up",
                                        "p_down")]


def layer_tensors(dtype: torch.dtype, cache: torch.Tensor, panels: dict[str, torch.Tensor] | None = None,
                  **tensors: torch.Tensor | None) -> DecodeLayer:
    """A layer's DecodeLayer, every tensor checked (`check_tensors`); the cache: [slots, 2, Hkv, D]; panels:
    each matrix's (`CpuDecode.pack_panels`, keyed w_qkv, w_o, w_gate_up, w_down) for steps of more than
    MAX_ROWS sequences, None for fewer."""
    check_tensors(dtype, cache=cache, **tensors)
    panels = panels or {}
    for name, packed in panels.items():
        check_tensors(dtype, **{name: packed})
        if packed.numel() != panel_elements(*tensors[name].shape):
            raise ValueError(f"compiled decode_layers: {name}'s panels do not match its matrix")
    return DecodeLayer(**{name: _ptr(tensor) for name, tensor in tensors.items()}, cache=cache.data_ptr(),
                       **{"p" + name[1:]: _ptr(packed) for name, packed in panels.items()})


def panel_elements(n_out: int, n_in: int) -> int:
    """The size of a [n_out, n_in] matrix's panels: n_out rounded up to whole groups of PANEL_GROUP outputs (the
    AVX-512 loops' groups; AVX2's pairs of panels, 16 outputs, fit in them), times n_in rounded up to whole pairs
    of k (the bf16 panels of a CPU with AVX512-BF16 hold k in pairs: cpu_decode_kpairs.h)."""
    return -(-n_out // PANEL_GROUP) * PANEL_GROUP * (n_in + n_in % 2)


class DecodeStep(ctypes.Structure):
    """A decode step's shapes and per-sequence inputs, the same for every layer (decode_step_t)."""
    _fields_ = [*((name, _i64) for name in ("tokens", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                            "width", "block_size", "num_slots", "num_positions")),
                *((name, _p) for name in ("cos", "sin", "positions", "slots", "tables", "lengths")),
                ("eps", _f32), ("scale", _f32), ("threads", _int)]


class DecodeHead(ctypes.Structure):
    """The final norm and LM head for `decode_layers`' logits (decode_head_t): data pointers, panels None for the rows
    kernel, and the vocabulary."""
    _fields_ = [("norm", _p), ("w", _p), ("p", _p), ("vocab", _i64)]


def head_tensors(dtype: torch.dtype, norm: torch.Tensor, head: torch.Tensor, panels: torch.Tensor | None) -> DecodeHead:
    """The model's final norm weight [C] and head [V, C] (with its panels when the step's products run over them)
    as `decode_layers` takes them to make a step's logits, every tensor checked."""
    check_tensors(dtype, norm=norm, head=head, panels=panels)
    if norm.shape != head.shape[1:] or (panels is not None and panels.numel() != panel_elements(*head.shape)):
        raise ValueError("compiled decode_layers: the final norm, the head and its panels do not agree")
    return DecodeHead(norm=norm.data_ptr(), w=head.data_ptr(), p=_ptr(panels), vocab=head.shape[0])


_SIGNATURES = {  # each is built once per dtype, named with its suffix
    "colorl_linear": ([_p, _p, _p, _p, _i64, _i64, _i64, _int], _int),
    "colorl_pack_panels": ([_p, _p, _i64, _i64, _int], None),
    "colorl_panels": ([_p, _p, _p, _p, _i64, _i64, _i64, _int], _int),
    "colorl_add_rms_norm": ([_p, _p, _p, _p, _i64, _i64, _f32], None),
    "colorl_silu_mul": ([_p, _p, _i64, _i64], None),
    "colorl_rope_write_kv": ([_p, _i64, _i64, _i64, _i64, _p, _p, _p, _p, _p, _i64, _i64], _int),
    "colorl_paged_decode": ([_p, _i64, _p, _p, _i64, _p, _p, _i64, _i64, _i64, _i64, _i64, _f32, _int, _i64], _int),
    "colorl_decode_layers": ([_p, _p, _p, ctypes.POINTER(DecodeLayer), _i64, ctypes.POINTER(DecodeStep)], _int),
    "colorl_decode_logits": ([_p, _p, _p, ctypes.POINTER(DecodeLayer), _i64, ctypes.POINTER(DecodeStep),
                              ctypes.POINTER(DecodeHead), _p], _int),
    "colorl_decode_burst": ([_p, _p, _p, ctypes.POINTER(DecodeLayer), _i64, ctypes.POINTER(DecodeStep),
                             ctypes.POINTER(DecodeHead), _p, _p, _p, _i64, _p, _p, _p, _p, _p, _p, _p], _int),
}
SUFFIXES = {torch.float32: "_f32", torch.bfloat16: "_bf16"}
DTYPES = tuple(SUFFIXES)  # what the loops take: every tensor of a call in one of these


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def check_tensors(dtype: torch.dtype, **tensors: torch.Tensor | None) -> None:
    """Every tensor handed to the loops as a plain pointer is a contiguous CPU tensor of `dtype` (None: an
    absent bias): the loops read memory as that layout, and anything else would give wrong numbers or
    read out of bounds. Raised, not asserted: `python -O` keeps it."""
    for name, tensor in tensors.items():
        if tensor is not None and (tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous()):
            raise ValueError(f"compiled decode loops: {name} must be a contiguous CPU {dtype} tensor, not "
                             f"{tensor.dtype} on {tensor.device}{'' if tensor.is_contiguous() else ', strided'}")


ERRORS = {-1: (ValueError, f"the rows kernel takes 1..{MAX_ROWS} rows, the panels any number with their panels"), -2: (MemoryError, "out of memory in the decode loops"),
          -3: (IndexError, "a block id, KV slot, position or context length outside the cache or the tables")}


def _raise_for(code: int) -> None:
    if code:
        kind, message = ERRORS.get(code, (RuntimeError, f"the decode loops failed ({code})"))
        raise kind(f"compiled decode loops: {message}")


def _timed(kind: str):
    """Adds the call's seconds to `self.seconds[kind]` while a bench collects them (torch's profiler
    does not see these calls)."""
    def wrap(method):
        @functools.wraps(method)
        def timed(self, *args):
            if self.seconds is None:
                return method(self, *args)
            started = time.perf_counter()
            try:
                return method(self, *args)
            finally:
                self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - started
        return timed
    return wrap


def race_steps(compiled: "CpuDecode", dtype: torch.dtype, weights: list[torch.Tensor], panels: list[torch.Tensor],
               counts: Iterable[int], generator: torch.Generator | None = None,
               copies: PanelCopies | None = None) -> dict[int, tuple[Callable, Callable]]:
    """For each row count, whole decode steps of that many sequences over the race's layers (`weights`, RACE_LAYER
    after RACE_LAYER), each sequence attending to RACE_CONTEXT tokens, then a RACE_VOCAB-row LM head: the layers'
    and the logits' one compiled call (`decode_layers`), as a step runs them, over the matrices' `panels` and over
    the rows kernel, in that order. Products called one by one from Python ranked the two loops otherwise than the
    engine's steps at close row counts (bench/README.md). The counts share the caches, the head and the layers;
    the head's panels are made by `copies` where given (after the layers', as the engine's)."""
    counts = list(counts)
    layers = len(weights) // len(RACE_LAYER)
    per_sequence = -(-(RACE_CONTEXT + 1) // RACE_BLOCK)  # blocks
    slots = max(counts) * per_sequence * RACE_BLOCK
    caches = [torch.randn(slots, 2, _HKV, _D, generator=generator).to(dtype) for _ in range(layers)]
    norm = torch.ones(_C, dtype=dtype)
    angles = torch.rand(RACE_CONTEXT + 1, _D, generator=generator)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    head = _race_matrix((RACE_VOCAB, _C), dtype, generator)
    head_panels = copies.of(head, compiled) if copies is not None else compiled.pack_panels(head)
    heads = (head_tensors(dtype, norm, head, head_panels), head_tensors(dtype, norm, head, None))
    arrays = tuple((DecodeLayer * layers)(*[
        layer_tensors(dtype, cache, dict(zip(LAYER_MATRICES, panels[4 * i:4 * i + 4])) if over_panels else None,
                      input_norm=norm, post_norm=norm, **dict(zip(LAYER_MATRICES, weights[4 * i:4 * i + 4])))
        for i, cache in enumerate(caches)]) for over_panels in (True, False))
    shared = (caches, norm, cos, sin, head, head_panels)  # what the layers' and the heads' raw pointers point into

    def steps_of(rows: int) -> tuple[Callable, Callable]:
        tables = torch.arange(rows * per_sequence, dtype=torch.int64).reshape(rows, per_sequence)
        lengths = torch.full((rows,), RACE_CONTEXT + 1, dtype=torch.int64)
        positions = torch.full((rows,), RACE_CONTEXT, dtype=torch.int64)
        write_at = tables[:, RACE_CONTEXT // RACE_BLOCK] * RACE_BLOCK + RACE_CONTEXT % RACE_BLOCK
        step = DecodeStep(tokens=rows, hidden=_C, heads=_H, kv_heads=_HKV, head_dim=_D, intermediate=_I,
                          width=per_sequence, block_size=RACE_BLOCK, num_slots=slots, num_positions=RACE_CONTEXT + 1,
                          cos=cos.data_ptr(), sin=sin.data_ptr(), positions=positions.data_ptr(),
                          slots=write_at.data_ptr(), tables=tables.data_ptr(), lengths=lengths.data_ptr(), eps=1e-5,
                          scale=_D**-0.5, threads=torch.get_num_threads())
        x0 = torch.randn(rows, _C, generator=generator).to(dtype)
        x, scratch = x0.clone(), torch.empty(decode_scratch_values(step, heads[0], dtype), dtype=dtype)

        def run(over_panels: int) -> Callable[[], torch.Tensor]:
            # the default keeps alive what the step's raw pointers point into
            def decode(_pointed_to=(shared, tables, lengths, positions, write_at)) -> torch.Tensor:
                x.copy_(x0)  # each step from the same stream
                return compiled.decode_layers(x, arrays[over_panels], step, scratch, heads[over_panels])
            return decode
        return run(0), run(1)
    return {rows: steps_of(rows) for rows in counts}


class CpuDecode:
    """The compiled library, called on contiguous CPU tensors of one of DTYPES (the caller checks);
    cos/sin tables are float32 in either."""

    def __init__(self, library: ctypes.CDLL, build: str) -> None:
        self._lib = library
        self.build = build  # names the source, flags, compiler and CPU it was built from (the .so's hash)
        self.seconds: dict[str, float] | None = None  # by kind of work, while a bench sets it to {}
        self._functions: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}
        for name, (args, result) in _SIGNATURES.items():
            for dtype, suffix in SUFFIXES.items():
                function = self._functions[name, dtype] = getattr(library, name + suffix)
                function.argtypes, function.restype = args, result
        self._sample_plain = library.colorl_sample_plain  # float32 logits only
        self._sample_plain.argtypes, self._sample_plain.restype = [_p, _i64, _i64, _p, _p, _p, _int], _int
        self._observed_at = float("-inf")  # perf_counter of the last step observe_decode checked
        self._few_rows_ask = library.colorl_few_rows_ask
        self._few_rows_ask.argtypes, self._few_rows_ask.restype = [_int], _int
        self.few_rows_ask = FEW_ROWS_ASKS[self._few_rows_ask(-1)]  # how 1-2 rows ask now (`_ask_as_chosen` sets it)
        self._racing_ask: str | None = None  # how the race's own products ask while it runs (`asking`)
        self._use_amx = library.colorl_use_amx
        self._use_amx.argtypes, self._use_amx.restype = [_int], _int
        self.amx_built = bool(library.colorl_amx_built())  # built for a CPU with AMX tiles
        self.amx_min_rows = int(library.colorl_amx_min_rows())  # fewer rows run on the FMA loops even with AMX on
        self.amx = self.use_amx(amx_wanted())
        self._one_team = library.colorl_one_team
        self._one_team.argtypes, self._one_team.restype = [_int], _int
        self.one_team = self.use_one_team(switched_on("COLORL_CPU_DECODE_TEAM"))
        self._core_trip = library.colorl_core_trip
        self._core_trip.argtypes, self._core_trip.restype = [_i64], ctypes.c_double

    def use_few_rows_ask(self, ask: str) -> str:
        """Products of 1-2 rows ask for their weights ahead as `ask` (one of FEW_ROWS_ASKS) from now on, until the
        next compiled call over 1-2 rows sets what its dtype and thread count were raced to (`_ask_as_chosen`): a
        choice of cache traffic, never of arithmetic."""
        self.few_rows_ask = FEW_ROWS_ASKS[self._few_rows_ask(FEW_ROWS_ASKS.index(ask))]
        return self.few_rows_ask

    @contextlib.contextmanager
    def asking(self, ask: str):
        """Within: every product of 1-2 rows asks as `ask`, whatever was raced (the race's own products)."""
        before, self._racing_ask = self._racing_ask, ask
        try:
            yield
        finally:
            self._racing_ask = before

    def few_rows_ask_for(self, dtype: torch.dtype) -> str:
        """How products of 1-2 rows in `dtype` ask for their weights ahead here, at the current thread count:
        forced by COLORL_CPU_DECODE_ASK, else raced with the rows verdict (`race_rows`). Where they go
        into L1 past the caches (nta) a Zen 5 decodes a row faster, and an Intel Xeon 2.7x slower than into L2
        (cpu_decode.c, STREAM_AHEAD)."""
        forced = forced_few_rows_ask()
        if forced is not None:
            return forced
        return self._raced_ask(dtype, torch.get_num_threads())

    def _ask_as_chosen(self, dtype: torch.dtype, rows: int) -> None:
        """Before a compiled call over `rows` rows: 1-2 rows ask as chosen for `dtype` (the race's own way while
        it runs)."""
        if rows <= FEW_ROWS:
            ask = self._racing_ask or self.few_rows_ask_for(dtype)
            if ask != self.few_rows_ask:
                self.use_few_rows_ask(ask)

    def use_one_team(self, on: bool) -> bool:
        """Run a whole decode step's loops (decode_layers, decode_burst) on one team of threads that the call keeps
        (on: cpu_decode_team.h), or fork and join a team per loop as the per-operation path does, from now on: the
        same arithmetic either way. COLORL_CPU_DECODE_TEAM=0 starts with a team per loop."""
        self.one_team = bool(self._one_team(int(on)))
        return self.one_team

    def core_trip_ns(self, trips: int = 20000, runs: int = 5) -> float:
        """A cache line's round trip between two of the loops' threads, ns (the median of `runs`; 0.0 where only
        one thread runs): a step's barriers and shared lines cost a few of these each. Where it is several times
        the usual 80-140 ns, the two cores sit on two L3s (two CCDs of an AMD CPU, or two sockets)."""
        return statistics.median(self._core_trip(trips) for _ in range(runs))

    def use_amx(self, on: bool) -> bool:
        """Run the bf16 products over the panels (`panel_linear`, a decode step's products on the panels) on AMX
        tiles (cpu_decode.c) from now on, where the build has them (a CPU with AMX) and Linux grants the tile
        state; returns whether they do. COLORL_CPU_DECODE_AMX=0 starts with them off."""
        self.amx = bool(self._use_amx(int(on)))
        return self.amx

    def rows_won(self, dtype: torch.dtype) -> frozenset[int]:
        """Row counts at which the loops' products (`linear` up to MAX_ROWS rows, `panel_linear` above)
        beat the engine's other products (oneDNN over packed weights, where chosen) in `dtype` on this
        machine at the current thread count (bounded-lag changes it between loops): forced by
        COLORL_CPU_DECODE_ROWS, else raced once per build, dtype and thread count (colorl/verdicts.py)
        and kept in kernels.json."""
        if dtype not in DTYPES:
            return frozenset()
        forced = forced_rows()
        if forced is not None:
            return forced
        return self._raced_rows(dtype, torch.get_num_threads())

    def panel_rows(self, dtype: torch.dtype) -> frozenset[int]:
        """Row counts up to MAX_ROWS whose products run over the panels rather than the rows kernel here (both
        the loops'; `rows_won` decides whether the loops run at all): forced by COLORL_CPU_DECODE_PANEL_ROWS,
        else raced with the rows verdict."""
        if dtype not in DTYPES:
            return frozenset()
        forced = forced_panel_rows()
        if forced is not None:
            return forced
        return self._raced_panel_rows(dtype, torch.get_num_threads())

    def on_panels(self, rows: int, dtype: torch.dtype) -> bool:
        """A product of `rows` rows the loops take (`takes`) runs over the weights' panels: always above MAX_ROWS,
        below where `panel_rows` says so."""
        return rows > MAX_ROWS or rows in self.panel_rows(dtype)

    def rows_verdict_name(self, dtype: torch.dtype, threads: int) -> str:
        on_amx = " on AMX" if self.amx and dtype == torch.bfloat16 else ""  # the loops' panels are another race there
        shapes = "/".join(f"{n_out}x{n_in}" for n_out, n_in in RACE_LAYER)  # another layer, another race
        size = "" if race_bytes() == RACE_MIN_BYTES else f", {race_bytes() // 2**20} MiB"  # a size of its own
        return (f"cpu_decode {self.build} rows at {threads} threads" + ("" if dtype == torch.float32 else f" {dtype}")
                + on_amx + f" over steps of {shapes}{size}, panels back to back")  # raced anew since they are

    @functools.cache
    def _rows_verdict(self, dtype: torch.dtype, threads: int) -> dict:
        from colorl.verdicts import measured_verdict

        return measured_verdict(self.rows_verdict_name(dtype, threads), lambda: race_rows(self, dtype),
                                keys=("won", "panel_rows", "loops", "ties_to_loops_up_to", "panel_margin",
                                      "few_rows_ask"))

    def takes(self, rows: int, dtype: torch.dtype) -> bool:
        """The loops run a product of `rows` rows in `dtype` here (`rows_won`; above MAX_PANEL_ROWS: when both
        MAX_PANEL_ROWS and PREFILL_ROWS were won)."""
        won = self.rows_won(dtype)
        return rows in won if rows <= MAX_PANEL_ROWS else {MAX_PANEL_ROWS, PREFILL_ROWS} <= won

    def takes_every_count(self, dtype: torch.dtype) -> bool:
        """No product of `dtype` needs oneDNN's packed copies here: the loops won every row count."""
        return set(range(1, MAX_PANEL_ROWS + 1)) | {PREFILL_ROWS} <= self.rows_won(dtype)

    @functools.cache  # asked several times a decode step; the verdict a process computes with does not change
    def _raced_rows(self, dtype: torch.dtype, threads: int) -> frozenset[int]:
        return between_raced(frozenset(int(rows) for rows in self._rows_verdict(dtype, threads)["won"]))

    @functools.cache
    def _raced_panel_rows(self, dtype: torch.dtype, threads: int) -> frozenset[int]:
        return frozenset(int(rows) for rows in self._rows_verdict(dtype, threads)["panel_rows"])

    @functools.cache
    def _raced_ask(self, dtype: torch.dtype, threads: int) -> str:
        return self._rows_verdict(dtype, threads)["few_rows_ask"]

    @functools.cache
    def _rows_watch(self, dtype: torch.dtype, threads: int):
        from colorl.verdicts import VerdictWatch

        return VerdictWatch(self.rows_verdict_name(dtype, threads), self._rows_verdict(dtype, threads))

    def observation_due(self) -> bool:
        """Whether the decode step just run is one to check (`observe_decode`): at most one in OBSERVE_EVERY_S."""
        now = time.perf_counter()
        if now - self._observed_at < OBSERVE_EVERY_S:
            return False
        self._observed_at = now
        return True

    def observe_decode(self, dtype: torch.dtype, rows: int, seconds: float, weight_bytes: int,
                       kv_bytes: Callable[[], int]) -> None:
        """A decode step's `seconds` over its layers, at `rows` sequences, checked against the rows verdict it ran
        by (colorl.verdicts.VerdictWatch). Comparable: the race times products that stream `race_bytes()` of
        weights no cache holds, and such a step streams its layers' weights and each sequence's K/V once, the rest
        of its work (norms, RoPE, calls) small beside that; so the step counts as the race's work at the bytes per
        second it streamed. Steps over weights a cache holds (or fewer than RACE_MIN_BYTES, whose calls weigh
        more) and forced verdicts are not checked; `kv_bytes` is asked only for a step that is. The caller asks
        `observation_due` first."""
        from colorl.machine import last_level_cache_bytes

        if (weight_bytes < max(RACE_MIN_BYTES, last_level_cache_bytes() or 0) or dtype not in DTYPES
                or forced_rows() is not None or forced_panel_rows() is not None):
            return
        watch = self._rows_watch(dtype, torch.get_num_threads())
        watch.observe(rows, seconds * race_bytes() / (weight_bytes + kv_bytes()))

    @_timed("products")
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x: [B <= MAX_ROWS, in] @ weight [out, in].T (+ bias): [B, out], all float32 or all bfloat16
        (float32 sums, rounded to bf16 once at the end, as torch's bf16 product)."""
        rows, n_in = x.shape
        check_tensors(x.dtype, x=x, weight=weight, bias=bias)
        if weight.shape[1] != n_in or (bias is not None and bias.shape != weight.shape[:1]):
            raise ValueError(f"compiled linear: x {tuple(x.shape)}, weight {tuple(weight.shape)} and bias do not agree")
        out = torch.empty(rows, weight.shape[0], dtype=x.dtype)
        self._ask_as_chosen(x.dtype, rows)
        _raise_for(self._functions["colorl_linear", x.dtype](_ptr(x), _ptr(weight), _ptr(bias), _ptr(out), rows,
                                                             weight.shape[0], n_in, torch.get_num_threads()))
        return out

    def pack_panels(self, weight: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """`weight` [N, K] in the panels `panel_linear` reads (cpu_decode_loops.h): a copy, made once per
        weight version, into `into` (panel_elements(N, K) values, `PanelCopies`' room for it) or, without it, a
        mapping of its own on huge pages (host_memory.py)."""
        check_tensors(weight.dtype, weight=weight)
        if into is not None:
            check_tensors(weight.dtype, into=into)
            if into.shape != (panel_elements(*weight.shape),):
                raise ValueError(f"compiled pack_panels: {into.numel()} values cannot hold the panels of a "
                                 f"{tuple(weight.shape)} matrix")
        panels = into if into is not None else mapped_empty((panel_elements(*weight.shape),), weight.dtype, huge=True)
        self._functions["colorl_pack_panels", weight.dtype](_ptr(weight), _ptr(panels), weight.shape[0],
                                                             weight.shape[1], torch.get_num_threads())
        return panels

    @_timed("products")
    def panel_linear(self, x: torch.Tensor, panels: torch.Tensor, n_out: int,
                     bias: torch.Tensor | None) -> torch.Tensor:
        """x: [B, in] @ the [n_out, in] weight `panels` were packed from (+ bias): [B, n_out], for any B;
        the arithmetic-bound products of a decode step over more than MAX_ROWS sequences."""
        rows, n_in = x.shape
        check_tensors(x.dtype, x=x, panels=panels, bias=bias)
        if panels.numel() != panel_elements(n_out, n_in) or (bias is not None and bias.shape != (n_out,)):
            raise ValueError(f"compiled panel_linear: x {tuple(x.shape)}, the panels and the bias do not agree")
        out = torch.empty(rows, n_out, dtype=x.dtype)
        self._ask_as_chosen(x.dtype, rows)
        _raise_for(self._functions["colorl_panels", x.dtype](_ptr(x), _ptr(panels), _ptr(bias), _ptr(out), rows,
                                                             n_out, n_in, torch.get_num_threads()))
        return out

    @_timed("elementwise")
    def add_rms_norm(self, x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x += add (in place, when given); returns RMSNorm(x) * weight. x, add: [T, C]."""
        check_tensors(x.dtype, x=x, add=add, weight=weight)
        if (add is not None and add.shape != x.shape) or weight.shape != x.shape[1:]:
            raise ValueError("compiled add_rms_norm: x, add and weight do not agree")
        out = torch.empty_like(x)
        self._functions["colorl_add_rms_norm", x.dtype](_ptr(x), _ptr(add), _ptr(weight), _ptr(out), x.shape[0],
                                                        x.shape[1], eps)
        return out

    @_timed("elementwise")
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2I] -> silu(gate) * up: [T, I]."""
        tokens, width = gate_up.shape
        check_tensors(gate_up.dtype, gate_up=gate_up)
        out = torch.empty(tokens, width // 2, dtype=gate_up.dtype)
        self._functions["colorl_silu_mul", gate_up.dtype](_ptr(gate_up), _ptr(out), tokens, width // 2)
        return out

    @_timed("kv_writes")
    def rope_write_kv(self, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor,
                      sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> None:
        """Rotate q and k of qkv [T, (H + 2 Hkv) D] in place; write k, v to cache [slots, 2, Hkv, D]."""
        check_tensors(qkv.dtype, qkv=qkv, cache=cache)
        check_tensors(torch.float32, cos=cos, sin=sin)
        check_tensors(torch.int64, positions=positions, slots=slots)
        if (qkv.shape[1] != (heads + 2 * kv_heads) * head_dim or cache.shape[1:] != (2, kv_heads, head_dim)
                or cos.shape != sin.shape or cos.shape[1] != head_dim or not len(positions) == len(slots) == qkv.shape[0]):
            raise ValueError("compiled rope_write_kv: qkv, cos/sin, positions, slots and cache do not agree")
        _raise_for(self._functions["colorl_rope_write_kv", qkv.dtype](
            _ptr(qkv), qkv.shape[0], heads, kv_heads, head_dim, _ptr(cos), _ptr(sin), _ptr(positions), _ptr(slots),
            _ptr(cache), cache.shape[0], cos.shape[0]))

    @_timed("attention")
    def paged_decode(self, q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                     block_size: int, scale: float) -> torch.Tensor:
        """q: [S, H, D], one token per sequence (rows may be strided: q/k/v rows); tables: [S, width]
        block ids; lengths: [S]; cache: [slots, 2, Hkv, D]. Returns [S, H * D]."""
        seqs, heads, dim = q.shape
        if q.stride(1) != dim or q.stride(2) != 1 or q.dtype != cache.dtype or q.device.type != "cpu":
            raise ValueError("compiled paged_decode: each query's heads must be contiguous, in the cache's dtype")
        check_tensors(cache.dtype, cache=cache)
        check_tensors(torch.int64, tables=tables, lengths=lengths)
        if cache.shape[3] != dim or heads % cache.shape[2] or tables.shape[0] != seqs or lengths.shape != (seqs,):
            raise ValueError("compiled paged_decode: q, cache, tables and lengths do not agree")
        out = torch.empty(seqs, heads * dim, dtype=q.dtype)
        _raise_for(self._functions["colorl_paged_decode", q.dtype](
            _ptr(q), q.stride(0), _ptr(cache), _ptr(tables), tables.shape[1], _ptr(lengths), _ptr(out), seqs, heads,
            cache.shape[2], dim, block_size, scale, torch.get_num_threads(), cache.shape[0]))
        return out


    def sample_plain(self, z: torch.Tensor, u: list[float]) -> tuple[list[int], list[float]]:
        """Per row of z [N, V] (float32 logits, already divided by the row's temperature), the token drawn
        from softmax(z) at u[row] (in (0, 1]) by inverse CDF in vocabulary order, and its log-prob:
        sampler.py's `Sampler._inverse_cdf_two_level`, the same steps in one call, equal to float32 rounding.
        u in and the draws out are Python numbers, with no tensor made around the call: after a decode step has
        streamed its weights every torch call runs from cold caches (0.1 ms for a `torch.tensor` on a Zen 4)."""
        check_tensors(torch.float32, z=z)
        rows = len(u)
        if z.dim() != 2 or z.shape[0] != rows:
            raise ValueError(f"compiled sample_plain: z {tuple(z.shape)} and {rows} draws do not agree")
        tokens, logps = (ctypes.c_int64 * rows)(), (ctypes.c_float * rows)()
        _raise_for(self._sample_plain(_ptr(z), rows, z.shape[1], (ctypes.c_double * rows)(*u), tokens, logps,
                                      torch.get_num_threads()))
        return list(tokens), list(logps)

    def decode_layers(self, x: torch.Tensor, layers: ctypes.Array, step: DecodeStep, scratch: torch.Tensor,
                      head: DecodeHead | None = None) -> torch.Tensor:
        """Every decoder layer of a decode step of step.tokens sequences, in one call (cpu_decode_loops.h;
        above MAX_ROWS each layer must carry the matrices' panels): x [T, C] gets each layer's attention and
        MLP outputs added, in place, but the last layer's MLP output, which is returned [T, C]. With a `head`
        (`head_tensors`': for a step whose every token samples), the same call then adds that output too, runs
        the final norm and the LM head, and returns the float32 logits [T, V], the same as the model's
        per-operation norm, head and `.float()` after the layers. `layers`: an array of `layer_tensors`'
        results, which checked what they point to; the caller checks `step`'s; scratch:
        `decode_scratch_values` of the step (and head). Not timed by kind: a bench's split runs the
        per-operation path instead (model.py)."""
        check_tensors(x.dtype, x=x, scratch=scratch)
        if x.shape != (step.tokens, step.hidden) or scratch.numel() < decode_scratch_values(step, head, x.dtype):
            raise ValueError("compiled decode_layers: x, the scratch and the step's shapes do not agree")
        out = torch.empty_like(x)
        self._ask_as_chosen(x.dtype, step.tokens)
        if head is None:
            _raise_for(self._functions["colorl_decode_layers", x.dtype](_ptr(x), _ptr(out), _ptr(scratch), layers,
                                                                        len(layers), ctypes.byref(step)))
            return out
        logits = torch.empty(step.tokens, head.vocab, dtype=torch.float32)
        _raise_for(self._functions["colorl_decode_logits", x.dtype](_ptr(x), _ptr(out), _ptr(scratch), layers,
                                                                    len(layers), ctypes.byref(step),
                                                                    ctypes.byref(head), _ptr(logits)))
        return logits

    def decode_burst(self, x: torch.Tensor, layers: ctypes.Array, step: DecodeStep, scratch: torch.Tensor,
                     head: DecodeHead, embed: torch.Tensor, temperatures: list[float], slots: torch.Tensor,
                     u: list[float], stops: list[Iterable[int]]) -> tuple[list[int], list[float]]:
        """Up to `steps` decode steps of step.tokens sequences in one call (cpu_decode_loops.h's colorl_decode_burst):
        each as `decode_layers` with a `head` runs one, then each row's logits divided by its temperature (> 0) and
        a draw as `sample_plain`'s at u[j * T + row], whose token's `embed` row is the next step's input at the
        next position, its K/V written to slots[j, row]. The burst ends after the first step at which a row draws
        one of its `stops` (each row's stop tokens), so each step runs over the rows one step per call would.
        slots: int64 [steps, T], row 0 the step's own (the caller reserved them all, and covered the last position
        in the cos/sin tables and the tables' width); u: steps * T numbers in (0, 1]. Returns the tokens and
        log-probs of the steps run, T each, step by step."""
        check_tensors(x.dtype, x=x, scratch=scratch, embed=embed)
        check_tensors(torch.int64, slots=slots)
        steps, rows = slots.shape
        if (x.shape != (step.tokens, step.hidden) or rows != step.tokens or len(u) != steps * rows
                or len(temperatures) != rows or len(stops) != rows or embed.shape != (head.vocab, step.hidden)
                or scratch.numel() < decode_scratch_values(step, head, x.dtype)
                or step.slots != slots.data_ptr()):
            raise ValueError("compiled decode_burst: x, the scratch, the embedding, the slots, the draws, the stops "
                             "and the step's shapes do not agree")
        if min(temperatures) <= 0:
            raise ValueError("compiled decode_burst: every row samples at a temperature above 0")
        flat = [token for row in stops for token in row]
        offsets = list(itertools.accumulate((len(row) for row in stops), initial=0))  # row t: flat[o[t]:o[t + 1]]
        out, logits = torch.empty_like(x), torch.empty(rows, head.vocab, dtype=torch.float32)
        tokens, logps = (ctypes.c_int64 * (steps * rows))(), (ctypes.c_float * (steps * rows))()
        done = ctypes.c_int64()
        self._ask_as_chosen(x.dtype, rows)
        _raise_for(self._functions["colorl_decode_burst", x.dtype](
            _ptr(x), _ptr(out), _ptr(scratch), layers, len(layers), ctypes.byref(step), ctypes.byref(head),
            _ptr(logits), _ptr(embed), (ctypes.c_float * rows)(*temperatures), steps, _ptr(slots),
            (ctypes.c_double * (steps * rows))(*u), (ctypes.c_int64 * max(len(flat), 1))(*flat),
            (ctypes.c_int64 * (rows + 1))(*offsets), tokens, logps, ctypes.byref(done)))
        return list(tokens[:done.value * rows]), list(logps[:done.value * rows])


def decode_scratch_values(step: DecodeStep, head: DecodeHead | None = None, dtype: torch.dtype = torch.float32) -> int:
    """The values `decode_layers` needs as scratch: two layers' outputs, then one layer's intermediates; with a
    `head`, what they need to make the logits: then the final norm's output and, but in float32, the head's."""
    width = (step.heads + 2 * step.kv_heads) * step.head_dim
    values = step.tokens * (4 * step.hidden + width + step.heads * step.head_dim + 3 * step.intermediate)
    if head is not None:
        values += step.tokens * (step.hidden + (0 if dtype == torch.float32 else head.vocab))
    return values


def _forced_counts(name: str, every: frozenset[int], hint: str) -> frozenset[int] | None:
    """Environment variable `name`: "all" (`every`), "none" or row counts from `every` ("1,2,5"); unset: None.
    Anything else is one clear error naming the variable and what it takes (`hint`)."""
    value = os.environ.get(name, "").strip().lower()
    return _parsed_counts(name, value, every, hint) if value else None


@functools.lru_cache(maxsize=64)  # read a few times a decode step; parsed once per value
def _parsed_counts(name: str, value: str, every: frozenset[int], hint: str) -> frozenset[int]:
    if value == "all":
        return every
    if value == "none":
        return frozenset()
    try:
        rows = frozenset(int(part) for part in value.split(","))
    except ValueError:
        rows = frozenset({0})
    if not rows <= every:
        raise ValueError(f"{name}={value!r}: give all, none or row counts {hint}")
    return rows


def switched_on(name: str) -> bool:
    """A choice of the loops that the environment variable `name` set to 0 switches off (on by default)."""
    return os.environ.get(name, "1") != "0"


def amx_wanted() -> bool:
    """The bf16 panels may run on AMX tiles: COLORL_CPU_DECODE_AMX=0 keeps the FMA loops."""
    return switched_on("COLORL_CPU_DECODE_AMX")


def forced_few_rows_ask() -> str | None:
    """COLORL_CPU_DECODE_ASK: how products of 1-2 rows ask for their weights ahead, one of FEW_ROWS_ASKS, for
    every dtype and thread count (the tests force one, so that what they see does not depend on a race); unset:
    the race decides. Anything else is one clear error."""
    value = os.environ.get("COLORL_CPU_DECODE_ASK", "").strip().lower()
    if value and value not in FEW_ROWS_ASKS:
        raise ValueError(f"COLORL_CPU_DECODE_ASK={value!r}: give {', '.join(FEW_ROWS_ASKS)}")
    return value or None


def forced_rows() -> frozenset[int] | None:
    """COLORL_CPU_DECODE_ROWS: "all", "none" or row counts ("1,2,5"), for every dtype and thread count
    (the CI lanes force each extreme, so that both kernels are tested at every row count on any CPU);
    unset: the race decides. "all" takes every row count, above MAX_PANEL_ROWS too."""
    return _forced_counts("COLORL_CPU_DECODE_ROWS", _EVERY_ROWS,
                          f"from 1 to {MAX_PANEL_ROWS} ({PREFILL_ROWS}: every count above {MAX_PANEL_ROWS})")


def forced_panel_rows() -> frozenset[int] | None:
    """COLORL_CPU_DECODE_PANEL_ROWS: "all", "none" or row counts up to MAX_ROWS ("5,8") whose products run over
    the panels, for every dtype and thread count (the tests force each, so that both paths are tested on any
    CPU); unset: the race decides."""
    return _forced_counts("COLORL_CPU_DECODE_PANEL_ROWS", _EVERY_PANEL_ROWS, f"from 1 to {MAX_ROWS}")


def between_raced(won: frozenset[int]) -> frozenset[int]:
    """The raced row counts the loops won, plus each panel row count that was not raced when the raced
    counts on both sides of it (or the one side there is) were won: a product's cost is smooth in its rows."""
    rows = set(won)
    for count in range(MAX_ROWS + 1, MAX_PANEL_ROWS + 1):
        below = [r for r in PANEL_RACE_ROWS if r <= count]
        above = [r for r in PANEL_RACE_ROWS if r >= count]
        sides = ([max(below)] if below else []) + ([min(above)] if above else [])
        if sides and all(side in won for side in sides):
            rows.add(count)
    return frozenset(rows)


def race_few_rows_ask(compiled: CpuDecode, steps: dict[int, tuple[Callable, Callable]]) -> dict:
    """How products of 1-2 rows ask for their weights ahead here (`few_rows_ask`, one of FEW_ROWS_ASKS): the
    decode `steps` of 1 and 2 rows over both loops (`race_steps`: the panels', the rows kernel's), each way of
    asking against asking for none. In each pass a way costs its 1- and 2-row steps, each on the faster of the
    two loops (the race that follows gives each row count that loop); the way that costs least in every pass
    wins (no margin: the three are the same loops and the same bits), else none, the hardware prefetcher's own,
    as on a busy machine. On a Zen 5 non-temporally was the faster (by 2-5 %); on an Intel Xeon with AMX
    non-temporally took 2.6x as long as none, and into L2 0.9x (cpu_decode.c)."""
    from colorl.verdicts import stable_race

    def step_asking(ask: str, step: Callable) -> Callable:
        def run():
            with compiled.asking(ask):
                return step()
        return run

    loops = ("panels", "rows kernel")
    items = {(ask, rows, loop): (step_asking(ask, step), step_asking("none", step))
             for rows, both in steps.items() for loop, step in zip(loops, both) for ask in FEW_ROWS_ASKS[1:]}
    verdict = stable_race(items, RACE_ROUNDS, margin=0.0)
    passes = {item: verdict["seconds"][str(item)] for item in items}

    def cost(ask: str, index: int) -> float:
        def seconds(rows: int, loop: str) -> float:
            if ask == "none":  # timed beside each other way: its best
                return min(passes[other, rows, loop][index][1] for other in FEW_ROWS_ASKS[1:])
            return passes[ask, rows, loop][index][0]
        return sum(min(seconds(rows, loop) for loop in loops) for rows in steps)

    count = len(next(iter(passes.values())))  # passes, the same for every item
    winners = {min(FEW_ROWS_ASKS, key=lambda ask: cost(ask, index)) for index in range(count)}
    return {"ask": winners.pop() if len(winners) == 1 and not verdict["busy"] else "none", "busy": verdict["busy"],
            "seconds": verdict["seconds"]}


def race_rows(compiled: CpuDecode, dtype: torch.dtype = torch.float32) -> dict:
    """Which product the engine runs at each row count, over weights that do not fit in cache, as a decode step
    streams them (colorl.verdicts.stable_race: a candidate wins a row count in every pass). First, how 1-2 rows
    ask for their weights ahead (`race_few_rows_ask`); the rest runs asking that way. Then, at
    1..MAX_ROWS rows, whole decode steps (`race_steps`) over the panels against over the rows kernel (`panel_rows`:
    which of the two loops a few rows take; which wins moves with the CPU's loads per cycle and registers,
    bench/rows_stream.py); the panels must win by MARGIN in every pass, a near tie stays with the rows kernel. On a
    Zen 4 the races that gave near ties to the panels (by 2-17 %, over products or steps) were wrong each time the
    engine's own step was timed: fp32 at 1 and 5 rows, bf16 at 1 row, one thread, each 11-13 % slower on the
    panels (bench/README.md). On the Xeon a margin has given bf16's 1 row to the rows kernel in one race of three
    where the panels won every pass by 3.5-14 %. Then the loop
    a row count takes (`loops`: that winner up to MAX_ROWS, the panels at PANEL_RACE_ROWS) against the
    engine's other product (`won`: where the loops run), so that `seconds` holds the times of what a step runs
    (VerdictWatch), each pass's [loops, other]. Up to MAX_ROWS the other product must be the clear winner: a
    near tie stays with the loops, whose decode step runs every layer in one call (the products alone do not
    show what that saves: on a Xeon at two threads, MKL's products at 1 row tied with the loops' and its
    step took 1.6x the memory floor, bench/README.md); above, the loops must be."""
    from colorl.kernels import PackedLinears
    from colorl.verdicts import MARGIN, stable_race

    gen = torch.Generator().manual_seed(0)
    weights = race_weights(dtype, generator=gen)
    packed = PackedLinears()
    packed.repack(weights)
    copies = PanelCopies()  # back to back, as the engine's
    panels = [copies.of(w, compiled) for w in weights]
    xs = {rows: race_inputs(rows, dtype, gen) for rows in (*range(1, MAX_ROWS + 1), *PANEL_RACE_ROWS)}

    def on_panels(x, count=len(weights)):
        return race_products(lambda x, p, w: compiled.panel_linear(x, p, w.shape[0], None), x, weights[:count],
                             panels[:count])

    def on_rows_kernel(x):
        return race_products(lambda x, w, _: compiled.linear(x, w, None), x, weights)

    steps = race_steps(compiled, dtype, weights, panels, range(1, MAX_ROWS + 1), gen, copies)
    ask = race_few_rows_ask(compiled, {rows: steps[rows] for rows in range(1, FEW_ROWS + 1)})
    with compiled.asking(ask["ask"]):  # what follows runs as the engine will
        # two of the loops, both exact: the panels only where they clearly win
        few = stable_race(steps, RACE_ROUNDS)
        loops, items = {}, {}
        for rows, x in xs.items():
            count = len(weights) if rows <= MAX_PANEL_ROWS else len(RACE_LAYER)  # a prefill's is long enough on a layer
            over_panels = rows > MAX_ROWS or rows in few["won"]
            loops[str(rows)] = "panels" if over_panels else "rows kernel"
            ours = on_panels(x, count) if over_panels else on_rows_kernel(x)
            other = race_products(lambda x, w, _: packed.linear(x, w, None), x, weights[:count])
            items[rows] = (other, ours) if rows <= MAX_ROWS else (ours, other)  # (candidate, baseline)
        verdict = stable_race(items, RACE_ROUNDS)
    candidate_won = {str(rows) for rows in verdict["won"]}
    won = [rows for rows in xs if (rows <= MAX_ROWS) != (str(rows) in candidate_won)]
    seconds = {item: [passed[::-1] if int(item) <= MAX_ROWS else passed for passed in passes]
               for item, passes in verdict["seconds"].items()}
    return {**verdict, "won": won, "seconds": seconds, "panel_rows": few["won"], "loops": loops,
            "busy": verdict["busy"] or few["busy"] or ask["busy"], "panel_seconds": few["seconds"],
            "ties_to_loops_up_to": MAX_ROWS, "panel_margin": MARGIN, "few_rows_ask": ask["ask"],
            "few_rows_ask_seconds": ask["seconds"]}


PANEL_RUN_BYTES = 512 << 20  # a mapping that panel copies fill back to back (a larger copy takes one of its own)


class PanelCopies:
    """The engine's panel copies of its weight matrices (`CpuDecode.pack_panels`), made on a step's first
    use after each weight version, freed with the packed copies.

    The copies are made in the order the model first uses them, each right after the one before (64-byte aligned)
    in a mapping of PANEL_RUN_BYTES on huge pages: a decode step then reads its panels as one run of memory, layer
    after layer. Each copy in a mapping of its own, starting on a 2 MB boundary, cost every product a few
    microseconds of the stream: a batch-8 bf16 step of SmolLM2 at one thread of a Zen 5 took 1.45-1.48x its memory
    floor against 1.38-1.41x back to back (bench/README.md, "Panels back to back")."""

    def __init__(self) -> None:
        self._panels: dict[int, tuple[int, torch.Tensor]] = {}  # id(weight) -> (data_ptr, panels)
        self.generation = 0  # moves whenever a copy is made or dropped: what holds their pointers checks it
        self._run: torch.Tensor | None = None  # the mapping being filled
        self._filled = 0  # values of it taken

    def of(self, weight: torch.Tensor, compiled: CpuDecode) -> torch.Tensor:
        entry = self._panels.get(id(weight))
        if entry is None or entry[0] != weight.data_ptr():
            room = self._room(weight.dtype, panel_elements(*weight.shape))
            entry = self._panels[id(weight)] = (weight.data_ptr(), compiled.pack_panels(weight.detach(), room))
            self.generation += 1
        return entry[1]

    def _room(self, dtype: torch.dtype, values: int) -> torch.Tensor:
        """`values` values right after the last copy, or at the start of a new mapping where they do not fit."""
        if self._run is None or self._run.dtype != dtype or self._filled + values > self._run.numel():
            self._run = mapped_empty((max(values, PANEL_RUN_BYTES // dtype.itemsize),), dtype, huge=True)
            self._filled = 0
        room = self._run[self._filled:self._filled + values]
        line = 64 // dtype.itemsize
        self._filled += -(-values // line) * line
        return room

    def clear(self) -> None:
        """Forget every copy; a mapping goes back to the OS once no copy in it is held."""
        self._panels.clear()
        self._run, self._filled = None, 0
        self.generation += 1


@functools.cache
def _loaded() -> tuple[CpuDecode | None, str | None]:
    from colorl.engines.native.cpu_build import LoopsUnavailable, build_library, open_library

    try:
        built = build_library()
        return CpuDecode(open_library(built), built.build), None
    except LoopsUnavailable as exc:
        reason = str(exc)
    except (OSError, AttributeError) as exc:  # a library that does not load, or lacks a kernel
        reason = f"the compiled library did not load ({exc})"
    if os.environ.get("COLORL_CPU_DECODE", "1") != "0":  # a deliberate switch-off needs no word
        from colorl.verdicts import warn_once

        warn_once(f"the native engine's compiled decode loops are not used: {reason}; it runs torch's operators")
    return None, reason


def load() -> CpuDecode | None:
    """The library for this machine, built on first use; None where it cannot be (why_not says why, and
    the first call said it on stderr)."""
    return _loaded()[0]


def why_not() -> str | None:
    """Why `load()` gives None here; None when the loops are used."""
    return _loaded()[1]
