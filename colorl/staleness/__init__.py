"""Staleness before launch and during a run: closed-form model, simulator, live prediction.

- `formula`: PQS, IQS, t_period, the fixed-budget frontier, β_crit(q), M_tail.
- `simulator`: discrete-event simulation of rollout slots, buffer and trainer.
- `live`: the per-step `staleness_pred` of the metrics line.
- `commands`: `colorl predict` and `colorl simulate` (imports rich and matplotlib lazily).
"""

from colorl.staleness.formula import LengthModel, Prediction, Workload, predict
from colorl.staleness.live import predicted_staleness
from colorl.staleness.simulator import SimConfig, SimResult, simulate

__all__ = ["LengthModel", "Prediction", "SimConfig", "SimResult", "Workload", "predict",
           "predicted_staleness", "simulate"]
