"""The compiled decode loops (colorl/engines/native/cpu_decode.c) against torch's operators, which the
native model runs wherever the loops are not built."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from colorl.config import EngineConfig
from colorl.engines.base import GenerationRequest, SamplingParams
from colorl.engines.native import NativeEngine, cpu_decode
from colorl.engines.native.kernel_report import kernel_lines
from colorl.engines.native.model import AttentionGroup, DecoderLayer, _rotate, paged_attention
from colorl.kernels import onednn_chosen
from colorl.machine import cpu_identity
from colorl.threads import pinned


@pytest.mark.parametrize("rows", range(1, cpu_decode.MAX_ROWS + 1))
def test_rows_kernel_equals_f_linear(compiled, rows):
    gen = torch.Generator().manual_seed(rows)
    x, weight, bias = torch.randn(rows, 83, generator=gen), torch.randn(200, 83, generator=gen), torch.randn(200, generator=gen)
    torch.testing.assert_close(compiled.linear(x, weight, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(compiled.linear(x, weight, None), F.linear(x, weight), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(compiled.linear(x, weight[:7], None), F.linear(x, weight[:7]), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", range(1, cpu_decode.MAX_ROWS + 1))
def test_bf16_rows_kernel_equals_the_float32_product_rounded_once(compiled, rows):
    """bf16 in, float32 sums, one rounding to bf16 at the end: at most one bf16 step from the
    float32 product of the same bf16 values (the sums' order differs), as torch's bf16 product."""
    gen = torch.Generator().manual_seed(rows)
    x, weight, bias = (t.bfloat16() for t in (torch.randn(rows, 83, generator=gen), torch.randn(200, 83, generator=gen),
                                              torch.randn(200, generator=gen)))
    for b in (bias, None):
        out = compiled.linear(x, weight, b)
        assert out.dtype == torch.bfloat16
        exact = F.linear(x.float(), weight.float(), None if b is None else b.float())
        step = torch.finfo(torch.bfloat16).eps * exact.abs()  # one bf16 step at each value (x2 margin below)
        assert ((out.float() - exact).abs() <= 2 * step + 1e-6).all()
        torch.testing.assert_close(out, F.linear(x, weight, b), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("dtype", cpu_decode.DTYPES)
@pytest.mark.parametrize("outputs", [20, 200, 203, 222])
@pytest.mark.parametrize("rows", [*range(1, cpu_decode.MAX_ROWS + 1), 9, 13, 32, 37])
def test_panels_equal_f_linear_at_any_row_count(compiled, rows, outputs, dtype):
    """The panels' product at every row count of the few-rows loop and for many sequences, outputs not a
    whole number of groups or panel pairs (200 = 4 x 48 + 8 = 12 x 16 + 8: a group with two empty vectors, a
    padding panel; 222 = 4 x 48 + 30: a part-filled vector beside a full one; 20: less than one group) or of panels
    (203), and an odd width: float32 to rounding; bf16 one rounding of float32 sums."""
    gen = torch.Generator().manual_seed(rows)
    x, weight, bias = (t.to(dtype) for t in (torch.randn(rows, 83, generator=gen), torch.randn(outputs, 83, generator=gen),
                                             torch.randn(outputs, generator=gen)))
    panels = compiled.pack_panels(weight)
    assert panels.numel() == -(-outputs // cpu_decode.PANEL_GROUP) * cpu_decode.PANEL_GROUP * 84  # whole groups, k pairs
    for b in (bias, None):
        out = compiled.panel_linear(x, panels, outputs, b)
        exact = F.linear(x.float(), weight.float(), None if b is None else b.float())
        if dtype == torch.float32:
            torch.testing.assert_close(out, exact, atol=1e-4, rtol=1e-5)
        else:
            assert out.dtype == torch.bfloat16
            assert ((out.float() - exact).abs() <= 2 * torch.finfo(torch.bfloat16).eps * exact.abs() + 1e-6).all()


def test_bf16_panels_run_on_amx_wherever_the_cpu_and_the_build_have_it(compiled):
    """A native build on a CPU with AMX must run its bf16 products over the panels on the tiles (a build that lost
    them, or a refused tile state, would silently fall back to loops up to 3x slower there); elsewhere they are off."""
    native = not os.environ.get("COLORL_CPU_DECODE_ARCH")
    assert compiled.amx_built == (native and {"amx_tile", "amx_bf16"} <= cpu_identity().flags)
    if compiled.amx_built and not compiled.amx and cpu_decode.amx_wanted():
        pytest.skip("this Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM): the FMA loops run")
    assert compiled.amx == (compiled.amx_built and cpu_decode.amx_wanted())


def assert_float32_sums_rounded_once(out, x, weight, bias):
    """out is x . weight^T (+ bias) from float32 sums rounded once to out's dtype (x2 margin), the sums in any
    order (K u sum |x w|)."""
    exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    order = x.shape[1] * 2.0 ** -24 * (x.float().abs() @ weight.float().abs().T)
    assert ((out.float() - exact).abs() <= 2 * torch.finfo(out.dtype).eps * exact.abs() + order).all()


@pytest.mark.parametrize("inputs", [83, 576])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16, 17, 32, 33, 100, 256])
def test_bf16_panels_on_amx_tiles_equal_the_float32_product_rounded_once(compiled, rows, inputs):
    """The tiles' product (cpu_decode.c, amx_panels_bf16) and the FMA loops' on the same panels: a few rows,
    every row block of 16 (a partial last one), more blocks than the tiles hold at once (100, 256 rows), an odd number of
    inputs (83: a k-pair and a tile padded with zeros), outputs not a whole number of panel pairs (200) or of
    panels (203): each one rounding of float32 sums."""
    if not compiled.amx:
        pytest.skip("no AMX here (the CPU, the build or Linux): the FMA loops run, tested above")
    gen = torch.Generator().manual_seed(rows)
    try:
        for outputs in (200, 203):
            x, weight, bias = (t.bfloat16() for t in (torch.randn(rows, inputs, generator=gen),
                                                      torch.randn(outputs, inputs, generator=gen),
                                                      torch.randn(outputs, generator=gen)))
            panels = compiled.pack_panels(weight)
            for on in (True, False):
                assert compiled.use_amx(on) == on
                for b in (bias, None):
                    out = compiled.panel_linear(x, panels, outputs, b)
                    assert out.dtype == torch.bfloat16
                    assert_float32_sums_rounded_once(out, x, weight, b)
    finally:
        compiled.use_amx(True)


@pytest.mark.parametrize("dtype", cpu_decode.DTYPES)
def test_every_way_of_asking_for_the_weights_gives_the_same_bits(compiled, dtype, monkeypatch):
    """Products of 1-2 rows ask for their weights ahead into L2, non-temporally or not at all, as raced or forced
    by COLORL_CPU_DECODE_ASK: a choice of cache traffic, never of arithmetic. Both kernels (the rows kernel and the
    panels), 1-3 rows (3 asks into L2 whatever the way), the same bits; the way is set by each call over 1-2 rows,
    `colorl doctor --kernels` names it, and the variable reads as documented."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(1000, 576, generator=gen).to(dtype)
    panels = compiled.pack_panels(weight)
    for rows in (1, 2, 3):
        x = torch.randn(rows, 576, generator=gen).to(dtype)
        outs = []
        for ask in cpu_decode.FEW_ROWS_ASKS:
            compiled.use_few_rows_ask("none" if ask != "none" else "l2")  # a call over 1-2 rows sets it again
            with compiled.asking(ask):
                outs.append((compiled.linear(x, weight, None), compiled.panel_linear(x, panels, 1000, None)))
                assert (compiled.few_rows_ask == ask) == (rows <= cpu_decode.FEW_ROWS)
        for other in outs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(outs[0], other))
        assert_float32_sums_rounded_once(outs[0][0], x, weight, None)
    monkeypatch.setenv("COLORL_ONEDNN", "0")  # no race: the report as `colorl doctor --kernels` prints it
    for ask, text in (("l2", "ahead into L2"), ("nta", "ahead past the caches (prefetchnta)"),
                      ("none", "not at all ahead")):
        monkeypatch.setenv("COLORL_CPU_DECODE_ASK", ask.upper())
        assert cpu_decode.forced_few_rows_ask() == ask
        assert all(f"1-2 rows asking for their weights {text} (forced by COLORL_CPU_DECODE_ASK={ask.upper()})"
                   in line for line in kernel_lines((1,)) if "decode rows" in line)
        compiled.linear(torch.ones(1, 576, dtype=dtype), weight, None)
        assert compiled.few_rows_ask == ask
    for bad in ("t1", "0"):
        monkeypatch.setenv("COLORL_CPU_DECODE_ASK", bad)
        with pytest.raises(ValueError, match="COLORL_CPU_DECODE_ASK='.*': give none, nta, l2"):
            cpu_decode.forced_few_rows_ask()


@pytest.mark.parametrize("seconds, chosen", [
    ({"none": 5, "nta": 9, "l2": 1}, "l2"),  # the Xeon's order
    ({"none": 5, "nta": 1, "l2": 9}, "nta"),  # the Zen 5's
    ({"none": 1, "nta": 5, "l2": 9}, "none"),
    ({"none": 9, "nta": 5, "l2": 1}, "l2"),  # two ways faster than none: the fastest
    ({"none": 5, "nta": 1, "l2": 9, "nta at 2 rows": 13}, "none"),  # 1 + 13 against 5 + 5
    ({"none": 5, "l2": 3, "nta": 9, "l2 on the rows kernel": 12, "none on the rows kernel": 7}, "l2"),  # the panels'
    ({"none": 5, "l2": 3, "nta": 9, "l2 on the panels": 12, "none on the rows kernel": 7}, "l2"),  # the kernel's
    ({"none": 5, "l2": 3, "nta": 9, "l2 on the panels": 12, "l2 on the rows kernel": 12}, "none")])
def test_the_way_to_ask_is_the_one_whose_steps_on_their_faster_loop_took_least(compiled, monkeypatch, seconds, chosen):
    """race_few_rows_ask runs each step with each way of asking against none, the way in force in the loops (the
    step's own products set it from the race's pin). A way's cost is its steps of 1 and 2 rows, each on the
    faster loop with it, as the engine will run them (ms per step by way, row count and loop; slept, so that no
    CPU decides)."""
    import time
    import types

    from colorl import verdicts

    monkeypatch.setattr(verdicts, "OthersLoad", lambda: types.SimpleNamespace(cores=lambda: 0.0))  # quiet
    weight, ran = torch.randn(64, 32), []

    def step(rows, loop):
        def run():
            compiled.linear(torch.ones(rows, 32), weight, None)  # as a decode step's products: it sets the way
            ask = compiled.few_rows_ask
            ran.append((rows, ask))
            time.sleep(seconds.get(f"{ask} at {rows} rows", seconds.get(f"{ask} on the {loop}", seconds[ask])) / 1e3)
        return run

    steps = {rows: (step(rows, "panels"), step(rows, "rows kernel")) for rows in (1, 2)}
    monkeypatch.delenv("COLORL_CPU_DECODE_ASK")  # raced, not forced: the pin alone decides
    verdict = cpu_decode.race_few_rows_ask(compiled, steps)
    assert verdict["ask"] == chosen and not verdict["busy"]
    assert {ask for _, ask in ran} == set(cpu_decode.FEW_ROWS_ASKS) and {rows for rows, _ in ran} == {1, 2}
    assert len(verdict["seconds"]) == 2 * 2 * 2  # rows x loops x (nta, l2), each against none


def test_the_engine_asks_as_its_dtype_and_thread_count_were_raced(compiled, tmp_path, monkeypatch):
    """The rows verdict says how 1-2 rows ask (raced with them); each compiled call over 1-2 rows sets that of its
    dtype at the current thread count (bounded-lag's loops run at two), a call over more rows leaves it."""
    monkeypatch.setenv("COLORL_CACHE", str(tmp_path))
    monkeypatch.delenv("COLORL_CPU_DECODE_ASK")
    asks = {(torch.float32, 1): "l2", (torch.float32, 2): "none", (torch.bfloat16, 1): "nta"}
    monkeypatch.setattr(cpu_decode, "race_rows", lambda library, dtype: {
        "won": [1, 2], "busy": False, "seconds": {}, "panel_rows": [], "loops": {}, "ties_to_loops_up_to": 8,
        "panel_margin": 0.0, "few_rows_ask": asks[dtype, torch.get_num_threads()]})
    library = cpu_decode.CpuDecode(compiled._lib, compiled.build)
    threads = torch.get_num_threads()
    try:
        for (dtype, count), ask in asks.items():
            torch.set_num_threads(count)
            weight = torch.randn(64, 32).to(dtype)
            library.use_few_rows_ask("none" if ask != "none" else "nta")
            other = library.few_rows_ask
            library.linear(torch.ones(3, 32, dtype=dtype), weight, None)
            assert library.few_rows_ask == other  # 3 rows ask into L2 whatever the way: not looked up
            library.linear(torch.ones(2, 32, dtype=dtype), weight, None)
            assert library.few_rows_ask == library.few_rows_ask_for(dtype) == ask
        stored = json.loads((tmp_path / "kernels.json").read_text())
        assert sorted(v["few_rows_ask"] for k, v in stored.items() if " rows at " in k) == sorted(asks.values())
    finally:
        torch.set_num_threads(threads)
        compiled.use_few_rows_ask("nta")


def test_many_rows_give_each_row_the_bits_it_gets_alone(compiled):
    """Many rows take a group's k's in blocks (192 at a time with AVX-512), their sums kept in float32 between
    blocks: each output is still one run of FMAs along k, so a row's result in a 20-row product (two whole
    tiles of 8 and a part one) has the same bits as that row alone through the few-rows loop. 400 inputs: two
    whole blocks and a part one."""
    gen = torch.Generator().manual_seed(5)
    x, weight, bias = torch.randn(20, 400, generator=gen), torch.randn(222, 400, generator=gen), torch.randn(222, generator=gen)
    panels = compiled.pack_panels(weight)
    together = compiled.panel_linear(x, panels, 222, bias)
    torch.testing.assert_close(together, F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    for row in range(20):
        assert torch.equal(together[row:row + 1], compiled.panel_linear(x[row:row + 1], panels, 222, bias))


def test_bf16_panels_give_a_row_the_bits_of_its_product_size(compiled):
    """On the k-pair panels a product of up to 8 rows takes each sum as two runs along k (the even k-pairs', the odd
    ones'), one of more rows as one run in every tile, its last tile too: a row gets the bits it gets alone in any
    product of up to 8 rows, and the bits of any other product of more than 8 rows. An odd count of k-pairs (199)
    leaves the even run one more; the FMA loops (AMX tiles, where present, sum in their own order)."""
    gen = torch.Generator().manual_seed(9)
    x, weight, bias = (t.bfloat16() for t in (torch.randn(20, 398, generator=gen), torch.randn(222, 398, generator=gen),
                                              torch.randn(222, generator=gen)))
    panels = compiled.pack_panels(weight)
    amx = compiled.amx
    try:
        compiled.use_amx(False)
        few, many = compiled.panel_linear(x[:7], panels, 222, bias), compiled.panel_linear(x, panels, 222, bias)
        for row in range(7):
            assert torch.equal(few[row:row + 1], compiled.panel_linear(x[row:row + 1], panels, 222, bias))
        assert torch.equal(many[11:], compiled.panel_linear(x[11:], panels, 222, bias))  # 16 + 4 rows, and 9 rows
    finally:
        compiled.use_amx(amx)
    assert_float32_sums_rounded_once(few, x[:7], weight, bias)
    assert_float32_sums_rounded_once(many, x, weight, bias)


@pytest.mark.parametrize("dtype", cpu_decode.DTYPES)
@pytest.mark.parametrize("rows", [2, 8, 32])
def test_panels_give_the_same_bits_at_any_thread_count(compiled, rows, dtype):
    """Each thread takes one contiguous run of a product's groups or pairs of panels (the tiles', the k-pairs'
    and the FMA loops' alike): at 1-5 threads, runs that do not divide the 21 groups (32 pairs) evenly included,
    every one is computed, by the same arithmetic whichever thread takes it. One left out would show in the bits."""
    gen = torch.Generator().manual_seed(rows)
    x, weight = (t.to(dtype) for t in (torch.randn(rows, 576, generator=gen), torch.randn(1000, 576, generator=gen)))
    panels = compiled.pack_panels(weight)
    outs = []
    for threads in range(1, 6):
        with pinned(threads):
            outs.append(compiled.panel_linear(x, panels, 1000, None))
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert_float32_sums_rounded_once(outs[0], x, weight, None)


@pytest.mark.parametrize("dtype", cpu_decode.DTYPES)
def test_panel_copies_lie_back_to_back_in_the_order_made(compiled, dtype, monkeypatch):
    """Each copy starts on the cache line right after the one before, and holds what a mapping of its own would, bit
    for bit; a copy kept is handed out again; a clear starts a new mapping; a copy larger than a mapping of copies
    (PANEL_RUN_BYTES) gets one of its own and the next ones start another."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).to(dtype) for n, k in ((40, 24), (17, 24), (64, 40), (5, 8))]
    copies = cpu_decode.PanelCopies()
    made = [copies.of(w, compiled) for w in weights]
    for before, after in zip(made, made[1:]):
        end = before.data_ptr() + before.numel() * dtype.itemsize
        assert after.data_ptr() == end + (-end % 64)
    for weight, panels in zip(weights, made):
        assert torch.equal(panels, compiled.pack_panels(weight))
    assert copies.of(weights[1], compiled) is made[1]
    generation = copies.generation
    copies.clear()
    again = copies.of(weights[0], compiled)
    assert copies.generation > generation and again.data_ptr() != made[0].data_ptr() and torch.equal(again, made[0])
    monkeypatch.setattr(cpu_decode, "PANEL_RUN_BYTES", 4096)
    copies.clear()
    big, small = copies.of(weights[2], compiled), copies.of(weights[3], compiled)  # 64 x 40: more than 4 KB
    assert big.numel() * dtype.itemsize > 4096 and torch.equal(big, compiled.pack_panels(weights[2]))
    assert torch.equal(small, compiled.pack_panels(weights[3]))
    with pytest.raises(ValueError, match="cannot hold"):
        compiled.pack_panels(weights[0], torch.empty(made[0].numel() - 1, dtype=dtype))


def test_panels_of_another_matrix_are_refused(compiled):
    with pytest.raises(ValueError, match="panels"):
        compiled.panel_linear(torch.randn(12, 8), compiled.pack_panels(torch.randn(30, 8)), 60, None)


def test_rows_kernel_refuses_more_rows_than_it_has(compiled):
    with pytest.raises(ValueError, match="rows"):
        compiled.linear(torch.randn(cpu_decode.MAX_ROWS + 1, 8), torch.randn(4, 8), None)


# float32: float32 rounding apart; bfloat16: one bf16 step apart (the reference rounds its
# intermediates where HF's modules do; the loops sum in another order)
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}


@pytest.mark.parametrize("dtype", cpu_decode.DTYPES)
def test_add_rms_norm_updates_the_stream_in_place(compiled, dtype):
    gen = torch.Generator().manual_seed(0)
    x, delta, weight = (torch.randn(5, 40, generator=gen).to(dtype), torch.randn(5, 40, generator=gen).to(dtype),
                        torch.randn(40, generator=gen).to(dtype))
    stream = x + delta
    wide = stream.float()
    expected = weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    out = compiled.add_rms_norm(x, delta, weight, 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(x, stream, atol=0, rtol=0)  # the same rounded sums
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(compiled.add_rms_norm(stream.clone(), None, weight, 1e-6), expected, **TOLERANCE[dtype])


def test_bf16_stream_rounds_to_nearest_even_as_torch(compiled):
    """The residual add rounds each float32 sum to bf16 as torch does, ties to even, in its 16-lane loop (one
    VCVTNEPS2BF16 where the CPU has AVX512-BF16) and its one-lane tail alike: sums half an ulp, three quarters and
    one and a half ulps past bf16 values of exponents from 2^-60 to 2^60, and of both signs. (Subnormals are left
    out: the instruction flushes them to zero, torch rounds them.)"""
    gen = torch.Generator().manual_seed(0)
    rows, width = 200, 27  # 16 lanes, then 11 one by one
    significand = torch.randint(128, 256, (rows, width), generator=gen).double()
    exponent = torch.randint(-60, 61, (rows, width), generator=gen).double()
    sign = torch.randint(0, 2, (rows, width), generator=gen).double() * 2 - 1
    offset = torch.tensor([0.5, -0.5, 0.75, -0.75, 1.5, -1.5, 0.25])[torch.randint(0, 7, (rows, width), generator=gen)]
    x = (sign * significand * 2.0**exponent).to(torch.bfloat16)
    delta = (offset.double() * 2.0**exponent).to(torch.bfloat16)
    assert torch.equal(x.double(), sign * significand * 2.0**exponent) and torch.equal(delta.double(), offset * 2.0**exponent)
    expected = (x.float() + delta.float()).to(torch.bfloat16)  # each float32 sum is exact: only the rounding differs
    compiled.add_rms_norm(x, delta, torch.ones(width, dtype=torch.bfloat16), 1e-6)
    assert torch.equal(x.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("dtype", cpu_decode.DTYPES)
def test_silu_mul(compiled, dtype):
    gate_up = torch.randn(3, 2 * 37, generator=torch.Generator().manual_seed(0)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(compiled.silu_mul(gate_up), F.silu(gate) * up, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", cpu_decode.DTYPES)
def test_silu_mul_gives_the_same_bits_in_every_lane_width(compiled, dtype):
    """The SiLU's 16-lane loop (outputs 0-15 of a row of 24) and its 8-lane loop (16-23) take the same steps per
    lane: the same inputs in both give the same bits, over the whole range of e^x and its edges (NaN, infinities,
    below -87, above 88, subnormals)."""
    gen = torch.Generator().manual_seed(1)
    values = torch.cat((torch.randn(400, generator=gen) * 30, torch.randn(400, generator=gen),
                        torch.tensor([float("nan"), float("inf"), -float("inf"), -87.5, -87.0, -86.9, 88.0, 88.5,
                                      1e-40, -1e-40, 0.0, -0.0, 1e-3, -1e-3, 20.0, -20.0])))
    values = values[:len(values) // 8 * 8].view(-1, 8)  # rows of 8 inputs
    gate = torch.cat((values, torch.randn(len(values), 8, generator=gen), values), dim=1)  # [rows, 24]
    up = torch.cat((values.flip(0), torch.ones(len(values), 8), values.flip(0)), dim=1)
    out = compiled.silu_mul(torch.cat((gate, up), dim=1).to(dtype))
    assert torch.equal(out[:, :8].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       out[:, 16:].view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("dtype", cpu_decode.DTYPES)
def test_rope_and_kv_write_equal_rotate_half_and_index_copy(compiled, dtype):
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, tokens = 4, 2, 16, 6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    angles = torch.rand(50, dim // 2, generator=gen) * 6
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()  # [P, D], float32
    positions, slots = torch.tensor([0, 3, 7, 8, 40, 49]), torch.tensor([5, 1, 9, 2, 0, 11])
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    c, s = cos[positions][:, None].to(dtype), sin[positions][:, None].to(dtype)
    q_ref = _rotate(q.reshape(tokens, heads, dim), c, s)
    k_ref = _rotate(k.reshape(tokens, kv_heads, dim), c, s)
    cache_ref = torch.zeros(12, 2, kv_heads, dim, dtype=dtype)
    cache_ref.index_copy_(0, slots, torch.stack((k_ref, v.reshape(tokens, kv_heads, dim)), 1))
    cache = torch.zeros(12, 2, kv_heads, dim, dtype=dtype)
    compiled.rope_write_kv(qkv, heads, kv_heads, dim, cos, sin, positions, slots, cache)
    tolerance = {**TOLERANCE[dtype], "atol": 2 * TOLERANCE[dtype]["atol"]}  # HF rounds both products before the sum
    torch.testing.assert_close(qkv[:, :heads * dim].view(tokens, heads, dim), q_ref, **tolerance)
    torch.testing.assert_close(cache, cache_ref, **tolerance)


@pytest.mark.parametrize("dtype", cpu_decode.DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 32), (6, 2, 64), (9, 3, 128), (3, 1, 20), (14, 2, 64)])
def test_paged_decode_equals_gathered_sdpa(compiled, heads, kv_heads, dim, dtype):
    """Unequal lengths, scattered blocks, a block table wider than a sequence needs, strided queries."""
    gen = torch.Generator().manual_seed(heads)
    block, num_blocks = 4, 40
    cache = torch.randn(num_blocks * block, 2, kv_heads, dim, generator=gen).to(dtype)
    lengths = [1, 9, 23, 16]
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [order[i * 8:(i + 1) * 8] for i in range(len(lengths))]  # 8 blocks each, fewer used
    rows = torch.randn(len(lengths), heads * dim + 5, generator=gen).to(dtype)  # a query row inside a wider row
    q = rows[:, :heads * dim].view(len(lengths), heads, dim)
    out = compiled.paged_decode(q, cache, torch.tensor(tables), torch.tensor(lengths), block, dim ** -0.5)
    assert out.dtype == dtype
    for i, length in enumerate(lengths):
        slots = torch.tensor([tables[i][p // block] * block + p % block for p in range(length)])
        group = AttentionGroup(start=0, end=1, batch=1, q_len=1, kv_len=length, kv_slots=slots,
                               mask=torch.ones(1, 1, 1, length, dtype=torch.bool))
        expected = paged_attention(q[i:i + 1], cache, group, dim ** -0.5)
        torch.testing.assert_close(out[i:i + 1], expected, **TOLERANCE[dtype])
    for threads in (1, 2, 3):  # one sequence at a time: in bf16 the threads share out its KV heads
        with pinned(threads):
            for i in range(len(lengths)):
                alone = compiled.paged_decode(q[i:i + 1], cache, torch.tensor(tables[i:i + 1]),
                                              torch.tensor(lengths[i:i + 1]), block, dim ** -0.5)
                assert torch.equal(alone, out[i:i + 1])


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from colorl.models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("qwen3"), family="qwen3", head_dim=24, initializer_range=0.3)


@pytest.mark.parametrize("dtype", cpu_decode.DTYPES)
def test_bad_indices_are_refused_before_any_memory_is_touched(compiled, dtype):
    """A bad block id or a length past the table row had segfaulted, an out-of-range KV slot had written 2 KB
    out of bounds: each is an IndexError now, as torch's own indexing gives, with the cache untouched."""
    heads, kv_heads, dim, block = 2, 1, 32, 4
    cache = torch.zeros(8 * block, 2, kv_heads, dim, dtype=dtype)  # 8 blocks
    q = torch.randn(1, heads, dim).to(dtype)
    good_tables, good_lengths = torch.tensor([[0, 1]]), torch.tensor([5])
    compiled.paged_decode(q, cache, good_tables, good_lengths, block, 0.1)
    for tables, lengths in ((torch.tensor([[0, 8]]), good_lengths), (torch.tensor([[-1, 1]]), good_lengths),
                            (good_tables, torch.tensor([9])), (good_tables, torch.tensor([0]))):
        with pytest.raises(IndexError, match="outside the cache"):
            compiled.paged_decode(q, cache, tables, lengths, block, 0.1)
    qkv = torch.randn(1, (heads + 2 * kv_heads) * dim).to(dtype)
    cos = sin = torch.ones(10, dim)
    for positions, slots in ((torch.tensor([0]), torch.tensor([32])), (torch.tensor([0]), torch.tensor([-1])),
                             (torch.tensor([10]), torch.tensor([0]))):
        with pytest.raises(IndexError, match="outside the cache"):
            compiled.rope_write_kv(qkv.clone(), heads, kv_heads, dim, cos, sin, positions, slots, cache)
    assert not cache.any()


def test_tensors_the_loops_cannot_read_are_refused(compiled):
    """A strided weight had given a wrong result (max error 24.6) and fp32 input with a bf16 weight garbage (1e34);
    checks are raised errors, which `python -O` keeps."""
    x, weight = torch.randn(2, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="contiguous CPU torch.float32"):
        compiled.linear(x, torch.randn(16, 8).t(), None)
    with pytest.raises(ValueError, match="torch.float32"):
        compiled.linear(x, weight.bfloat16(), None)
    with pytest.raises(ValueError, match="do not agree"):
        compiled.linear(x, torch.randn(8, 12), None)
    code = ("import torch, colorl.engines.native.cpu_decode as c; lib = c.load();\n"
            "try:\n    lib.linear(torch.randn(2, 16), torch.randn(16, 8).t(), None)\nexcept ValueError:\n    print('refused')")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "refused", out.stderr


def test_a_whole_layer_with_a_bad_slot_raises_and_computes_nothing_past_it(compiled, tiny_model_dir, monkeypatch):
    """The whole-layer call checks its step's indices in C too, and returns the first error of its loops."""
    monkeypatch.setattr(type(compiled), "rows_won", lambda self, dtype: frozenset(range(1, cpu_decode.MAX_ROWS + 1)))
    eng = NativeEngine(tiny_model_dir, EngineConfig(num_blocks=16, block_size=4))
    original = cpu_decode.CpuDecode.decode_layers

    def corrupt(self, x, layers, step, *rest):
        step.num_slots = 0  # as if every slot of the step were past the cache
        return original(self, x, layers, step, *rest)

    monkeypatch.setattr(cpu_decode.CpuDecode, "decode_layers", corrupt)
    with pytest.raises(IndexError, match="outside the cache"):
        eng.generate([GenerationRequest("a", [10, 11, 12], SamplingParams(temperature=0.0, max_new_tokens=3,
                                                                              ignore_eos=True))])


def test_engine_with_and_without_the_loops_samples_the_same(compiled, tiny_model_dir, qwen3_dir):
    """Continuous batching over prompts of different lengths (prefills beside decodes, batches of
    1..5 rows): the compiled path and torch's operators sample the same tokens with the same log-probs."""
    prompts = [list(range(10, 10 + n)) for n in (3, 17, 6, 30, 9)]
    for folder in (tiny_model_dir, qwen3_dir):
        outputs = []
        for use_compiled in (True, False):
            eng = NativeEngine(folder, EngineConfig(num_blocks=64, block_size=4, max_prefill_tokens=16))
            eng.model.use_compiled = use_compiled
            params = [SamplingParams(temperature=1.0, max_new_tokens=6 + 5 * i, ignore_eos=True, seed=i) for i in range(5)]
            outputs.append(eng.generate([GenerationRequest(str(i), p, params[i]) for i, p in enumerate(prompts)]))
        for fast, reference in zip(*outputs):
            assert fast.output_ids == reference.output_ids
            assert max(abs(a - b) for a, b in zip(fast.logprobs, reference.logprobs)) < 1e-4


def test_bf16_engine_runs_every_loop_compiled_and_agrees_with_torch(compiled, tiny_model_dir, tmp_path, monkeypatch):
    """bf16 serving: the decode step runs the bf16 loops (products, attention, RoPE and KV writes,
    norms, SiLU), and greedy decoding matches torch's operators, log-probs to bf16's precision.
    (Models at their default initialisation: qwen3_dir's large weights make near-ties that bf16's
    rounding, in either path, flips.)"""
    from colorl.models import save_tiny_model

    monkeypatch.setattr(type(compiled), "rows_won", lambda self, dtype: frozenset(range(1, cpu_decode.MAX_ROWS + 1)))
    prompts = [list(range(10, 10 + n)) for n in (3, 17, 6)]
    for folder in (tiny_model_dir, save_tiny_model(tmp_path / "qwen3", family="qwen3", head_dim=24)):
        outputs = []
        for use_compiled in (True, False):
            eng = NativeEngine(folder, EngineConfig(num_blocks=64, block_size=4), dtype=torch.bfloat16)
            eng.model.use_compiled = use_compiled
            compiled.seconds = {}
            params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
            outputs.append(eng.generate([GenerationRequest(str(i), p, params) for i, p in enumerate(prompts)]))
            seconds, compiled.seconds = compiled.seconds, None
            kinds = {"products", "attention", "kv_writes", "elementwise"}
            assert (set(seconds) == kinds) if use_compiled else not seconds
        for fast, reference in zip(*outputs):
            assert fast.output_ids == reference.output_ids
            assert max(abs(a - b) for a, b in zip(fast.logprobs, reference.logprobs)) < 0.02


@pytest.mark.parametrize("panel_rows", ["all", "none"])
@pytest.mark.parametrize("dtype", cpu_decode.DTYPES)
def test_whole_layer_decode_equals_the_per_operation_loops(compiled, tiny_model_dir, monkeypatch, dtype, panel_rows):
    """One compiled call per layer for pure decode steps runs the same loops in the same order as the
    per-operation path (over the panels or on the rows kernel), so the two sample the same tokens with
    bit-identical log-probs; steps with a prefill, or more rows than the loops won, take the per-operation path."""
    monkeypatch.setenv("COLORL_CPU_DECODE_PANEL_ROWS", panel_rows)
    monkeypatch.setattr(type(compiled), "rows_won", lambda self, dtype: frozenset(range(1, 4)))
    calls = []
    whole_layers = cpu_decode.CpuDecode.decode_layers
    monkeypatch.setattr(cpu_decode.CpuDecode, "decode_layers",
                        lambda self, x, *rest: calls.append(x.shape[0]) or whole_layers(self, x, *rest))
    prompts = [list(range(10, 10 + n)) for n in (3, 17, 6, 9)]
    outputs = []
    for per_operation in (False, True):
        compiled.seconds = {} if per_operation else None  # a bench's split forces the per-operation path
        eng = NativeEngine(tiny_model_dir, EngineConfig(num_blocks=64, block_size=4, max_prefill_tokens=16,
                                                        decode_burst=1), dtype=dtype)  # a call per step (bursts: their own test)
        params = [SamplingParams(temperature=1.0, max_new_tokens=4 + 6 * i, ignore_eos=True, seed=i) for i in range(4)]
        outputs.append(eng.generate([GenerationRequest(str(i), p, params[i]) for i, p in enumerate(prompts)]))
        compiled.seconds = None
        if not per_operation:
            assert calls and set(calls) <= {1, 2, 3}  # 4 decodes at once exceed the won rows: per operation
            whole_steps = len(calls)
    assert len(calls) == whole_steps  # none while the split was collected
    for whole, reference in zip(*outputs):
        assert whole.output_ids == reference.output_ids
        assert whole.logprobs == reference.logprobs


def test_rows_race_is_kept_per_build_thread_count_and_dtype(compiled, tmp_path, monkeypatch):
    monkeypatch.setenv("COLORL_CACHE", str(tmp_path))
    monkeypatch.delenv("COLORL_CPU_DECODE_ROWS", raising=False)
    raced = []

    def race(library, dtype):
        raced.append((dtype, torch.get_num_threads()))
        return {"won": [1, 2] if dtype == torch.float32 else [torch.get_num_threads()], "busy": False, "seconds": {},
                "panel_rows": [8] if dtype == torch.float32 else [], "loops": {},
                "ties_to_loops_up_to": cpu_decode.MAX_ROWS, "panel_margin": 0.0, "few_rows_ask": "nta"}

    monkeypatch.setattr(cpu_decode, "race_rows", race)
    library = cpu_decode.CpuDecode(compiled._lib, compiled.build)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert library.rows_won(torch.float32) == {1, 2} and library.rows_won(torch.bfloat16) == {1}
        monkeypatch.delenv("COLORL_CPU_DECODE_PANEL_ROWS", raising=False)  # the same race says where a few rows run
        assert library.panel_rows(torch.float32) == {8} and library.panel_rows(torch.bfloat16) == set()
        assert library.on_panels(8, torch.float32) and not library.on_panels(7, torch.float32)
        assert library.on_panels(cpu_decode.MAX_ROWS + 1, torch.bfloat16)
        torch.set_num_threads(2)  # bounded-lag's other loop: its own race, not the 1-thread verdict
        assert library.rows_won(torch.bfloat16) == {2}
        assert library.rows_won(torch.float16) == frozenset()  # no kernel for it: never raced
        entries = {k: v for k, v in json.loads((tmp_path / "kernels.json").read_text()).items()
                   if f"cpu_decode {compiled.build} rows at " in k}
        assert sorted(v["won"] for v in entries.values()) == [[1], [1, 2], [2]]
        torch.set_num_threads(1)
        assert cpu_decode.CpuDecode(compiled._lib, compiled.build).rows_won(torch.float32) == {1, 2}  # read back
        assert raced == [(torch.float32, 1), (torch.bfloat16, 1), (torch.bfloat16, 2)]
        cpu_decode.CpuDecode(compiled._lib, "another-build").rows_won(torch.float32)  # a changed kernel races again
        assert raced[-1] == (torch.float32, 1) and len(raced) == 4
    finally:
        torch.set_num_threads(threads)


def test_decode_steps_are_checked_against_the_rows_verdict_at_most_once_in_observe_every_s(compiled, monkeypatch):
    """The check of a step against its rows verdict runs from cold caches; a run pays for it at most once in
    OBSERVE_EVERY_S, whatever the steps' rate."""
    clock = [100.0]
    monkeypatch.setattr(cpu_decode.time, "perf_counter", lambda: clock[0])
    library = cpu_decode.CpuDecode(compiled._lib, compiled.build)
    due = []
    for _ in range(10):  # ten steps a tenth of the interval apart, then one a whole interval later
        due.append(library.observation_due())
        clock[0] += cpu_decode.OBSERVE_EVERY_S / 10
    clock[0] += cpu_decode.OBSERVE_EVERY_S
    due.append(library.observation_due())
    assert due == [True] + [False] * 9 + [True]


@pytest.mark.parametrize("raced_seconds, contradicted", [(1e-12, True), (1e3, False)])
def test_decode_steps_that_contradict_the_rows_verdict_mark_it_stale_for_the_next_process(
        compiled, tiny_model_dir, tmp_path, monkeypatch, raced_seconds, contradicted):
    """The race's recorded seconds far below (or above) what this run's decode steps take at the same
    bytes streamed, on a quiet machine: the machine's verdict is marked stale (or not), the next process
    races it again, and the run's own record stays as the run used it."""
    import types

    from colorl import machine, verdicts
    from colorl.machine import machine_key

    monkeypatch.setenv("COLORL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("COLORL_CPU_DECODE_ROWS", raising=False)
    monkeypatch.delenv("COLORL_CPU_DECODE_PANEL_ROWS", raising=False)  # a forced loop is not the raced one
    raced = []

    def race(library, dtype):
        raced.append(dtype)
        seconds = {str(rows): [[raced_seconds, raced_seconds]] for rows in range(1, cpu_decode.MAX_ROWS + 1)}
        return {"won": [1, 2], "busy": False, "seconds": seconds, "panel_rows": [], "loops": {},
                "ties_to_loops_up_to": cpu_decode.MAX_ROWS, "panel_margin": 0.0, "few_rows_ask": "nta"}

    monkeypatch.setattr(cpu_decode, "race_rows", race)
    monkeypatch.setattr(cpu_decode, "RACE_MIN_BYTES", 1)  # the tiny model's weights count as a stream from memory
    monkeypatch.setattr(cpu_decode, "OBSERVE_EVERY_S", 0.0)  # every step checked: the tiny model's take microseconds
    monkeypatch.setattr(machine, "last_level_cache_bytes", lambda: None)
    monkeypatch.setattr(verdicts, "OthersLoad", lambda: types.SimpleNamespace(cores=lambda: 0.0))  # quiet
    monkeypatch.setattr(verdicts, "machine_busy", lambda: False)
    library = cpu_decode.CpuDecode(compiled._lib, compiled.build)
    monkeypatch.setattr(cpu_decode, "load", lambda: library)
    run = tmp_path / "run" / "kernels.json"
    run.parent.mkdir()
    verdicts.record_in_run(run)
    key = f"{machine_key()} {library.rows_verdict_name(torch.float32, torch.get_num_threads())}"
    try:
        eng = NativeEngine(tiny_model_dir, EngineConfig(num_blocks=16, block_size=4))
        params = SamplingParams(temperature=0.0, max_new_tokens=3 * verdicts.OBSERVATIONS, ignore_eos=True)
        eng.generate([GenerationRequest("a", [10, 11, 12], params)])
        machine = json.loads((tmp_path / "cache" / "kernels.json").read_text())[key]
        assert ("stale" in machine) == contradicted
        assert "stale" not in json.loads(run.read_text())[key]
        verdicts.record_in_run(None)  # the next process
        cpu_decode.CpuDecode(compiled._lib, compiled.build).rows_won(torch.float32)
        assert len(raced) == (2 if contradicted else 1)
    finally:
        verdicts.record_in_run(None)
        cpu_decode.race_bytes.cache_clear()  # in case it was first asked with the smallest size patched


ROWS, PANEL_ROWS = "COLORL_CPU_DECODE_ROWS", "COLORL_CPU_DECODE_PANEL_ROWS"


@pytest.mark.parametrize("name, value, rows", [
    (ROWS, "all", {*range(1, cpu_decode.MAX_PANEL_ROWS + 1), cpu_decode.PREFILL_ROWS}), (ROWS, "none", set()),
    (ROWS, "1,3", {1, 3}),
    (PANEL_ROWS, "all", set(range(1, cpu_decode.MAX_ROWS + 1))), (PANEL_ROWS, "none", set()), (PANEL_ROWS, "5,8", {5, 8})])
def test_the_decode_verdicts_can_be_forced_without_a_race(compiled, monkeypatch, name, value, rows):
    """The suite and the CI lanes force each extreme (the loops or oneDNN; a few rows over the panels or on the rows
    kernel), so every kernel runs at every row count whatever this CPU's race says."""
    monkeypatch.setenv(name, value)
    monkeypatch.setattr(cpu_decode, "race_rows", lambda library, dtype: pytest.fail("raced"))
    library = cpu_decode.CpuDecode(compiled._lib, compiled.build)
    read = library.rows_won if name == ROWS else library.panel_rows
    assert read(torch.float32) == rows and read(torch.bfloat16) == rows
    if name == ROWS:
        assert library.takes(1000, torch.float32) == (value == "all")  # above MAX_PANEL_ROWS: with 32 and PREFILL_ROWS
    else:  # above MAX_ROWS always over the panels
        assert {r for r in range(1, 2 * cpu_decode.MAX_ROWS) if library.on_panels(r, torch.float32)} == (
            rows | set(range(cpu_decode.MAX_ROWS + 1, 2 * cpu_decode.MAX_ROWS)))


@pytest.mark.parametrize("name, read, bad", [(ROWS, cpu_decode.forced_rows, cpu_decode.MAX_PANEL_ROWS + 1),
                                             (PANEL_ROWS, cpu_decode.forced_panel_rows, cpu_decode.MAX_ROWS + 1)])
def test_a_bad_forced_decode_verdict_is_one_clear_error(monkeypatch, name, read, bad):
    for value in (str(bad), "1,x"):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=name):
            read()


@pytest.mark.parametrize("dtype", cpu_decode.DTYPES)
def test_race_measures_every_row_count(compiled, monkeypatch, dtype):
    monkeypatch.setattr(cpu_decode, "race_bytes", lambda: cpu_decode.RACE_MIN_BYTES)  # the race's rules, not its size
    verdict = cpu_decode.race_rows(compiled, dtype)
    raced = {*range(1, cpu_decode.MAX_ROWS + 1), *cpu_decode.PANEL_RACE_ROWS}
    assert set(verdict["seconds"]) == set(verdict["loops"]) == {str(rows) for rows in raced}
    assert set(verdict["won"]) <= raced
    few = set(range(1, cpu_decode.MAX_ROWS + 1))  # the panels against the rows kernel
    assert set(verdict["panel_seconds"]) == {str(rows) for rows in few} and set(verdict["panel_rows"]) <= few
    assert verdict["loops"] == {str(rows): "panels" if rows in verdict["panel_rows"] or rows > cpu_decode.MAX_ROWS
                                else "rows kernel" for rows in raced}


@pytest.mark.parametrize("other_wins", [True, False])
def test_the_race_against_onednn_times_the_loop_a_few_rows_take(compiled, monkeypatch, other_wins):
    """The way 1-2 rows ask for their weights is raced first (whole steps of 1 and 2 rows, every way against none)
    and the rest runs asking that way. The panels' race against the rows kernel comes next; its winner at each
    row count is what races oneDNN, so the verdict's seconds (which VerdictWatch holds a run's steps to) are
    those of the loop a step runs. Up to MAX_ROWS oneDNN must win clearly (a tie stays with the loops, whose
    step runs every layer in one call); above, the loops must."""
    from colorl import verdicts

    calls, races, margins = [], [], []

    def stable_race(items, rounds, margin=verdicts.MARGIN):
        races.append(set(items))
        margins.append(margin)
        # the way to ask: l2 wins every step; the panels win 3 and 5 rows; each candidate wins, or none does (ties)
        won = ({item for item in items if item[0] == "l2"} if len(races) == 1 else {3, 5} if len(races) == 2
               else set(items) if other_wins else set())
        calls.append({})
        for rows, (candidate, baseline) in items.items():
            before = len(loop_calls)
            candidate()
            calls[-1][rows] = set(loop_calls[before:])
            baseline()
        return {"won": sorted(won, key=str), "busy": False, "seconds": {  # the way to ask: l2 the faster
            str(rows): [[0.5 if rows[0] == "l2" else 1.0, 2.0] if isinstance(rows, tuple) else [1.0, 2.0]]
            for rows in items}}

    loop_calls, steps = [], []
    monkeypatch.setattr(verdicts, "stable_race", stable_race)
    for name in ("linear", "panel_linear"):
        monkeypatch.setattr(compiled, name, lambda *args, name=name, call=getattr(compiled, name):
                            loop_calls.append(name) or call(*args))
    decode_layers = compiled.decode_layers
    monkeypatch.setattr(compiled, "decode_layers", lambda x, layers, step, scratch, head: steps.append(
        (len(x), bool(layers[0].p_qkv), bool(head.p))) or decode_layers(x, layers, step, scratch, head))
    ask_steps = []
    race_few_rows_ask = cpu_decode.race_few_rows_ask

    def ask_race(library, steps_of):
        ask_steps.extend(steps_of)
        verdict = race_few_rows_ask(library, steps_of)
        del steps[:]  # the ask's steps, apart
        return verdict

    monkeypatch.setattr(cpu_decode, "race_few_rows_ask", ask_race)
    verdict = cpu_decode.race_rows(compiled, torch.float32)
    assert ask_steps == [1, 2] and verdict["few_rows_ask"] == "l2"
    assert races[0] == {(ask, rows, loop) for ask in ("nta", "l2") for rows in (1, 2)
                        for loop in ("panels", "rows kernel")}
    assert margins[0] == 0.0 and compiled.few_rows_ask == "l2"  # the rest ran asking that way
    races, margins, calls = races[1:], margins[1:], calls[1:]
    few, many = set(range(1, cpu_decode.MAX_ROWS + 1)), set(cpu_decode.PANEL_RACE_ROWS)
    # the loops a few rows take are raced as whole decode steps (products called one by one ranked them otherwise
    # than the steps), every layer and the head over the panels, then all over the rows kernel; the layers hold
    # short rows and long ones, over which x leaves L1 (bench/README.md)
    assert steps == [(rows, over_panels, over_panels) for rows in sorted(few) for over_panels in (True, False)]
    assert {n_in for _, n_in in cpu_decode.RACE_LAYER} == {576, 1536}
    assert races[0] == few and verdict["panel_rows"] == [3, 5]
    assert margins == [verdicts.MARGIN] * 2  # the panels and oneDNN each win only clearly (the ask by any margin)
    candidates = calls[1]  # the loops are the candidate above MAX_ROWS only
    assert {rows for rows, loops in candidates.items() if loops == {"panel_linear"}} == many
    assert {rows for rows, loops in candidates.items() if not loops} == few
    assert set(verdict["won"]) == (many if other_wins else few)
    for rows in few:  # each pass's seconds as [loops, other], whichever was the candidate
        assert verdict["seconds"][str(rows)] == [[2.0, 1.0]]
    assert verdict["loops"] == {str(rows): "panels" if rows in {3, 5} | many else "rows kernel" for rows in few | many}


@pytest.mark.parametrize("kept", [{"panel_rows": []}, {"panel_rows": [], "loops": {}},
                                  {"panel_rows": [], "loops": {}, "ties_to_loops_up_to": 8},
                                  {"panel_rows": [], "loops": {}, "ties_to_loops_up_to": 8, "panel_margin": 0.05}])
def test_a_rows_verdict_raced_by_older_rules_is_raced_again(compiled, tmp_path, monkeypatch, kept):
    """Older verdicts: before the loop each row count races was named, before a tie went to the loops, before
    the panels and the rows kernel raced by any margin, and before the way 1-2 rows ask was raced with them."""
    from colorl.machine import machine_key

    monkeypatch.setenv("COLORL_CACHE", str(tmp_path))
    monkeypatch.delenv("COLORL_CPU_DECODE_ROWS", raising=False)
    library = cpu_decode.CpuDecode(compiled._lib, compiled.build)
    key = f"{machine_key()} {library.rows_verdict_name(torch.float32, torch.get_num_threads())}"
    old = {"won": [1], "busy": False, "seconds": {}, "measured": "2026-11-26 10:00:00", **kept}
    (tmp_path / "kernels.json").write_text(json.dumps({key: old}))
    monkeypatch.setattr(cpu_decode, "race_rows", lambda library, dtype: {
        "won": [1, 2], "busy": False, "seconds": {}, "panel_rows": [], "loops": {}, "ties_to_loops_up_to": 8,
        "panel_margin": 0.0, "few_rows_ask": "l2"})
    assert library.rows_won(torch.float32) == {1, 2}


def test_panel_row_counts_between_the_raced_ones_follow_both_neighbours():
    assert cpu_decode.PANEL_RACE_ROWS == (12, 16, 24, 32, cpu_decode.PREFILL_ROWS)
    assert cpu_decode.between_raced(frozenset({1, 2, 12, 16, 24, 32})) == {1, 2, *range(9, 33)}
    assert cpu_decode.between_raced(frozenset({12, 24, 32})) == {*range(9, 13), *range(24, 33)}  # 16 lost
    assert cpu_decode.between_raced(frozenset({1, 2, 3})) == {1, 2, 3}  # 9 and up follow 12, not 8's kernel


def test_an_engine_whose_loops_take_every_row_count_makes_no_onednn_copies(compiled, tiny_model_dir, monkeypatch):
    """Prefill through the panels too (where they won PREFILL_ROWS): oneDNN's packed copies, a second full copy
    of the weights, are never made; where some count goes to oneDNN they are, at each weight version — and never
    where oneDNN is off (COLORL_ONEDNN=0, or not in this torch), whichever counts the loops take."""
    for won, loops_take_prefill in ((frozenset({*range(1, 33), 256}), True), (frozenset(range(1, 33)), False)):
        monkeypatch.setattr(type(compiled), "rows_won", lambda self, dtype, won=won: won)
        eng = NativeEngine(tiny_model_dir, EngineConfig(num_blocks=64, block_size=4))
        eng.generate([GenerationRequest("a", list(range(10, 50)), SamplingParams(max_new_tokens=3, ignore_eos=True))])
        assert compiled.takes(40, torch.float32) == loops_take_prefill
        assert bool(eng.model.linears.packed._packed) == (onednn_chosen(torch.float32) and not loops_take_prefill)


def test_whole_layer_decode_over_panels_equals_the_per_operation_loops(compiled, tiny_model_dir, monkeypatch):
    """Steps of 9..18 one-token decodes run each layer in one call over the matrices' panels, bit-identical
    to the per-operation path over the same panels (from 16 rows on, the call splits the norms' and the SiLU's
    rows among its threads); the panels are made again after a weight load."""
    monkeypatch.setattr(type(compiled), "rows_won", lambda self, dtype: frozenset(range(1, 19)))
    calls = []
    whole_layers = cpu_decode.CpuDecode.decode_layers
    monkeypatch.setattr(cpu_decode.CpuDecode, "decode_layers",
                        lambda self, x, *rest: calls.append(x.shape[0]) or whole_layers(self, x, *rest))
    prompts = [list(range(10, 10 + n)) for n in range(3, 21)]  # 18 sequences
    outputs = []
    for per_operation in (False, True):
        compiled.seconds = {} if per_operation else None
        eng = NativeEngine(tiny_model_dir, EngineConfig(num_blocks=256, block_size=4, max_prefill_tokens=512,
                                                        decode_burst=1))  # a call per step (bursts: their own test)
        params = [SamplingParams(temperature=1.0, max_new_tokens=3 + i, ignore_eos=True, seed=i) for i in range(18)]
        outputs.append(eng.generate([GenerationRequest(str(i), p, params[i]) for i, p in enumerate(prompts)]))
        compiled.seconds = None
        if not per_operation:
            assert set(range(9, 19)) <= set(calls)
            assert eng.model.linears.panels._panels  # made on first use
            eng.model.load_hf_weights(eng.model.hf_weights().items())
            assert not eng.model.linears.panels._panels  # a new weight version drops them
    for whole, reference in zip(*outputs):
        assert whole.output_ids == reference.output_ids
        assert whole.logprobs == reference.logprobs


def test_the_layers_pointers_are_kept_between_steps_and_rebuilt_after_a_weight_load(compiled, tiny_model_dir,
                                                                                    monkeypatch):
    """The whole-layer decode's array of every layer's pointers (CausalLM._compiled_layers) is built once for a run
    of decode steps and kept; a weight load drops the panels it points into, so the next step builds it again
    over the new panels, and decodes exactly as the per-operation path does with the new weights."""
    monkeypatch.setattr(type(compiled), "rows_won", lambda self, dtype: frozenset(range(1, 13)))
    built = []
    original = DecoderLayer.compiled_tensors
    monkeypatch.setattr(DecoderLayer, "compiled_tensors", lambda self, *args: built.append(self) or original(self, *args))
    prompts = [list(range(10, 10 + n)) for n in range(3, 15)]  # 12 sequences: every decode step over the panels
    params = [SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=i) for i in range(12)]
    requests = lambda tag: [GenerationRequest(f"{tag}{i}", p, params[i]) for i, p in enumerate(prompts)]  # noqa: E731
    halved = lambda eng: [(name, t * 0.5) for name, t in eng.model.hf_weights().items()]  # noqa: E731
    eng = NativeEngine(tiny_model_dir, EngineConfig(num_blocks=128, block_size=4, max_prefill_tokens=256))
    eng.generate(requests("a"))
    layers = len(eng.model.layers)
    assert len(built) == layers  # once, for five decode steps
    eng.load_weights(halved(eng))
    after_load = eng.generate(requests("b"))
    assert len(built) == 2 * layers  # again, over the new weights' panels
    reference = NativeEngine(tiny_model_dir, EngineConfig(num_blocks=128, block_size=4, max_prefill_tokens=256))
    reference.load_weights(halved(reference))
    compiled.seconds = {}  # the per-operation path
    try:
        expected = reference.generate(requests("b"))
    finally:
        compiled.seconds = None
    for got, want in zip(after_load, expected):
        assert got.output_ids == want.output_ids
        assert got.logprobs == want.logprobs


@pytest.mark.parametrize("env, said", [({"COLORL_CPU_DECODE": "0"}, ""),
                                       ({"CC": "/nonexistent/cc"}, "not used: no C compiler found")])
def test_without_the_loops_the_engine_runs_torch_and_says_why(env, said, tmp_path):
    """Switched off (silently: the user asked), or no compiler (one line saying so): `load()` says None."""
    code = "import sys, colorl.engines.native.cpu_decode as c; sys.exit(0 if c.load() is None else 1)"
    extra = {"PATH": str(tmp_path)} if "CC" in env else {}  # no `cc` on the PATH either
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "COLORL_CACHE": str(tmp_path), **env, **extra},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "decode loops" in line]
    assert (len(lines) == 1 and said in lines[0]) if said else not lines


@pytest.mark.parametrize("vocab", [1000, 49152, 7])  # not a multiple of the chunk; SmolLM2's; one partial chunk
def test_compiled_sampler_draws_what_the_torch_sampler_draws(compiled, vocab):
    """The compiled plain sampler takes the two-level inverse CDF's steps: the same token for the same u (but
    where u falls within float rounding of a boundary) and the same log-prob, on 1 and 2 threads."""
    from colorl.engines.native.sampler import Sampler

    generator = torch.Generator().manual_seed(vocab)
    logits = 3 * torch.randn(300, vocab, generator=generator)
    u = torch.rand(300, generator=generator, dtype=torch.float64).clamp_(min=1e-12)
    expected, expected_logps = Sampler._inverse_cdf_two_level(logits, u[:, None])
    for threads in (1, 2):
        with pinned(threads):
            tokens, logps = compiled.sample_plain(logits, u.tolist())
        tokens, logps = torch.tensor(tokens), torch.tensor(logps)
        assert (tokens == expected).float().mean() > 0.99
        same = tokens == expected
        torch.testing.assert_close(logps[same], expected_logps[same], atol=2e-5, rtol=1e-5)
        assert ((tokens >= 0) & (tokens < vocab)).all()
    edges = torch.tensor([1.0, 1e-300], dtype=torch.float64)  # the last token's mass; the first token
    tokens, _ = compiled.sample_plain(torch.zeros(2, vocab), edges.tolist())
    assert tokens == [vocab - 1, 0]


def test_engine_samples_through_the_compiled_sampler_only_with_the_loops(compiled, tiny_model_dir, monkeypatch):
    """Plain rows (no top-k/top-p) are drawn by the compiled sampler when the model runs its compiled loops,
    and by torch's operators when it does not (the reference path); rows with top-p always by torch's."""
    calls = []
    original = cpu_decode.CpuDecode.sample_plain
    monkeypatch.setattr(cpu_decode.CpuDecode, "sample_plain",
                        lambda self, z, u: calls.append(z.shape[0]) or original(self, z, u))
    for use_compiled, top_p, drawn in ((True, 1.0, True), (False, 1.0, False), (True, 0.9, False)):
        calls.clear()
        eng = NativeEngine(tiny_model_dir, EngineConfig(num_blocks=32, block_size=4))
        eng.model.use_compiled = use_compiled
        eng.generate([GenerationRequest("a", [10, 11, 12], SamplingParams(temperature=1.0, top_p=top_p,
                                                                          max_new_tokens=3, ignore_eos=True))])
        assert bool(calls) == drawn, (use_compiled, top_p)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", cpu_decode.DTYPES)
@pytest.mark.parametrize("sequences, panel_rows", [(3, "none"), (3, "all"), (11, "all")])  # rows kernel, panels
def test_a_decode_steps_logits_come_from_the_layers_call_bit_for_bit(compiled, tmp_path, monkeypatch, dtype, sequences,
                                                                    panel_rows, tied):
    """A step of one-token decodes whose every token samples makes its logits in the whole-layer call (the final
    norm and the LM head after the layers): the very bits the layers call followed by the per-operation norm,
    head and `.float()` give, with the head tied or its own, over the rows kernel or the panels."""
    from dataclasses import replace

    from colorl.models import save_tiny_model

    monkeypatch.setenv("COLORL_CPU_DECODE_PANEL_ROWS", panel_rows)
    monkeypatch.setattr(type(compiled), "rows_won", lambda self, dtype: frozenset(range(1, 13)))
    heads = []
    whole_layers = cpu_decode.CpuDecode.decode_layers
    monkeypatch.setattr(cpu_decode.CpuDecode, "decode_layers",
                        lambda self, *args: heads.append(args[4] if len(args) > 4 else None) or whole_layers(self, *args))
    folder = save_tiny_model(tmp_path / "m", tie_word_embeddings=tied)
    eng = NativeEngine(folder, EngineConfig(num_blocks=64, block_size=4, max_prefill_tokens=256), dtype=dtype)
    assert (eng.model.lm_head is None) == tied
    params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    for i in range(sequences):
        eng.add(GenerationRequest(str(i), list(range(10, 14 + i)), params))
    eng.step()  # the prefills
    batch = eng.scheduler.schedule()
    step, _ = eng.runner.prepare(batch)
    assert step.every_token_samples and len(step.logit_rows) == sequences
    with torch.inference_mode():
        fused = eng.model(step, eng.runner.kv_cache)  # writes the step's K/V; the next call writes the same again
        assert heads == [heads[0]] and heads[0] is not None
        assert (heads[0].p is not None) == (sequences > cpu_decode.MAX_ROWS or panel_rows == "all")
        per_operation = eng.model(replace(step, every_token_samples=False), eng.runner.kv_cache)
    assert heads[1] is None  # the layers alone, then the norm and head in Python
    assert fused.dtype == torch.float32 and fused.shape == (sequences, eng.spec.vocab_size)
    assert torch.equal(fused, per_operation)


@pytest.mark.parametrize("cache_mib, raced_mib", [(None, 81), (32, 81), (300, 600), (4096, 1024)])
def test_a_race_streams_twice_the_last_level_cache(monkeypatch, cache_mib, raced_mib):
    """Over weights the last-level cache holds other kernels win than over a decode step's stream from memory
    (bench/race_size.py): the race streams twice that cache, at least 85 MB and at most 1 GiB, in whole
    matrices, and its verdict is kept under a name of its own when it is not the smallest size."""
    from colorl import machine

    monkeypatch.setattr(machine, "last_level_cache_bytes", lambda: cache_mib and cache_mib * 2**20)
    cpu_decode.race_bytes.cache_clear()
    try:
        size = cpu_decode.race_bytes()
        assert size % cpu_decode.RACE_LAYER_BYTES == 0 and 0 <= size - raced_mib * 2**20 < cpu_decode.RACE_LAYER_BYTES
        assert size >= 2 * (cache_mib or 0) * 2**20 or size >= cpu_decode.RACE_MAX_BYTES
        library = cpu_decode.CpuDecode.__new__(cpu_decode.CpuDecode)
        library.build, library.amx = "b", False
        assert library.rows_verdict_name(torch.float32, 2).endswith(
            "rows at 2 threads over steps of 960x576/576x576/3072x576/576x1536"
            + ("" if raced_mib == 81 else f", {size // 2**20} MiB") + ", panels back to back")
    finally:
        cpu_decode.race_bytes.cache_clear()


def test_the_last_level_cache_is_read_from_sysfs(tmp_path):
    from colorl.machine import last_level_cache_bytes

    for index, (kind, level, size) in enumerate([("Data", 1, "48K"), ("Instruction", 1, "32K"), ("Unified", 2, "2048K"),
                                                 ("Unified", 3, "300M")]):
        folder = tmp_path / "cache" / f"index{index}"
        folder.mkdir(parents=True)
        for name, value in (("type", kind), ("level", str(level)), ("size", size)):
            (folder / name).write_text(value + "\n")
    assert last_level_cache_bytes(str(tmp_path / "cache")) == 300 * 2**20
    (tmp_path / "cache" / "index3" / "size").write_text("garbage\n")  # unreadable: the level below
    assert last_level_cache_bytes.__wrapped__(str(tmp_path / "cache")) == 2 * 2**20


@pytest.mark.parametrize("dtype", cpu_decode.DTYPES)
def test_a_raced_step_gives_the_same_logits_over_the_panels_and_the_rows_kernel(compiled, dtype):
    """The race's two decode steps differ in their loops only: same layers, same inputs, the same logits (to the
    sums' order), finite, on weights scaled so that a layer's outputs stay about unit. In bf16 each layer's outputs are
    rounded to bf16, and two orders of the same sums may round a value to either side: that reaches the logits (up
    to about 4 here, a bf16 step of 1/64 at 2-4) as up to about one step, hence atol 2e-2 there."""
    gen = torch.Generator().manual_seed(0)
    weights = cpu_decode.race_weights(dtype, cpu_decode.RACE_LAYER_BYTES, gen)[:2 * len(cpu_decode.RACE_LAYER)]
    panels = [compiled.pack_panels(w) for w in weights]
    over_panels, over_rows_kernel = cpu_decode.race_steps(compiled, dtype, weights, panels, (1, 3), gen)[3]
    first, second = over_panels(), over_rows_kernel()
    assert first.shape == (3, cpu_decode.RACE_VOCAB) and first.isfinite().all()
    torch.testing.assert_close(first, second, **{**TOLERANCE[dtype], **({"atol": 2e-2} if dtype == torch.bfloat16 else {})})
    torch.testing.assert_close(over_panels(), first, rtol=0, atol=0)  # each step from the same stream
