"""`colorl predict` and `colorl simulate`, run in-process through their argparse parsers."""

import argparse
import json
import math

import pytest

from colorl.staleness import formula
from colorl.staleness.commands import (add_predict_parser, add_simulate_parser, parse_sweep,
                                       read_run, UsageError)
from colorl.staleness.formula import LengthModel

CONFIG = """\
run: {name: t, steps: 3}
model: {path: /nowhere/model}
rollout: {group_size: 4, batch_groups: 8, concurrency: 64, max_new_tokens: 512,
          length_override: {mean: 100, tailness: 50, cap: 512}}
staleness: {max: 2, buffer: queue_drop, queue_factor: 2}
"""


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(CONFIG)
    return path


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="colorl")
    sub = parser.add_subparsers(required=True)
    add_predict_parser(sub)
    add_simulate_parser(sub)
    args = parser.parse_args([str(a) for a in argv])
    return args.func(args)


def run_json(capsys, *argv: str):
    assert run(*argv, "--json") == 0
    return json.loads(capsys.readouterr().out)


def write_metrics(run_dir, lines):
    run_dir.mkdir(parents=True)
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (run_dir / "metrics.jsonl").write_text(text + '{"step": 99, "rho"')  # torn last line


def test_predict_json_matches_formula(config, capsys):
    out = run_json(capsys, "predict", config, "--rho", "1.5", "--mode", "bounded_lag")
    assert {"pqs", "iqs", "staleness", "t_period", "rho", "m_tail"} <= out.keys()
    m_tail = LengthModel(100, 50, 512).m_tail(4)
    assert out["m_tail"] == pytest.approx(m_tail)
    assert out["staleness"] == pytest.approx(formula.staleness(64, 32, 2, 1.5, m_tail))
    assert out["regime"] == "train-bound"
    assert out["t_period"] is None  # no throughput known
    assert any("queue_factor = 1" in tip for tip in out["advice"])


def test_predict_colocated_is_on_policy_with_a_bounded_lag_preview(config, capsys):
    out = run_json(capsys, "predict", config, "--rho", "0.5", "--m-tail", "1.5",
                   "--rollout-tps", "1000")
    assert out["mode"] == "colocated"
    assert out["staleness"] == 0.0
    assert out["bounded_lag"]["staleness"] == pytest.approx(64 * 1.5 / 32 + 0.5)
    mean_len = LengthModel(100, 50, 512).expected_length()
    assert out["t_period"] == pytest.approx(32 * mean_len * (1 / 1000 + 1 / 2000))


def test_predict_from_run(config, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "r1"
    lines = [dict(step=1, rollout_tokens_per_s=1.0, train_tokens_per_s=1.0, rho=1.0, m_tail=9.0,
                  response_len_mean=1.0, staleness_mean=0.0, time_step_s=100.0)]
    lines += [dict(step=k, rollout_tokens_per_s=v_r, train_tokens_per_s=1000.0, rho=v_r / 1000,
                   m_tail=m, response_len_mean=50.0, response_len_max=300, staleness_mean=2.0,
                   time_step_s=1.0)
              for k, v_r, m in ((2, 400.0, 1.4), (3, 800.0, 1.6))]
    write_metrics(run_dir, lines)
    measured = read_run(run_dir)
    assert measured.steps == 2  # warm-up step dropped, torn line skipped
    assert measured.rho == pytest.approx(0.6)
    out = run_json(capsys, "predict", config, "--from", run_dir, "--mode", "bounded_lag")
    assert out["rho"] == pytest.approx(0.6)
    assert out["m_tail"] == pytest.approx(1.5)
    assert out["t_period"] == pytest.approx(32 * 50 / 600)
    assert out["measured_staleness"] == 2.0
    assert out["staleness"] == pytest.approx(formula.staleness(64, 32, 2, 0.6, 1.5))


def test_predict_table(config, capsys):
    assert run("predict", config, "--rho", "0.8", "--mode", "bounded_lag") == 0
    text = capsys.readouterr().out
    assert "PQS" in text and "IQS" in text and "Advice" in text


def test_predict_colocated_gives_no_async_advice_and_assumes_m_tail_aloud(capsys):
    assert run("predict", "configs/quickstart.yaml", "--rho", "2") == 0
    text = capsys.readouterr().out
    assert "mode=colocated, buffer=staleflow, η=0" in text and "Advice" not in text and "│ PQS" not in text
    assert "M_tail" in text and "assumed: lengths of mean 6, tailness 50, cap 24" in text
    assert run("predict", "configs/quickstart.yaml", "--rho", "2", "--mode", "bounded_lag") == 0
    assert "Advice" in capsys.readouterr().out
    assert run("simulate", "configs/quickstart.yaml", "--steps", "50") == 0
    assert "η=0" in capsys.readouterr().out  # the same η as predict for the same config


@pytest.mark.parametrize("command", ["predict", "simulate"])
def test_multi_turn_configs_get_one_note_that_episodes_are_not_modelled(config, capsys, command):
    """With task.env a sample is an episode (turns, tool time) that both models treat as one
    completion: one note line on stderr says so, and --json stays one document on stdout."""
    steps = ["--steps", "50"] if command == "simulate" else []
    episodes = ["--set", "task.env=calculator", "--set", "rollout.length_override=null"]
    assert run(command, config, *steps, "--set", "rollout.length_override=null", "--json") == 0
    assert capsys.readouterr().err == ""  # no environment, no note
    assert run(command, config, *steps, *episodes, "--json") == 0
    captured = capsys.readouterr()
    json.loads(captured.out)
    note = captured.err.strip().splitlines()
    assert len(note) == 1 and note[0].startswith(f"colorl {command}: note: task.env is set")
    assert "M_tail" in note[0] and "not modelled" in note[0]
    assert run(command, config, *steps, *episodes) == 0
    captured = capsys.readouterr()
    assert captured.err.count("note:") == 1 and "note:" not in captured.out


@pytest.mark.parametrize("command", ["predict", "simulate"])
def test_what_the_models_leave_out_is_said_in_one_line(config, capsys, command):
    """Redundancy, the zero-variance filter, recompute and several ranks change the real run; neither
    model has them, so one note line on stderr names each one set (and the run's mode decides which count)."""
    steps = ["--steps", "50"] if command == "simulate" else []
    bounded = ["--set", "mode=bounded_lag", "--set", "staleness.buffer=staleflow", "--set", "rollout.batch_groups=8"]
    assert run(command, config, *steps, *bounded, "--json") == 0
    assert capsys.readouterr().err == ""  # partial_rollout=keep, one rank: what the models assume
    extra = ["--set", "launch.nproc=8", "--set", "filter.zero_variance=true", "--set", "staleness.partial_rollout=recompute",
             "--set", "staleness.redundancy={level: batch, ratio: 0.5}"]
    assert run(command, config, *steps, *bounded, *extra, "--json") == 0
    captured = capsys.readouterr()
    json.loads(captured.out)
    (note,) = captured.err.strip().splitlines()
    assert note.startswith(f"colorl {command}: note: not modelled: staleness.redundancy=batch, filter.zero_variance=true, "
                           "staleness.partial_rollout=recompute (its re-prefill work), launch.nproc=8 ")
    assert run(command, config, *steps, "--set", "mode=colocated", *extra[:4], "--json") == 0
    (note,) = capsys.readouterr().err.strip().splitlines()
    assert "not modelled: launch.nproc=8" in note and "zero_variance" not in note  # colocated: no buffer to filter


@pytest.mark.parametrize("argv, message", [
    (["--rho", "-1"], "--rho"),
    (["--m-tail", "0.5"], "--m-tail"),
    (["--from", "/no/such/run"], "no such run directory"),
    (["--set", "rollout.concurency=3"], "concurrency"),
    (["--set", "staleness.queue_factor=0.5"], "queue_factor"),
])
def test_predict_bad_input_is_one_line_and_exit_2(config, capsys, argv, message):
    assert run("predict", config, *argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_missing_config_and_empty_run(tmp_path, config, capsys):
    assert run("predict", tmp_path / "nope.yaml") == 2
    assert "not found" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert run("predict", config, "--from", tmp_path / "empty") == 2
    assert "metrics.jsonl" in capsys.readouterr().err


def test_argparse_type_errors_exit_2(config):
    with pytest.raises(SystemExit) as exc:
        run("simulate", config, "--rho", "fast")
    assert exc.value.code == 2


def test_simulate_json(config, capsys):
    out = run_json(capsys, "simulate", config, "--mode", "bounded_lag", "--rho", "0.5",
                   "--steps", "300")
    assert {"staleness_mean", "staleness_max", "pqs", "iqs", "t_period", "groups_dropped",
            "sampled_len_mean", "trained_len_mean", "rho"} <= out.keys()
    assert out["rho"] == 0.5
    assert abs(out["staleness_mean"] - out["formula_staleness"]) < 0.25


BOUNDED_LAG = """\
run: {name: t, steps: 3}
model: {path: /nowhere/model}
mode: bounded_lag
rollout: {group_size: 4, batch_groups: 8, concurrency: 64, max_new_tokens: 512,
          length_override: {mean: 100, tailness: 50, cap: 512}}
staleness: {max: 2, buffer: BUFFER}
"""


@pytest.mark.parametrize("buffer", ["staleflow", "queue_max", "queue_drop"])
def test_bounded_lag_config_predicts_its_own_buffer(tmp_path, capsys, buffer):
    """A `mode: bounded_lag` config, no --mode: the top-level pqs, iqs and staleness are
    the prediction for the configured buffer and η, in predict and in simulate alike."""
    path = tmp_path / "async.yaml"
    path.write_text(BOUNDED_LAG.replace("BUFFER", buffer))
    m_tail = LengthModel(100, 50, 512).m_tail(4)
    for rho in (0.5, 1.5):
        out = run_json(capsys, "predict", path, "--rho", rho)
        assert out["mode"] == "bounded_lag" and out["buffer"] == buffer and out["eta"] == 2
        assert out["pqs"] + out["iqs"] == pytest.approx(out["staleness"])
        queue_drop = formula.staleness(64, 32, 1, rho, m_tail)
        assert out["staleness_queue_drop"] == pytest.approx(queue_drop)
        assert out["staleness"] == pytest.approx(queue_drop if buffer == "queue_drop" else 2.0)
    row = run_json(capsys, "simulate", path, "--rho", "1.5", "--steps", "200")
    assert row["mode"] == "bounded_lag" and row["buffer"] == buffer
    assert row["staleness"] == row["staleness_mean"] == pytest.approx(row["pqs"] + row["iqs"])
    assert row["formula_pqs"] + row["formula_iqs"] == pytest.approx(row["formula_staleness"])
    if buffer != "queue_drop":
        assert row["staleness_max"] <= 2
        assert row["staleness"] == pytest.approx(row["formula_staleness"], abs=0.35)


def test_simulate_colocated_is_sync(config, capsys):
    out = run_json(capsys, "simulate", config, "--steps", "50")
    assert out["staleness_max"] == 0 and out["formula_staleness"] == 0


def test_simulate_sweep_and_plot(config, tmp_path, capsys):
    plot = tmp_path / "out" / "sweep.png"
    rows = run_json(capsys, "simulate", config, "--mode", "bounded_lag", "--steps", "100",
                    "--sweep", "rho=0.5:1.5:0.5", "--tailness", "90", "--plot", plot)
    assert [row["rho"] for row in rows] == [0.5, 1.0, 1.5]
    assert all(row["tailness"] == 90 for row in rows)
    assert plot.read_bytes()[:4] == b"\x89PNG"
    rows = run_json(capsys, "simulate", config, "--mode", "bounded_lag", "--steps", "50",
                    "--sweep", "C=32:64:32")
    assert [row["concurrency"] for row in rows] == [32, 64]


def test_simulate_table(config, capsys):
    assert run("simulate", config, "--mode", "bounded_lag", "--steps", "50",
               "--sweep", "q=1:2:1") == 0
    assert "stale sim" in capsys.readouterr().out


@pytest.mark.parametrize("spec", ["rho", "rho=1:2", "rho=a:b:c", "rho=2:1:0.5", "rho=0:1:0",
                                  "bogus=1:2:1", "C=1:2:0.5", "rho=0:1000:0.001"])
def test_bad_sweep_specs(spec):
    with pytest.raises(UsageError):
        parse_sweep(spec)


@pytest.mark.parametrize("argv, message", [
    (["--sweep", "rho=0:1:0.5"], "rho must be > 0"),
    (["--sweep", "q=0.5:1:0.5"], "queue_factor"),
    (["--sweep", "eta=-1:0:1"], "eta"),
    (["--tailness", "150"], "--tailness"),
    (["--steps", "1"], "--steps"),
    (["--mean-len", "0"], "--mean-len"),
])
def test_simulate_bad_input_exit_2(config, capsys, argv, message):
    assert run("simulate", config, "--mode", "bounded_lag", "--steps", "20", *argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_parse_sweep_values():
    field, values = parse_sweep("rho=0.3:2.0:0.1")
    assert field == "rho" and len(values) == 18
    assert values[0] == 0.3 and math.isclose(values[-1], 2.0)
    assert parse_sweep("staleness.max=0:3:1") == ("eta", [0.0, 1.0, 2.0, 3.0])
