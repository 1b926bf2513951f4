"""Staleness predictor vs simulator (issue 5).

    python bench/staleness.py [--steps 2000] [--quick]

Writes bench/results/staleness.json, staleness_grid.png and staleness_frontier.png, and prints
the markdown tables recorded in bench/README.md ("Staleness predictor").

1. Grid: formula vs simulator for q ∈ {1, 2, 5}, tailness ∈ {0, 50, 90}, ρ ∈ [0.3, 2.0].
2. Frontier: staleness vs effective train period under a fixed device budget.
3. The seed's six real runs recomputed from their printed inputs.
4. Length bias of queue-drop vs queue-max (and StaleFlow) at tailness 50 and 90.
5. Simulator speed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from colorl.staleness import formula  # noqa: E402
from colorl.staleness.formula import LengthModel, Workload  # noqa: E402
from colorl.staleness.simulator import SimConfig, simulate  # noqa: E402
from colorl.staleness.reference import SEED_RUNS  # noqa: E402

RESULTS = ROOT / "bench" / "results"
C, G, S = 128, 16, 8  # B = 128, like the seed's runs
MEAN, CAP = 1000, 8000
QS = (1, 2, 5)
TAILNESSES = (0, 50, 90)
RHOS = (0.3, 0.5, 0.7, 0.9, 1.0, 1.1, 1.3, 1.6, 2.0)



def approximations_hold(tailness: float, rho: float) -> bool:
    """Where the seed's derivation applies: lengths spread (smooth arrival) and ρ != 1
    (constant-rate queue: at balance it random-walks instead of filling)."""
    return tailness > 0 and abs(rho - 1) > 1e-9


def grid(steps: int) -> list[dict]:
    rows = []
    for q in QS:
        for tailness in TAILNESSES:
            lengths = LengthModel(MEAN, tailness, CAP)
            m_tail = lengths.m_tail(S)
            for rho in RHOS:
                workload = Workload(C, G, S, q)
                start = time.process_time()
                sim = simulate(SimConfig.from_rho(workload, lengths, rho, steps=steps))
                elapsed = time.process_time() - start
                pred = formula.predict(workload, rho, m_tail)
                error = sim.staleness_mean - pred.staleness
                rows.append(dict(
                    q=q, tailness=tailness, rho=rho, m_tail=m_tail,
                    formula=pred.staleness, formula_pqs=pred.pqs, formula_iqs=pred.iqs,
                    sim=sim.staleness_mean, sim_max=sim.staleness_max, sim_pqs=sim.pqs,
                    sim_iqs=sim.iqs, t_period=sim.t_period, dropped=sim.groups_dropped,
                    error=error, within=abs(error) <= max(0.25, 0.1 * pred.staleness),
                    holds=approximations_hold(tailness, rho), seconds=elapsed))
    return rows


def plot_grid(rows: list[dict], out: Path) -> None:
    fig, axes = plt.subplots(1, len(QS), figsize=(15, 4.4), sharey=True)
    colors = dict(zip(TAILNESSES, ("tab:green", "tab:blue", "tab:red")))
    for ax, q in zip(axes, QS):
        for tailness in TAILNESSES:
            sel = [r for r in rows if r["q"] == q and r["tailness"] == tailness]
            m_tail = sel[0]["m_tail"]
            for lo, hi in ((0.25, 0.999), (1.0, 2.05)):
                xs = [lo + (hi - lo) * i / 100 for i in range(101)]
                ax.plot(xs, [formula.staleness(C, G * S, q, x, m_tail) for x in xs], "-",
                        color=colors[tailness],
                        label=f"formula, tailness {tailness} (M_tail {m_tail:.2f})"
                        if lo < 1 else None)
            ax.plot([r["rho"] for r in sel], [r["sim"] for r in sel], "o", mfc="none",
                    color=colors[tailness], label=f"simulated, tailness {tailness}")
        ax.axvline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_title(f"q = {q}  (C={C}, B={G * S}, S={S})")
        ax.set_xlabel("ρ = v_R / v_T")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean staleness [steps]")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def frontier(steps: int, beta: float) -> dict:
    """Fixed budget: N = 8 devices, c_T = 1000 tokens/s per train device, c_R = c_T / β*.

    As in the seed, rollout concurrency follows the rollout devices (per-slot decode speed
    s_R fixed, C = v_R / s_R; C = 128 at ρ = 1), so group generation time is the same at every
    split and PQS depends on t_period only.
    """
    devices, c_train, tailness = 8, 1000.0, 50
    c_rollout = c_train / beta
    lengths = LengthModel(MEAN, tailness, CAP)
    mean_len, m_tail = lengths.expected_length(), lengths.m_tail(S)
    slot_speed = formula.budget_throughputs(1.0, devices, c_rollout, c_train)[0] / C
    rhos_curve = [0.25 * (16 ** (i / 120)) for i in range(121)]  # 0.25 .. 4
    rhos_sim = (0.3, 0.5, 0.7, 0.85, 1.0, 1.2, 1.5, 2.0, 3.0)
    out: dict = {"devices": devices, "c_rollout": c_rollout, "c_train": c_train,
                 "tailness": tailness, "m_tail": m_tail, "slot_speed": slot_speed,
                 "beta_star": formula.beta_star(c_rollout, c_train), "curves": {}}
    for q in QS:
        curve = []
        for rho in rhos_curve:
            v_r, v_t = formula.budget_throughputs(rho, devices, c_rollout, c_train)
            curve.append((rho, formula.t_period(G * S, mean_len, v_r, v_t),
                          formula.staleness(v_r / slot_speed, G * S, q, rho, m_tail)))
        points = []
        for rho in rhos_sim:
            v_r, v_t = formula.budget_throughputs(rho, devices, c_rollout, c_train)
            concurrency = max(1, round(v_r / slot_speed))
            cfg = SimConfig(Workload(concurrency, G, S, q), lengths,
                            train_step_s=G * S * mean_len / v_t, decode_speed=slot_speed,
                            steps=steps)
            sim = simulate(cfg)
            points.append(dict(rho=rho, concurrency=concurrency, t_period=sim.t_period,
                               staleness=sim.staleness_mean,
                               t_period_formula=formula.t_period(G * S, mean_len, v_r, v_t),
                               staleness_formula=formula.staleness(concurrency, G * S, q, rho,
                                                                   m_tail)))
        out["curves"][q] = {"formula": curve, "sim": points}
    return out


def plot_frontier(panels: list[dict], out: Path) -> None:
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.8))
    colors = dict(zip(QS, ("tab:blue", "tab:orange", "tab:red")))
    for ax, data in zip(axes, panels):
        for q, curves in data["curves"].items():
            curve = curves["formula"]
            rollout = [(t, s) for rho, t, s in curve if rho < 1]
            train = [(t, s) for rho, t, s in curve if rho >= 1]
            ax.plot(*zip(*rollout), "-", color="black", lw=1,
                    label="formula, ρ<1 (any q)" if q == QS[0] else None)
            ax.plot(*zip(*train), "--", color=colors[q], label=f"q={q} formula, ρ>1")
            ax.plot([p["t_period"] for p in curves["sim"]], [p["staleness"] for p in curves["sim"]],
                    "o", mfc="none", color=colors[q], label=f"q={q} simulated")
        balanced = min(curve, key=lambda row: abs(row[0] - 1))
        ax.plot(balanced[1], rollout[-1][1], "*", color="black", ms=12, label="ρ = 1")
        ax.set_xlabel("effective train period t_period [s]")
        ax.set_ylabel("mean staleness [steps]")
        ax.set_title(f"N={data['devices']}, β* = c_T/c_R = {data['beta_star']:g} "
                     f"(β_crit(1) = 0.5), B={G * S}, C=128 at ρ=1, tailness {data['tailness']}",
                     fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def length_bias(steps: int) -> list[dict]:
    """The seed's appendix tables: C=128, B=128 at ρ = 1, mean ~1400, caps 8080 / 12080."""
    rows = []
    for tailness, cap in ((50, 8080), (90, 12080)):
        lengths = LengthModel(1400, tailness, cap)
        cases = [("queue_drop", 1, None), ("queue_drop", 2, None)]
        cases += [("queue_max", 1, eta) for eta in (1, 2, 3, 4)]
        cases += [("staleflow", 1, eta) for eta in (1, 2, 4)]
        for buffer, q, eta in cases:
            sim = simulate(SimConfig.from_rho(Workload(C, G, S, q), lengths, 1.0, buffer=buffer,
                                              eta=eta, steps=steps))
            rows.append(dict(tailness=tailness, buffer=buffer, q=q, eta=eta,
                             sampled_mean=sim.sampled_len_mean, trained_mean=sim.trained_len_mean,
                             sampled_max=sim.sampled_len_max, trained_max=sim.trained_len_max,
                             staleness=sim.staleness_mean, staleness_max=sim.staleness_max,
                             dropped=sim.groups_dropped, utilization=sim.rollout_utilization,
                             t_period=sim.t_period))
    return rows


def seed_runs() -> list[dict]:
    return [dict(C=c, B=b, q=q, rho=rho, m_tail=m, seed_predicted=pred, seed_measured=meas,
                 recomputed=formula.staleness(c, b, q, rho, m),
                 pqs=formula.pqs(c, b, rho, m), iqs=formula.iqs(rho, q))
            for c, b, q, rho, m, pred, meas in SEED_RUNS]


def speed() -> list[dict]:
    rows = []
    for (c, g, s), lengths in (((32, 8, 4), LengthModel(64, 90, 512)),
                               ((C, G, S), LengthModel(MEAN, 50, CAP))):
        for rho in (0.5, 2.0):
            cfg = SimConfig.from_rho(Workload(c, g, s), lengths, rho, steps=2000)
            start = time.process_time()  # CPU seconds: the machine is shared
            simulate(cfg)
            rows.append(dict(C=c, G=g, S=s, rho=rho, steps=2000,
                             seconds=time.process_time() - start))
    return rows


def markdown(report: dict) -> str:
    lines = ["### Formula vs simulator (C=128, G=16, S=8, mean 1000, cap 8000, "
             f"{report['steps']} steps)", "",
             "| q | tailness | M_tail | " + " | ".join(f"ρ={r}" for r in RHOS) + " |",
             "|---|---|---|" + "---|" * len(RHOS)]
    for q in QS:
        for tailness in TAILNESSES:
            sel = [r for r in report["grid"] if r["q"] == q and r["tailness"] == tailness]
            cells = []
            for r in sel:
                mark = "" if r["within"] else ("*" if r["holds"] else "†")
                cells.append(f"{r['sim']:.2f} / {r['formula']:.2f}{mark}")
            lines.append(f"| {q} | {tailness} | {sel[0]['m_tail']:.2f} | "
                         + " | ".join(cells) + " |")
    held = [r for r in report["grid"] if r["holds"]]
    lines += ["", f"Cells: simulated / formula mean staleness. † outside 0.25 steps or 10% where "
              f"the seed's approximations do not hold (tailness 0 or ρ = 1); * outside where they "
              f"should (none expected). Where they hold: {sum(r['within'] for r in held)}/"
              f"{len(held)} within tolerance, max |error| "
              f"{max(abs(r['error']) for r in held):.2f} steps.", ""]
    lines += ["### Frontier under a fixed budget (N=8, tailness 50, C ∝ rollout devices)", "",
              "Same t_period from both sides: ρ+ = 1 + z and ρ− = 1/(1 + β*·z); formula "
              "staleness:", "",
              "| β* | z | ρ− | ρ+ | ρ− side (any q) | ρ+ side q=1 | ρ+ side q=2 | ρ+ side q=5 |",
              "|---|---|---|---|---|---|---|---|"]
    for data in report["frontier"]:
        beta, m_tail = data["beta_star"], data["m_tail"]
        for z in (0.2, 0.5, 1.0):
            rho_p, rho_m = 1 + z, formula.rho_minus(1 + z, beta)
            cells = []
            for rho, qs in ((rho_m, (1,)), (rho_p, QS)):
                for q in qs:
                    v_r, _ = formula.budget_throughputs(rho, data["devices"], data["c_rollout"],
                                                        data["c_train"])
                    value = formula.staleness(v_r / data["slot_speed"], G * S, q, rho, m_tail)
                    cells.append(f"{value:.2f}")
            lines.append(f"| {beta:g} | {z} | {rho_m:.2f} | {rho_p:.2f} | " + " | ".join(cells)
                         + " |")
    lines += ["", "Simulated vs formula along the q=1 frontier (t_period s, staleness):", "",
              "| β* | ρ | C | t_period sim / formula | staleness sim / formula |",
              "|---|---|---|---|---|"]
    for data in report["frontier"]:
        for p in data["curves"][1]["sim"]:
            lines.append(f"| {data['beta_star']:g} | {p['rho']} | {p['concurrency']} | "
                         f"{p['t_period']:.1f} / {p['t_period_formula']:.1f} | "
                         f"{p['staleness']:.2f} / {p['staleness_formula']:.2f} |")
    lines += ["", "### The seed's six real runs, recomputed", "",
              "| C | B | q | ρ | M_tail | PQS | IQS | recomputed | seed predicted "
              "| seed measured |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["seed_runs"]:
        lines.append(f"| {r['C']} | {r['B']} | {r['q']} | {r['rho']} | {r['m_tail']} | "
                     f"{r['pqs']:.2f} | {r['iqs']:.2f} | {r['recomputed']:.2f} | "
                     f"{r['seed_predicted']:.2f} | {r['seed_measured']:.2f} |")
    lines += ["", "### Length bias at ρ = 1 (C=128, B=128, mean 1400)", "",
              "| tailness | buffer | sampled mean | trained mean | sampled max | trained max | "
              "staleness mean / max | dropped | rollout busy |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in report["length_bias"]:
        name = (f"{r['buffer']} q={r['q']}" if r["buffer"] == "queue_drop"
                else f"{r['buffer']} η={r['eta']}")
        lines.append(f"| {r['tailness']} | {name} | {r['sampled_mean']:.0f} | "
                     f"{r['trained_mean']:.0f} | {r['sampled_max']} | {r['trained_max']} | "
                     f"{r['staleness']:.2f} / {r['staleness_max']} | {r['dropped']} | "
                     f"{r['utilization']:.0%} |")
    lines += ["", "### Simulator speed (2,000 steps, pure Python, CPU seconds)", "",
              "| C | G | S | ρ | seconds |", "|---|---|---|---|---|"]
    for r in report["speed"]:
        lines.append(f"| {r['C']} | {r['G']} | {r['S']} | {r['rho']} | {r['seconds']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="300 steps, for a smoke run")
    args = parser.parse_args()
    steps = 300 if args.quick else args.steps
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {"steps": steps, "config": dict(C=C, G=G, S=S, mean=MEAN, cap=CAP),
              "beta_crit": {q: formula.beta_crit(q) for q in QS}}
    report["grid"] = grid(steps)
    report["frontier"] = [frontier(steps, beta) for beta in (1.0, 0.25)]
    report["seed_runs"] = seed_runs()
    report["length_bias"] = length_bias(steps)
    report["speed"] = speed()
    plot_grid(report["grid"], RESULTS / "staleness_grid.png")
    plot_frontier(report["frontier"], RESULTS / "staleness_frontier.png")
    (RESULTS / "staleness.json").write_text(json.dumps(report, indent=1, default=str))
    print(markdown(report))
    print(f"\nβ_crit: {', '.join(f'q={q}: {v:.4f}' for q, v in report['beta_crit'].items())}")
    print(f"wrote {RESULTS / 'staleness.json'}, staleness_grid.png, staleness_frontier.png")
    assert all(math.isfinite(r["sim"]) for r in report["grid"])


if __name__ == "__main__":
    main()
