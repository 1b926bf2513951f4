"""Which kernels compute here, and why: the CPU, what oneDNN runs, whether the native engine's compiled
loops are used, and each per-machine verdict (forced, raced, or raced on a busy machine). Printed by
`colorl doctor --kernels` and at the top of every test session, so a failure names the machine and the
kernels it ran with."""
from __future__ import annotations

import os

import torch

DTYPES = (torch.float32, torch.bfloat16)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


ASK_TEXT = {"none": "not at all ahead", "nta": "ahead past the caches (prefetchnta)", "l2": "ahead into L2"}


def _source(forced_by: str | None, verdict: dict | None) -> str:
    if forced_by:
        return f"forced by {forced_by}"
    if verdict is None:
        return "raced"
    return "raced on a busy machine, provisional" if verdict.get("busy") else "raced"


def _rows_text(rows: frozenset[int]) -> str:
    """Row counts as runs: "1-8,12-32", and "33+" for every count above MAX_PANEL_ROWS (raced at PREFILL_ROWS)."""
    from colorl.engines.native.cpu_decode import MAX_PANEL_ROWS, PREFILL_ROWS

    if not rows:
        return "none"
    above = f",{MAX_PANEL_ROWS + 1}+" if {MAX_PANEL_ROWS, PREFILL_ROWS} <= rows else ""
    rows = frozenset(r for r in rows if r <= MAX_PANEL_ROWS)
    runs: list[list[int]] = []
    for count in sorted(rows):
        if runs and count == runs[-1][1] + 1:
            runs[-1][1] = count
        else:
            runs.append([count, count])
    return ",".join(f"{a}-{b}" if b > a + 1 else (f"{a},{b}" if b > a else str(a)) for a, b in runs) + above


def _amx_text(library) -> str:
    if library.amx:
        return ", bf16 panels on AMX tiles"
    if library.amx_built:  # a CPU with AMX whose tiles are off: say why the FMA loops run
        from colorl.engines.native.cpu_decode import amx_wanted

        why = "Linux refused the AMX tile state" if amx_wanted() else "COLORL_CPU_DECODE_AMX=0"
        return f", bf16 panels on the FMA loops ({why})"
    return ""


def kernel_lines(thread_counts: tuple[int, ...] | None = None) -> list[str]:
    """One line for the CPU, one for the loops' build, one per thread count and dtype. Races what is not
    decided yet (as the first run here would)."""
    from colorl import kernels, precision
    from colorl.engines.native import cpu_decode
    from colorl.machine import ISA_VARIABLES, cpu_summary
    from colorl.verdicts import kept_verdict

    lines = [f"cpu: {cpu_summary()}"]
    runs = sorted(_short(d) for d in kernels.onednn_dtypes())
    caps = " ".join(f"{name}={os.environ[name]}" for name in ISA_VARIABLES if os.environ.get(name))
    lines.append(f"oneDNN runs: {', '.join(runs) or 'nothing (off, not x86, or not in this torch)'}"
                 + (f" ({caps})" if caps else ""))
    library = cpu_decode.load()
    team = ("" if library is None or library.one_team
            else ", a team of threads per loop of a step (COLORL_CPU_DECODE_TEAM=0)")
    lines.append(f"decode loops: built {library.build}" + _amx_text(library) + team
                 if library is not None else f"decode loops: not used ({cpu_decode.why_not()})")
    threads_now = torch.get_num_threads()
    forced_onednn = "COLORL_ONEDNN=" + os.environ["COLORL_ONEDNN"] if kernels.forced_onednn() is not None else None
    forced_rows = ("COLORL_CPU_DECODE_ROWS=" + os.environ["COLORL_CPU_DECODE_ROWS"]
                   if cpu_decode.forced_rows() is not None else None)
    forced_panels = ("COLORL_CPU_DECODE_PANEL_ROWS=" + os.environ["COLORL_CPU_DECODE_PANEL_ROWS"]
                     if cpu_decode.forced_panel_rows() is not None else None)
    forced_ask = ("COLORL_CPU_DECODE_ASK=" + os.environ["COLORL_CPU_DECODE_ASK"]
                  if cpu_decode.forced_few_rows_ask() is not None else None)
    try:
        for threads in thread_counts or (threads_now,):
            torch.set_num_threads(threads)
            for dtype in DTYPES:
                if dtype in kernels.onednn_dtypes():
                    uses = []
                    for use in (kernels.SERVING, kernels.TRAINING):
                        chosen = kernels.onednn_chosen(dtype, use)
                        verdict = None if forced_onednn else kept_verdict(kernels.onednn_verdict_name(dtype, threads, use))
                        uses.append(f"{use} {'oneDNN' if chosen else 'torch (MKL)'} ({_source(forced_onednn, verdict)})")
                    products = ", ".join(uses)
                elif dtype == torch.bfloat16 and kernels.bf16_widened():
                    products = "float32 over the bf16 values (no bf16 instructions here)"
                else:
                    products = "torch"
                text = f"{threads} thread{'s' if threads > 1 else ''}, {_short(dtype)}: products {products}"
                if library is not None:
                    rows = library.rows_won(dtype)
                    few, ask = library.panel_rows(dtype), library.few_rows_ask_for(dtype)
                    verdict = kept_verdict(library.rows_verdict_name(dtype, threads))  # all three raced together
                    text += (f"; decode rows on the loops: {_rows_text(rows)} ({_source(forced_rows, verdict)}), "
                             f"of {cpu_decode.MAX_ROWS} or fewer over the panels: {_rows_text(few)} "
                             f"({_source(forced_panels, verdict)}), "
                             f"1-{cpu_decode.FEW_ROWS} rows asking for their weights {ASK_TEXT[ask]} "
                             f"({_source(forced_ask, verdict)}); "
                             "decode attention, norms, RoPE: the loops")
                else:
                    text += "; decode attention: torch SDPA"
                lines.append(text)
            bf16, why = precision.auto_bf16()
            lines.append(f"{threads} thread{'s' if threads > 1 else ''}, training and serving float32 weights "
                         f"(precision auto): {'bf16' if bf16 else 'fp32'} ({why})")
    finally:
        torch.set_num_threads(threads_now)
    return lines
