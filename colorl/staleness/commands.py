"""`colorl predict` and `colorl simulate`: staleness and step period before launch.

predict: the closed-form model for a config, with ρ and M_tail given, taken from
`rollout.length_override`, or measured in a run's metrics.jsonl (`--from`).
simulate: the same configuration through the discrete-event simulator, optionally swept over
one variable, next to the formula (rich table, JSON, PNG).

Every bad input ends as one line on stderr and exit code 2. A config that turns on what neither
model has gets one note line on stderr naming it: multi-turn episodes (`task.env`: one completion
per sample, no turns or tools), and in bounded-lag mode redundancy, the zero-variance filter and
`partial_rollout: recompute` (the models let a sample run on across updates, as `keep` does); more
than one rank (the models run one buffer of G groups, the run one of G/world per rank in lock-step).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from colorl.staleness import formula
from colorl.staleness.formula import LengthModel, Workload
from colorl.staleness.live import predicted_split, predicted_staleness
from colorl.staleness.simulator import SimConfig, simulate

SENSITIVITY_RHOS = (0.5, 0.8, 0.9, 1.1, 1.5, 2.0)  # not 1: IQS jumps from 1 to q there
ASSUMED_TAILNESS = 50.0
MAX_SWEEP_POINTS = 200


class UsageError(ValueError):
    """Bad command-line input; the message is one line for the terminal."""


@dataclass(frozen=True)
class Setup:
    """What predict and simulate read from a `colorl.config.Config`."""

    workload: Workload
    mode: str  # colocated | bounded_lag
    buffer: str  # staleflow | queue_drop | queue_max
    eta: int
    lengths: LengthModel | None  # rollout.length_override
    max_new_tokens: int
    episodes: bool = False  # task.env: a sample is a multi-turn episode, which neither model has
    left_out: tuple[str, ...] = ()  # the other settings of the run that neither model has, as key=value

    @classmethod
    def from_config(cls, cfg: Any) -> Setup:
        rollout, stale = cfg.rollout, cfg.staleness
        override = rollout.length_override
        lengths = None
        if override is not None:
            cap = getattr(override, "cap", None) or rollout.max_new_tokens
            lengths = LengthModel(float(override.mean), float(override.tailness), int(cap))
        return cls(
            workload=Workload(rollout.concurrency, rollout.batch_groups, rollout.group_size,
                              float(stale.queue_factor)),
            mode=cfg.mode, buffer=stale.buffer, eta=int(stale.max), lengths=lengths,
            max_new_tokens=rollout.max_new_tokens, episodes=bool(cfg.task.env), left_out=_left_out(cfg))

    def sim_buffer(self) -> tuple[str, int | None]:
        """Colocated training is what StaleFlow with η = 0 reduces to: sync, staleness 0."""
        if self.mode == "colocated":
            return "staleflow", 0
        return self.buffer, self.eta


@dataclass(frozen=True)
class MeasuredRun:
    """Means over a run's metrics.jsonl after its first (warm-up) step."""

    steps: int
    v_rollout: float | None
    v_train: float | None
    rho: float | None
    m_tail: float | None
    mean_len: float | None
    max_len: float | None
    staleness_mean: float | None
    time_step_s: float | None


def _mean_of(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records
              if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
              and math.isfinite(r[key])]
    return sum(values) / len(values) if values else None


def read_run(run_dir: str | Path) -> MeasuredRun:
    """Read v_R, v_T, ρ, M_tail and lengths from RUN_DIR/metrics.jsonl. A torn last line
    (a run still writing) is skipped; the first step is dropped when there are three or more
    (it carries start-up costs)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise UsageError(f"--from {run_dir}: no such run directory")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise UsageError(f"--from {run_dir}: no metrics.jsonl in this directory")
    from colorl.metrics.logger import read_metrics

    records = read_metrics(path)  # torn lines skipped; a step redone after a resume counted once
    if not records:
        raise UsageError(f"--from {run_dir}: metrics.jsonl has no complete line")
    if len(records) >= 3:
        records = records[1:]
    v_rollout = _mean_of(records, "rollout_tokens_per_s")
    v_train = _mean_of(records, "train_tokens_per_s")
    rho = v_rollout / v_train if v_rollout and v_train else _mean_of(records, "rho")
    return MeasuredRun(
        steps=len(records), v_rollout=v_rollout, v_train=v_train, rho=rho,
        m_tail=_mean_of(records, "m_tail"), mean_len=_mean_of(records, "response_len_mean"),
        max_len=_mean_of(records, "response_len_max"),
        staleness_mean=_mean_of(records, "staleness_mean"),
        time_step_s=_mean_of(records, "time_step_s"))


def assumed_lengths(setup: Setup) -> LengthModel:
    """Lengths when neither the config nor a run gives them: mean max_new_tokens/4, tailness 50."""
    return LengthModel(max(1.0, setup.max_new_tokens / 4), ASSUMED_TAILNESS, setup.max_new_tokens)


def episodes_note(setup: Setup, command: str) -> str | None:
    """One line for a multi-turn config: both models time one completion per sample, not turns and tools."""
    if not setup.episodes:
        return None
    if command == "predict":
        models, inputs = "the formula treats", "pass --from RUN_DIR for ρ and lengths measured on episodes"
    else:
        models, inputs = ("the simulator and the formula treat",
                          "set --mean-len and --tailness from the episodes' sampled tokens")
    return (f"colorl {command}: note: task.env is set: {models} each episode as one completion, so L and "
            f"M_tail are an episode's sampled tokens over all its turns, and environment and tool time is not "
            f"modelled ({inputs}; docs/staleness.md)")


def _left_out(cfg: Any) -> tuple[str, ...]:
    stale, parts = cfg.staleness, []
    if cfg.mode == "bounded_lag":
        if stale.redundancy is not None:
            parts.append(f"staleness.redundancy={stale.redundancy.level}")
        if cfg.filter.zero_variance:
            parts.append("filter.zero_variance=true")
        if stale.partial_rollout == "recompute":  # keep is what the models assume: a sample runs on across updates
            parts.append("staleness.partial_rollout=recompute (its re-prefill work)")
    if cfg.launch.nproc > 1:
        parts.append(f"launch.nproc={cfg.launch.nproc} (modelled as one rank holding all G groups)")
    return tuple(parts)


def left_out_note(setup: Setup, command: str) -> str | None:
    """One line naming everything the run does that the models leave out (None: nothing)."""
    episodes = episodes_note(setup, command)
    if not setup.left_out:
        return episodes
    rest = f"not modelled: {', '.join(setup.left_out)}; the figures are for a run without them"
    return f"{episodes}; {rest}" if episodes else f"colorl {command}: note: {rest}"


def _print_note(setup: Setup, command: str) -> None:
    """On stderr, so `--json` stays one JSON document on stdout."""
    note = left_out_note(setup, command)
    if note:
        print(note, file=sys.stderr)


def _positive(name: str, value: float | None) -> None:
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise UsageError(f"{name} must be a positive number, got {value}")


# --- predict ------------------------------------------------------------------------------

def advice(setup: Setup, pred: formula.Prediction) -> list[str]:
    """The seed's rules of thumb, applied to this operating point."""
    w, rho = setup.workload, pred.rho
    tips = []
    if rho >= 1:
        tips.append(
            f"Train-bound (ρ = {rho:.2f}): prefer rollout-bound — give training more compute "
            f"(or rollout less) until ρ < 1. A train-bound point only beats the rollout-bound "
            f"point of equal t_period when rollout compute at balance is below "
            f"β_crit(q) = {formula.beta_crit(w.queue_factor):.3f} of train compute.")
    if setup.buffer == "queue_drop" and w.queue_factor > 1:
        q = w.queue_factor
        if rho >= 1:
            cost = f"adds {(q - 1) / rho:.2f} steps of in-queue staleness at this ρ"
        else:
            cost = (f"costs nothing while rollout-bound but adds {q - 1:.2f} steps of "
                    f"in-queue staleness as soon as ρ reaches 1")
        tips.append(f"Set staleness.queue_factor = 1: q = {q:g} {cost}.")
    if rho < 1 and pred.pqs > pred.iqs:
        tips.append(f"Pre-queue staleness dominates (PQS = {pred.pqs:.2f} ∝ C·M_tail/B): lower "
                    f"rollout.concurrency or raise rollout.batch_groups to cut it, at the cost "
                    f"of a longer step.")
    if pred.m_tail >= 1.5:
        tips.append(f"Long-tailed lengths (M_tail = {pred.m_tail:.2f}): stragglers set the group "
                    f"time; a lower rollout.max_new_tokens cap shortens the tail.")
    if setup.buffer == "queue_max":
        tips.append("queue_max discards long samples and trains on shorter answers than it "
                    "samples; prefer queue_drop (unbiased) or staleflow.")
    if setup.buffer == "staleflow" and setup.mode == "bounded_lag" and pred.staleness > setup.eta:
        tips.append(f"η = {setup.eta} binds (queue-drop would give {pred.staleness:.2f}): "
                    f"StaleFlow keeps staleness <= η by idling rollout slots; run `colorl "
                    f"simulate` to see the idle fraction and the step period.")
    if not tips:
        tips.append("Rollout-bound with q = 1: already on the better side of the "
                    "staleness/throughput frontier.")
    return tips


def predict_report(setup: Setup, rho: float, m_tail: float, *, mean_len: float | None = None,
                   v_rollout: float | None = None,
                   measured: MeasuredRun | None = None) -> dict[str, Any]:
    """Everything `colorl predict` shows, as one JSON-able dict."""
    w = setup.workload
    pred = formula.predict(w, rho, m_tail, v_rollout=v_rollout, mean_len=mean_len)
    split = predicted_split(w.concurrency, w.batch_rollouts, w.queue_factor, rho, m_tail,
                            "bounded_lag", setup.buffer, setup.eta)
    v_train = v_rollout / rho if v_rollout else None
    report: dict[str, Any] = {
        "pqs": split.pqs, "iqs": split.iqs, "staleness": split.staleness,
        "t_period": pred.t_period, "rho": rho, "m_tail": m_tail, "regime": pred.regime,
        "mode": setup.mode, "buffer": setup.buffer, "eta": setup.eta,
        "pqs_queue_drop": pred.pqs, "iqs_queue_drop": pred.iqs,
        "staleness_queue_drop": pred.staleness,
        "concurrency": w.concurrency, "batch_rollouts": w.batch_rollouts,
        "queue_factor": w.queue_factor, "mean_len": mean_len, "v_rollout": v_rollout,
        "v_train": v_train,
        "measured_staleness": measured.staleness_mean if measured else None,
        "advice": advice(setup, pred),
    }
    if setup.mode == "colocated":
        # On-policy: nothing is stale; the step is rollout then train, back to back.
        report["bounded_lag"] = {k: report[k] for k in ("pqs", "iqs", "staleness", "t_period")}
        sync_period = (w.batch_rollouts * mean_len * (1 / v_rollout + 1 / v_train)
                       if mean_len and v_rollout else None)
        report["bounded_lag"]["advice"] = report["advice"]
        report.update(pqs=0.0, iqs=0.0, staleness=0.0, t_period=sync_period, advice=[],
                      eta=0, buffer=setup.sim_buffer()[0])
    return report


def _fmt(value: Any, spec: str = ".2f") -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan"
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def _console():
    """Rich console; piped output gets a wide fixed width instead of rich's 80 columns."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=160)


def _print_predict(report: dict[str, Any], sources: dict[str, str], setup: Setup) -> None:
    from rich.table import Table

    console = _console()
    w = setup.workload
    buffer, eta = setup.sim_buffer()
    title = (f"Staleness prediction — C={w.concurrency}, G={w.batch_groups}, "
             f"S={w.group_size} (B={w.batch_rollouts}), q={w.queue_factor:g}, "
             f"mode={setup.mode}, buffer={buffer}, η={eta}")
    table = Table(title=title, title_justify="left")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("from / meaning")
    colocated = setup.mode == "colocated"
    async_part = report.get("bounded_lag", report)
    table.add_row("ρ = v_R / v_T", _fmt(report["rho"]), sources["rho"])
    table.add_row("M_tail", _fmt(report["m_tail"], ".3f"), sources["m_tail"])
    table.add_row("regime", report["regime"], "ρ < 1 rollout-bound, ρ >= 1 train-bound")
    if colocated:
        table.add_row("staleness (colocated)", "0.00", "on-policy: every sample is trained by the "
                      "version that generated it")
    else:
        table.add_row("PQS (queue-drop)", _fmt(report["pqs_queue_drop"]), "C·M_tail / (B·max(1, ρ))")
        table.add_row("IQS (queue-drop)", _fmt(report["iqs_queue_drop"]),
                      "ρ, or (2q + ρ − 1)/(2ρ) when train-bound")
        table.add_row("staleness (queue-drop)", _fmt(report["staleness_queue_drop"]), "PQS + IQS")
        if setup.buffer != "queue_drop":
            table.add_row(f"staleness ({setup.buffer}, η={setup.eta})",
                          f"{_fmt(async_part['pqs'])} + {_fmt(async_part['iqs'])} = "
                          f"{_fmt(async_part['staleness'])}",
                          "PQS + IQS, η-bounded (split scaled from queue-drop)")
    period = report["t_period"]
    table.add_row("t_period (s)", _fmt(period),
                  sources["t_period"] if period is None else
                  ("rollout + train, back to back" if setup.mode == "colocated"
                   else "B·E[L] / min(v_R, v_T)"))
    if report["measured_staleness"] is not None:
        table.add_row("measured staleness_mean", _fmt(report["measured_staleness"]), "--from run")
    console.print(table)
    if colocated:
        console.print("pass --mode bounded_lag to see what the asynchronous mode would give (PQS, IQS, "
                      "η) and its advice")
        return

    sens = Table(title="If ρ drifts (queue-drop formula)", title_justify="left")
    sens.add_column("ρ", justify="right")
    for name in ("PQS", "IQS", "staleness"):
        sens.add_column(name, justify="right")
    for rho in SENSITIVITY_RHOS:
        p = formula.predict(w, rho, report["m_tail"])
        sens.add_row(f"{rho:g}", _fmt(p.pqs), _fmt(p.iqs), _fmt(p.staleness))
    console.print(sens)
    console.print("[bold]Advice[/bold]")
    for tip in report["advice"]:
        console.print(f"  • {tip}")


def run_predict(args: argparse.Namespace) -> int:
    setup = Setup.from_config(_load(args))
    _positive("--rho", args.rho)
    _positive("--rollout-tps", args.rollout_tps)
    if args.m_tail is not None and not (args.m_tail >= 1 and math.isfinite(args.m_tail)):
        raise UsageError(f"--m-tail must be >= 1 (E[max] >= E[L]), got {args.m_tail}")
    measured = read_run(args.from_dir) if args.from_dir else None
    if args.mode:
        setup = replace(setup, mode=args.mode)
    sources: dict[str, str] = {}

    rho = args.rho
    sources["rho"] = "--rho"
    if rho is None and measured and measured.rho:
        rho, sources["rho"] = measured.rho, f"measured ({measured.steps} steps)"
    if rho is None:
        rho, sources["rho"] = 1.0, "assumed balanced; pass --rho or --from"

    m_tail = args.m_tail
    sources["m_tail"] = "--m-tail"
    if m_tail is None and measured and measured.m_tail:
        m_tail, sources["m_tail"] = measured.m_tail, f"measured ({measured.steps} steps)"
    if m_tail is None and setup.lengths is not None:
        m_tail = setup.lengths.m_tail(setup.workload.group_size)
        sources["m_tail"] = "exact, rollout.length_override"
    if m_tail is None:
        assumed = assumed_lengths(setup)
        m_tail = assumed.m_tail(setup.workload.group_size)
        sources["m_tail"] = (f"assumed: lengths of mean {assumed.mean:g}, tailness {assumed.tailness:g}, "
                             f"cap {assumed.cap} (pass --m-tail or --from RUN_DIR)")

    mean_len = measured.mean_len if measured else None
    if mean_len is None and setup.lengths is not None:
        mean_len = setup.lengths.expected_length()
    v_rollout = args.rollout_tps or (measured.v_rollout if measured else None)
    sources["t_period"] = "needs E[L] and v_R: pass --from or --rollout-tps"
    report = predict_report(setup, rho, m_tail, mean_len=mean_len, v_rollout=v_rollout,
                            measured=measured)
    _print_note(setup, "predict")
    if args.json:
        print(json.dumps(report))
    else:
        _print_predict(report, sources, setup)
    return 0


# --- simulate -----------------------------------------------------------------------------

# Sweepable variables: spelling on the command line -> (field, must be an integer)
SWEEP_KEYS: dict[str, tuple[str, bool]] = {
    "rho": ("rho", False),
    "tailness": ("tailness", False),
    "mean_len": ("mean_len", False), "mean-len": ("mean_len", False),
    "q": ("queue_factor", False), "queue_factor": ("queue_factor", False),
    "staleness.queue_factor": ("queue_factor", False),
    "C": ("concurrency", True), "concurrency": ("concurrency", True),
    "rollout.concurrency": ("concurrency", True),
    "G": ("batch_groups", True), "batch_groups": ("batch_groups", True),
    "rollout.batch_groups": ("batch_groups", True),
    "S": ("group_size", True), "group_size": ("group_size", True),
    "rollout.group_size": ("group_size", True),
    "eta": ("eta", True), "staleness.max": ("eta", True),
}


def parse_sweep(spec: str) -> tuple[str, list[float]]:
    """`key=start:stop:step` (stop inclusive) -> (field, values)."""
    key, sep, span = spec.partition("=")
    if not sep:
        raise UsageError(f"--sweep {spec!r}: expected key=start:stop:step")
    key = key.strip()
    if key not in SWEEP_KEYS:
        raise UsageError(f"--sweep {spec!r}: unknown key {key!r}; one of "
                         f"{', '.join(sorted({k for k in SWEEP_KEYS if '.' not in k}))}")
    field, integral = SWEEP_KEYS[key]
    parts = span.split(":")
    if len(parts) != 3:
        raise UsageError(f"--sweep {spec!r}: expected start:stop:step after '='")
    try:
        start, stop, step = (float(p) for p in parts)
    except ValueError:
        raise UsageError(f"--sweep {spec!r}: start, stop and step must be numbers") from None
    if not (step > 0 and math.isfinite(step)) or not stop >= start:
        raise UsageError(f"--sweep {spec!r}: need step > 0 and stop >= start")
    count = int(math.floor((stop - start) / step + 1e-9)) + 1
    if count > MAX_SWEEP_POINTS:
        raise UsageError(f"--sweep {spec!r}: {count} points; at most {MAX_SWEEP_POINTS}")
    values = [round(start + i * step, 10) for i in range(count)]
    if integral and any(v != int(v) for v in values):
        raise UsageError(f"--sweep {spec!r}: {field} takes whole numbers")
    return field, values


@dataclass(frozen=True)
class SimPoint:
    """One simulated configuration (the swept fields replaced)."""

    workload: Workload
    lengths: LengthModel
    rho: float
    eta: int | None


def _point(setup: Setup, lengths: LengthModel, rho: float, field: str | None,
           value: float | None) -> SimPoint:
    w, eta = setup.workload, setup.sim_buffer()[1]
    if field == "rho":
        if not value > 0:
            raise ValueError("rho must be > 0")
        rho = value
    elif field in ("tailness", "mean_len"):
        lengths = replace(lengths, **{"mean" if field == "mean_len" else field: value})
    elif field == "eta":
        if value < 0:
            raise ValueError("eta must be >= 0")
        eta = int(value)
    elif field is not None:
        w = replace(w, **{field: int(value) if field != "queue_factor" else value})
    return SimPoint(w, lengths, rho, eta)


def simulate_point(setup: Setup, point: SimPoint, steps: int, seed: int) -> dict[str, Any]:
    """Simulator and formula for one point, as one JSON-able row."""
    buffer = setup.sim_buffer()[0]
    w = point.workload
    result = simulate(SimConfig.from_rho(w, point.lengths, point.rho, buffer=buffer,
                                         eta=point.eta, steps=steps, seed=seed))
    m_tail = point.lengths.m_tail(w.group_size)
    mean_len = point.lengths.expected_length()
    pred = formula.predict(w, point.rho, m_tail, v_rollout=float(w.concurrency),
                           mean_len=mean_len)
    split = predicted_split(w.concurrency, w.batch_rollouts, w.queue_factor, point.rho, m_tail,
                            setup.mode, buffer, point.eta)
    if setup.mode == "colocated":
        # v_R = C·1 token per time unit; sync runs rollout and train back to back.
        period = w.batch_rollouts * mean_len * (1 + point.rho) / w.concurrency
    else:
        period = pred.t_period
    return {
        "staleness": result.staleness_mean,
        "staleness_mean": result.staleness_mean, "staleness_max": result.staleness_max,
        "pqs": result.pqs, "iqs": result.iqs, "t_period": result.t_period,
        "groups_dropped": result.groups_dropped, "sampled_len_mean": result.sampled_len_mean,
        "trained_len_mean": result.trained_len_mean, "rho": point.rho,
        "sampled_len_max": result.sampled_len_max, "trained_len_max": result.trained_len_max,
        "rollout_utilization": result.rollout_utilization,
        "formula_staleness": split.staleness, "formula_pqs": split.pqs,
        "formula_iqs": split.iqs, "formula_t_period": period, "m_tail": m_tail,
        "concurrency": w.concurrency, "batch_groups": w.batch_groups,
        "group_size": w.group_size, "queue_factor": w.queue_factor, "eta": point.eta,
        "tailness": point.lengths.tailness, "mean_len": point.lengths.mean,
        "buffer": buffer, "mode": setup.mode, "steps": steps, "seed": seed,
    }


def _print_simulate(rows: list[dict[str, Any]], field: str | None, setup: Setup,
                    lengths: LengthModel, assumed: str) -> None:
    from rich.table import Table

    console = _console()
    w = setup.workload
    buffer, eta = setup.sim_buffer()
    title = (f"Simulated vs formula — C={w.concurrency}, G={w.batch_groups}, S={w.group_size}, "
             f"q={w.queue_factor:g}, mode={setup.mode}, buffer={buffer}, η={eta}, "
             f"lengths: mean {lengths.mean:g}, tailness {lengths.tailness:g}, cap "
             f"{lengths.effective_cap}{assumed}")
    table = Table(title=title, title_justify="left",
                  caption="t_period in token-times (one token decoded by one slot; v_R = C); "
                          "len: mean sampled → trained",
                  caption_justify="left")
    columns = [field] if field and field != "rho" else []
    columns += ["ρ", "stale sim", "formula", "max", "PQS+IQS sim", "t_per sim", "formula",
                "dropped", "len", "busy"]
    for name in columns:
        table.add_column(name, justify="right")
    for row in rows:
        cells = [_fmt(row[field], "g")] if field and field != "rho" else []
        cells += [
            _fmt(row["rho"], "g"), _fmt(row["staleness_mean"]), _fmt(row["formula_staleness"]),
            str(row["staleness_max"]), f"{_fmt(row['pqs'])}+{_fmt(row['iqs'])}",
            _fmt(row["t_period"], ".0f"), _fmt(row["formula_t_period"], ".0f"),
            str(row["groups_dropped"]),
            f"{_fmt(row['sampled_len_mean'], '.0f')}→{_fmt(row['trained_len_mean'], '.0f')}",
            f"{row['rollout_utilization']:.0%}",
        ]
        table.add_row(*cells)
    console.print(table)
    console.print("t_per formula assumes every slot always busy; the simulation waits for each "
                  "batch's slowest samples (stragglers, M_tail) and, with staleflow, for admission — "
                  "so t_per sim ≈ formula / busy where rollout sets the pace.")
    if setup.mode == "colocated":
        console.print("mode=colocated trains on-policy (staleness 0); pass --mode bounded_lag "
                        "to simulate the asynchronous mode.")


def plot_rows(rows: list[dict[str, Any]], field: str | None, setup: Setup, out: Path) -> None:
    """Staleness against the swept variable (ρ by default): formula line, simulated markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_field = field or "rho"
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = [row[x_field] for row in rows]
    if x_field == "rho":
        lo, hi = min(min(xs), 0.2), max(max(xs), 2.5)
        grid = [lo + (hi - lo) * i / 200 for i in range(201)]
        first = rows[0]
        buffer, _ = setup.sim_buffer()
        curve = [0.0 if setup.mode == "colocated" else
                 predicted_staleness(first["concurrency"], first["batch_groups"] *
                                     first["group_size"], first["queue_factor"], r,
                                     first["m_tail"], setup.mode, buffer, first["eta"])
                 for r in grid]
        ax.plot(grid, curve, "-", color="tab:blue", label="formula")
        ax.axvline(1.0, color="grey", lw=0.8, ls=":")
    else:
        ax.plot(xs, [row["formula_staleness"] for row in rows], "-", color="tab:blue",
                label="formula")
    ax.plot(xs, [row["staleness_mean"] for row in rows], "o", color="tab:orange",
            label="simulated mean")
    ax.plot(xs, [row["staleness_max"] for row in rows], "x", color="tab:red", alpha=0.5,
            label="simulated max")
    ax.set_xlabel("ρ = v_R / v_T" if x_field == "rho" else x_field)
    ax.set_ylabel("staleness [steps]")
    first = rows[0]
    ax.set_title(f"C={first['concurrency']} G={first['batch_groups']} S={first['group_size']} "
                 f"q={first['queue_factor']:g} tailness={first['tailness']:g} "
                 f"{first['buffer']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def run_simulate(args: argparse.Namespace) -> int:
    setup = Setup.from_config(_load(args))
    if args.mode:
        setup = replace(setup, mode=args.mode)
    _positive("--rho", args.rho)
    _positive("--mean-len", args.mean_len)
    if args.tailness is not None and not 0 <= args.tailness <= 100:
        raise UsageError(f"--tailness must be in [0, 100], got {args.tailness}")
    if not 2 <= args.steps <= 1_000_000:
        raise UsageError(f"--steps must be in [2, 1000000], got {args.steps}")
    field, values = parse_sweep(args.sweep) if args.sweep else (None, [None])

    base = setup.lengths
    assumed = ""
    if base is None:
        base = assumed_lengths(setup)
        assumed = " (assumed: no rollout.length_override)"
    lengths = replace(base, mean=args.mean_len or base.mean,
                      tailness=base.tailness if args.tailness is None else args.tailness)
    rho = 1.0 if args.rho is None else args.rho

    rows = []
    for value in values:
        try:
            point = _point(setup, lengths, rho, field, value)
        except ValueError as exc:
            raise UsageError(f"--sweep {args.sweep}: {exc}") from None
        rows.append(simulate_point(setup, point, args.steps, args.seed))
    if args.plot:
        plot_rows(rows, field, setup, Path(args.plot))
    _print_note(setup, "simulate")
    if args.json:
        print(json.dumps(rows if field else rows[0]))
    else:
        _print_simulate(rows, field, setup, lengths, assumed)
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


# --- argparse wiring ----------------------------------------------------------------------

def _load(args: argparse.Namespace) -> Any:
    from colorl.config import load_config

    # predict/simulate need no model or data: skip the disk checks of `colorl train`.
    return load_config(args.config, args.set, check_paths=False)


def _guarded(run):
    """Turn bad input into one line on stderr and exit code 2, never a traceback."""

    def func(args: argparse.Namespace) -> int:
        from colorl.config import ConfigError

        try:
            return run(args)
        except (ConfigError, UsageError) as exc:
            print(f"colorl {args.command_name}: error: {exc}", file=sys.stderr)
            return 2

    return func


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config YAML")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (value parsed as YAML); repeatable")
    parser.add_argument("--mode", choices=("colocated", "bounded_lag"),
                        help="predict as if mode were this (default: the config's mode)")
    parser.add_argument("--rho", type=float, help="v_R / v_T, rollout over train throughput")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def add_predict_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "predict", help="predict staleness and step period of a config before launch",
        description="Closed-form staleness (PQS + IQS) and effective train period of a config.")
    _common(parser)
    parser.add_argument("--m-tail", type=float, dest="m_tail",
                        help="E[max of S lengths] / E[L]; default: from rollout.length_override "
                             "or --from")
    parser.add_argument("--from", dest="from_dir", metavar="RUN_DIR",
                        help="read measured v_R, v_T, lengths and M_tail from "
                             "RUN_DIR/metrics.jsonl")
    parser.add_argument("--rollout-tps", type=float, dest="rollout_tps",
                        help="v_R in tokens/s, for t_period when there is no --from run")
    parser.set_defaults(func=_guarded(run_predict), command_name="predict")
    return parser


def add_simulate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "simulate", help="discrete-event simulation of a config's staleness",
        description="Simulate rollout slots, buffer and trainer for a config; compare with "
                    "the formula. --rho sets the train step time so that v_R / v_T = ρ.")
    _common(parser)
    parser.add_argument("--tailness", type=float, help="length tailness 0..100 "
                        "(σ = 1.3·tailness/100); default: rollout.length_override or 50")
    parser.add_argument("--mean-len", type=float, dest="mean_len",
                        help="mean response length; default: rollout.length_override or "
                             "max_new_tokens/4")
    parser.add_argument("--steps", type=int, default=2000, help="train steps to simulate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep", metavar="KEY=START:STOP:STEP",
                        help="sweep one of rho, tailness, mean_len, q, C, G, S, eta "
                             "(stop inclusive); --json then prints a list")
    parser.add_argument("--plot", metavar="OUT.png", help="write staleness vs the swept "
                        "variable (ρ by default), formula and simulation")
    parser.set_defaults(func=_guarded(run_simulate), command_name="simulate")
    return parser
