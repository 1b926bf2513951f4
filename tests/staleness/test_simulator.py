"""The discrete-event simulator: agreement with the formula, the seed's length-bias finding,
staleness bounds of the η-bounded buffers, and speed."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colorl.staleness import formula
from colorl.staleness.formula import LengthModel, Workload
from colorl.staleness.simulator import SimConfig, simulate

GRID_RHOS = (0.3, 0.5, 0.7, 0.9, 1.1, 1.3, 1.6, 2.0)


def _run(c=32, g=8, s=4, q=1.0, rho=1.0, tailness=50.0, mean=1000, cap=8000, **kwargs):
    workload = Workload(c, g, s, q)
    lengths = LengthModel(mean, tailness, cap)
    return simulate(SimConfig.from_rho(workload, lengths, rho, **kwargs)), workload, lengths


@pytest.mark.parametrize("q", [1, 2, 5])
@pytest.mark.parametrize("tailness", [50, 90])
def test_agrees_with_formula_where_the_approximations_hold(q, tailness):
    """Within 0.25 steps or 10% for tailness > 0 and ρ != 1 (the seed's smooth-arrival and
    constant-rate assumptions); see the two tests below for where they break."""
    for rho in GRID_RHOS:
        result, w, lengths = _run(q=q, rho=rho, tailness=tailness, steps=800)
        predicted = formula.staleness(w.concurrency, w.batch_rollouts, q, rho,
                                      lengths.m_tail(w.group_size))
        assert abs(result.staleness_mean - predicted) <= max(0.25, 0.1 * predicted), (rho, result)


def test_constant_lengths_break_smooth_arrival():
    """tailness 0: slots run in lock-step, every group takes exactly one version to generate
    and is trained at once, so staleness is C/B and the formula's +ρ never appears."""
    for rho in (0.3, 0.7):
        result, w, _ = _run(rho=rho, tailness=0, steps=200)
        assert result.staleness_mean == pytest.approx(w.concurrency / w.batch_rollouts)
        assert result.iqs == 0
        assert formula.staleness(32, 32, 1, rho, 1.0) == pytest.approx(1 + rho)


def test_balance_point_lies_between_the_two_branches():
    """At ρ = 1 with q > 1 the queue does a random walk instead of filling: the simulator sits
    between the rollout-bound value (IQS 1) and the train-bound one (IQS q)."""
    result, w, lengths = _run(q=5, rho=1.0, steps=800)
    m_tail = lengths.m_tail(w.group_size)
    rollout_side = formula.pqs(32, 32, 1.0, m_tail) + 1.0
    train_side = formula.staleness(32, 32, 5, 1.0, m_tail)
    assert rollout_side - 0.25 < result.staleness_mean < train_side - 1.0


def test_effective_train_period():
    result, w, lengths = _run(rho=0.5, steps=600)
    rollout_period = w.batch_rollouts * lengths.expected_length() / w.concurrency  # v_R = C
    assert result.t_period == pytest.approx(rollout_period, rel=0.03)
    result, _, _ = _run(rho=2.0, steps=300)
    assert result.t_period == pytest.approx(2 * rollout_period)  # trainer never waits
    assert result.groups_dropped > 0
    assert result.rollout_utilization == pytest.approx(1.0)


def test_queue_drop_is_unbiased_and_queue_max_is_not():
    """The seed's appendix: tailness 50, sampled mean ~1400, cap 8080."""
    common = dict(c=128, g=16, s=8, rho=1.0, mean=1400, cap=8080, steps=400)
    drop, _, _ = _run(q=1, **common)
    assert drop.trained_len_mean == pytest.approx(drop.sampled_len_mean, rel=0.01)
    assert drop.trained_len_max == drop.sampled_len_max
    qmax, _, _ = _run(buffer="queue_max", eta=1, **common)
    assert qmax.staleness_max == 1
    assert qmax.trained_len_mean < 0.93 * qmax.sampled_len_mean  # seed: 1229 vs 1401
    assert qmax.trained_len_max < 0.7 * qmax.sampled_len_max  # seed: 4983 vs 8080
    assert qmax.groups_dropped > 0


@settings(max_examples=25, deadline=None)
@given(buffer=st.sampled_from(["staleflow", "queue_max"]), eta=st.integers(0, 3),
       c=st.integers(2, 24), g=st.integers(1, 4), s=st.integers(1, 4),
       rho=st.floats(0.2, 3.0), tailness=st.sampled_from([0, 50, 90]), seed=st.integers(0, 99))
def test_bounded_buffers_never_exceed_eta(buffer, eta, c, g, s, rho, tailness, seed):
    result, _, _ = _run(c=c, g=g, s=s, rho=rho, tailness=tailness, mean=50, cap=400,
                        buffer=buffer, eta=eta, steps=40, warmup=0, seed=seed)
    assert result.staleness_max <= eta
    assert result.trained_groups == 40 * g


def test_staleflow_eta_zero_is_sync():
    result, w, lengths = _run(buffer="staleflow", eta=0, rho=0.5, steps=100)
    assert result.staleness_mean == 0 and result.staleness_max == 0
    rollout_period = w.batch_rollouts * lengths.expected_length() / w.concurrency
    assert result.t_period > 1.5 * rollout_period  # rollout, then train, nothing overlaps
    assert result.rollout_utilization < 0.8


def test_staleflow_train_bound_sits_at_eta():
    result, _, _ = _run(buffer="staleflow", eta=2, rho=1.5, steps=300)
    assert result.staleness_mean == pytest.approx(2.0, abs=0.02)
    assert result.groups_dropped == 0
    assert result.rollout_utilization < 0.8  # admission blocks instead of dropping


def test_deterministic_per_seed():
    a, _, _ = _run(rho=0.8, steps=100, seed=3)
    b, _, _ = _run(rho=0.8, steps=100, seed=3)
    c, _, _ = _run(rho=0.8, steps=100, seed=4)
    assert a == b
    assert a != c


def test_config_validation():
    w, lengths = Workload(8, 2, 2), LengthModel(10, 50, 100)
    with pytest.raises(ValueError):
        SimConfig(w, lengths, 1.0, buffer="fifo")
    with pytest.raises(ValueError):
        SimConfig(w, lengths, 1.0, steps=1)
    with pytest.raises(ValueError):
        SimConfig.from_rho(w, lengths, -1.0)
    with pytest.raises(ValueError):
        simulate(SimConfig(w, lengths, 1.0, buffer="staleflow"))  # needs eta


def test_two_thousand_steps_well_under_a_second():
    workload = Workload(32, 8, 4, 1.0)  # DESIGN.md's default rollout section
    cfg = SimConfig.from_rho(workload, LengthModel(64, 90, 512), 2.0, steps=2000)
    start = time.process_time()  # CPU time: the machine is shared, wall time is noisy
    simulate(cfg)
    assert time.process_time() - start < 1.0
