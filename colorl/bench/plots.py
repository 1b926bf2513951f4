"""The bench's PNGs: throughput/staleness frontier, reward curves, time breakdown, staleness histograms."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)


def _measured(bench: dict) -> list[dict]:
    return [v for v in bench["variants"] if v.get("figures") and v["figures"]["steps_done"]]


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def frontier(bench: dict, path: Path) -> None:
    """Trained tokens/s against mean staleness: measured (filled) and the formula's prediction at the
    run's median ρ and M_tail (hollow, same throughput) joined by a dotted line."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, variant in enumerate(_measured(bench)):
        fig_ = variant["figures"]
        y, measured = fig_["trained_tokens_per_s"], fig_["staleness_mean"]
        predicted = fig_.get("staleness_formula")
        if not (_finite(y) and _finite(measured)):
            continue
        color = f"C{i}"
        ax.plot([measured], [y], "o", color=color, markersize=9, label=f"{variant['spec']} measured")
        if _finite(predicted):
            ax.plot([predicted], [y], "o", mfc="none", color=color, markersize=15, label=f"{variant['spec']} predicted")
            ax.plot([measured, predicted], [y, y], ":", color=color)
    ax.set_xlabel("mean staleness (steps)")
    ax.set_ylabel("trained tokens / s (wall clock)")
    ax.set_title("throughput vs staleness (hollow: formula prediction)")
    ax.set_xlim(left=min(-0.1, ax.get_xlim()[0]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)


def reward(bench: dict, path: Path) -> None:
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for i, variant in enumerate(_measured(bench)):
        curve = variant["series"]
        style = "-o" if len(curve["step"]) > 1 else "o"  # a one-step variant is a point, not an invisible line
        by_step.plot(curve["step"], curve["reward_mean"], style, color=f"C{i}", markersize=3, label=variant["spec"])
        by_time.plot(curve["seconds"], curve["reward_mean"], style, color=f"C{i}", markersize=3, label=variant["spec"])
    by_step.set_xlabel("step")
    by_time.set_xlabel("wall-clock seconds (sum of step times)")
    by_step.set_ylabel("mean reward")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=7)
    _save(fig, path)


TRAINER_SEGMENTS = (("rollout (trainer idle)", "rollout"), ("waiting for a Ready buffer", "trainer_wait_s"),
                    ("train", "time_train_s"), ("sync", "time_sync_s"))


def _trainer_segments(figures: dict) -> list[float]:
    """Median seconds of a step on the trainer's timeline. Colocated runs the rollout on it;
    bounded-lag overlaps the rollout and shows the trainer's wait instead."""
    sequential = figures["idle_source"].startswith("derived")
    values = {"rollout": figures["time_rollout_s"] if sequential else 0.0,
              "trainer_wait_s": figures["trainer_wait_s"], "time_train_s": figures["time_train_s"],
              "time_sync_s": figures["time_sync_s"]}
    parts = [values[key] or 0.0 for _, key in TRAINER_SEGMENTS]
    return parts + [max(0.0, (figures["step_time_s"] or 0.0) - sum(parts))]


def time_breakdown(bench: dict, path: Path) -> None:
    variants = _measured(bench)
    names = [v["spec"] for v in variants]
    fig, (trainer, engine) = plt.subplots(1, 2, figsize=(12, 0.6 * len(names) + 2.5),
                                          gridspec_kw={"width_ratios": [2, 1]})
    segments = [_trainer_segments(v["figures"]) for v in variants]
    left = [0.0] * len(names)
    for j, label in enumerate([s for s, _ in TRAINER_SEGMENTS] + ["other"]):
        widths = [row[j] for row in segments]
        trainer.barh(names, widths, left=left, label=label, color=f"C{j}")
        left = [a + b for a, b in zip(left, widths)]
    trainer.set_xlabel("seconds per step (medians)")
    trainer.set_title("trainer timeline")
    trainer.legend(fontsize=7)
    idle = [v["figures"]["engine_idle_frac"] for v in variants]
    busy = [1.0 - x if _finite(x) else 0.0 for x in idle]
    engine.barh(names, busy, label="generating", color="C5")
    engine.barh(names, [x if _finite(x) else 0.0 for x in idle], left=busy, label="idle", color="C7")
    engine.set_xlim(0, 1)
    engine.set_yticks([])
    engine.set_xlabel("fraction of step time")
    engine.set_title("engine")
    engine.legend(fontsize=7)
    _save(fig, path)


def staleness_histograms(bench: dict, path: Path) -> None:
    variants = _measured(bench)
    cols = min(3, max(1, len(variants)))
    rows = max(1, math.ceil(len(variants) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, variant in zip(axes.flat, variants):
        hist = variant["figures"]["staleness_hist"]
        ax.bar([int(k) for k in hist], list(hist.values()), color="C0")
        ax.set_title(variant["spec"], fontsize=9)
        ax.set_xlabel("staleness (versions)")
        ax.set_ylabel("groups trained")
        ax.xaxis.get_major_locator().set_params(integer=True)
    for ax in list(axes.flat)[len(variants):]:
        ax.axis("off")
    _save(fig, path)


CHARTS = {"frontier.png": frontier, "reward.png": reward, "time.png": time_breakdown,
          "staleness_hist.png": staleness_histograms}


def draw_all(bench: dict, out: Path) -> list[str]:
    for name, draw in CHARTS.items():
        draw(bench, out / name)
    return list(CHARTS)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
