"""`colorl bench`: real variant runs of the tiny model, the files they write, failures, bad arguments."""
from __future__ import annotations

import json

import pytest

from colorl.bench.figures import Workload, summarize
from colorl.bench.variants import VariantError, parse_modes
from colorl.cli import main

# every figure issue 9 asks for, per variant
FIGURES = (
    "trained_tokens_per_s", "generated_tokens_per_s", "step_time_s", "staleness_mean", "staleness_max",
    "staleness_pred", "staleness_formula", "rho", "m_tail", "pqs_measured", "pqs_pred", "iqs_measured", "iqs_pred",
    "trainer_wait_frac", "engine_idle_frac", "sampled_len_mean", "trained_len_mean", "groups_aborted",
    "groups_dropped", "groups_filtered", "reward_final", "eval_accuracy_final", "speedup", "staleness_hist",
)
CHARTS = ("frontier.png", "reward.png", "time.png", "staleness_hist.png")


@pytest.mark.matrix
def test_two_variants_side_by_side_and_failing_variants_do_not_stop_the_others(tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(["bench", "configs/tiny.yaml", "--steps", "3", "--warmup", "1", "--out", str(out),
                 "--set", "run.eval_every=3", "--set", "run.eval_prompts=4",
                 "--modes", "colocated,colocated:engine.num_blocks=1,colocated:rollout.temperature=-1,"
                 "bounded_lag:eta=1"])
    assert code == 1  # a variant failed; its error is in the table
    stdout = capsys.readouterr().out

    bench = json.loads((out / "bench.json").read_text())
    assert [v["spec"] for v in bench["variants"]] == [
        "colocated", "colocated:engine.num_blocks=1", "colocated:rollout.temperature=-1", "bounded_lag:eta=1"]
    first, runtime_failure, invalid, last = bench["variants"]
    assert runtime_failure["status"] == "failed" and "KV pool" in runtime_failure["error"]
    assert invalid["status"] == "invalid" and "rollout.temperature" in invalid["error"]
    assert not (out / invalid["run_dir"]).exists()  # rejected before any process started
    for variant in (first, last):
        assert variant["status"] == "ok", variant["error"]
        figures = variant["figures"]
        assert set(FIGURES) <= set(figures) and figures["trained_tokens_per_s_pooled"] > 0
        assert figures["steps_done"] == 3 and figures["steps_measured"] == 2
        assert figures["trained_tokens_per_s"] > 0 and figures["generated_tokens_per_s"] > 0
        assert figures["step_time_s"] > 0 and figures["rho"] > 0
        assert sum(figures["staleness_hist"].values()) == 3 * 4  # every group of every step
        assert figures["eval_accuracy_final"] is not None
        assert 0 <= figures["trainer_wait_frac"] < 1 and 0 <= figures["engine_idle_frac"] < 1
        assert variant["series"]["step"] == [1, 2, 3]
        lines = (out / variant["run_dir"] / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 3
    assert first["figures"]["staleness_max"] == 0 and first["figures"]["staleness_hist"] == {"0": 12}
    assert first["figures"]["idle_source"].startswith("derived") and first["figures"]["trainer_wait_frac"] > 0
    assert last["figures"]["staleness_max"] <= 1 and last["figures"]["idle_source"] == "measured"
    assert last["figures"]["staleness_formula"] is not None
    assert first["figures"]["speedup"] == 1.0
    assert last["figures"]["speedup"] == pytest.approx(
        last["figures"]["trained_tokens_per_s"] / first["figures"]["trained_tokens_per_s"])
    assert last["overrides"][-2:] == ["mode=bounded_lag", "staleness.max=1"]
    assert bench["machine"]["cpu_count"] and bench["machine"]["torch"]
    assert bench["command"].startswith("colorl bench configs/tiny.yaml") and bench["date"]

    for chart in CHARTS:
        assert (out / chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "bench.md").read_text()
    for variant in bench["variants"]:
        assert f"| {variant['spec']} |" in table
    assert "KV pool" in table and "per wall-clock second" in table
    assert "bounded_lag:eta=1" in stdout and "trained tok/s" in stdout


@pytest.mark.parametrize("argv, words", [
    (["--modes", "colocated,sideways"], ["unknown mode", "sideways", "bounded_lag"]),
    (["--modes", "bounded_lag:etta=2"], ["unknown key", "etta", "eta"]),
    (["--modes", "colocated:rollout.concurency=4"], ["unknown key", "rollout.concurency"]),
    (["--modes", "colocated", "--steps", "0"], ["--steps", ">= 1"]),
    (["--modes", "colocated", "--steps", "3", "--warmup", "3"], ["--warmup", "below"]),
    (["--modes", "colocated,bounded_lag:eta=1,colocated"], ["given twice"]),
    (["--modes", "bounded_lag:"], ["no key=value"]),
    (["--modes", "colocated", "--set", "train.lr=fast"], ["train.lr"]),
])
def test_bad_arguments_get_one_line_and_exit_2(tmp_path, capsys, argv, words):
    out = tmp_path / "never"
    assert main(["bench", "configs/tiny.yaml", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("colorl: error:"), err
    assert all(word in err for word in words), err
    assert not out.exists()


def test_out_directory_with_results_is_refused(tmp_path, capsys):
    (tmp_path / "bench.json").write_text("{}")
    assert main(["bench", "configs/tiny.yaml", "--modes", "colocated", "--out", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err


def test_variant_grammar():
    variants = parse_modes("colocated,bounded_lag:eta=2,buffer=queue_drop,kv=recompute,"
                           "bounded_lag:rollout.length_override={mean: 64, cap: 512},nproc=2")
    assert [v.mode for v in variants] == ["colocated", "bounded_lag", "bounded_lag"]
    assert variants[1].overrides == ["mode=bounded_lag", "staleness.max=2", "staleness.buffer=queue_drop",
                                     "staleness.partial_rollout=recompute"]
    assert variants[2].overrides == ["mode=bounded_lag", "rollout.length_override={mean: 64, cap: 512}",
                                     "launch.nproc=2"]
    assert len({v.dirname for v in variants}) == 3 and all("/" not in v.dirname for v in variants)
    with pytest.raises(VariantError, match="before any mode"):
        parse_modes("eta=1,colocated")


def _bounded_step(step: int, wait: float) -> dict:
    return {"step": step, "time_step_s": 2.0, "trained_tokens": 100, "generated_tokens": 150,
            "response_len_mean": 10.0, "staleness_mean": 1.5, "staleness_max": 2,
            "staleness_hist": {"1": 2, "2": 2}, "trainer_wait_s": wait, "engine_idle_frac": 0.1,
            "groups_dropped": 1, "reward_mean": 0.5, "staleness_pred": 1.4, "pqs_measured": 0.5}


def test_figures_of_a_bounded_lag_run_use_its_own_counts_and_skip_the_warmup():
    records = [{**_bounded_step(1, wait=2.0), "trained_tokens": 10}] + [_bounded_step(s, 0.5) for s in (2, 3, 4)]
    figures = summarize(records, Workload("bounded_lag", rollouts_per_step=16, batch_groups=4), warmup=1)
    assert figures["trained_tokens_per_s"] == 50 and figures["generated_tokens_per_s"] == 75
    assert figures["trainer_wait_frac"] == 0.25 and figures["idle_source"] == "measured"
    assert figures["staleness_hist"] == {"1": 8, "2": 8}  # over every step, warm-up included
    assert figures["groups_dropped"] == 4 and figures["groups_aborted"] is None
    assert figures["iqs_measured"] is None and figures["pqs_measured"] == 0.5


@pytest.mark.matrix
def test_one_step_warns_and_its_reward_chart_draws_points(tmp_path, capsys, monkeypatch):
    from colorl.bench import plots

    drawn = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.setdefault(path.name, fig))
    out = tmp_path / "bench"
    assert main(["bench", "configs/tiny.yaml", "--steps", "1", "--out", str(out), "--modes", "colocated"]) == 0
    err = capsys.readouterr().err
    assert "--steps 1 leaves no step after warm-up" in err
    lines = [line for ax in drawn["reward.png"].axes for line in ax.get_lines()]
    assert len(lines) == 2 and all(line.get_marker() == "o" and len(line.get_xdata()) == 1 for line in lines)


def test_the_episodes_table_is_printed_only_for_multi_turn_workloads():
    from rich.console import Console

    from colorl.bench.report import print_tables

    def printed(figures: dict) -> str:
        console = Console(record=True, force_terminal=True, width=300)
        print_tables({"variants": [{"spec": "colocated", "status": "ok", "figures": figures}]}, console)
        return console.export_text()

    completions = printed({"trained_tokens_per_s": 10.0})
    episodes = printed({"trained_tokens_per_s": 10.0, "episode_turns_mean": 2.5, "engine_env_wait_frac": 0.4})
    assert "throughput and time" in completions and "episodes" not in completions
    assert "episodes (task.env)" in episodes and "2.50" in episodes and "40%" in episodes


def test_the_summary_tables_show_every_figure_in_80_columns():
    """A narrow terminal had shown only '…' in colorl bench's tables: each splits into parts that fit."""
    from rich.console import Console

    from colorl.bench.report import print_tables

    figures = {"trained_tokens_per_s": 1234.5, "step_s_median": 9.87, "staleness_max": 2, "engine_idle_frac": 0.25,
               "episode_turns_mean": 2.5, "engine_env_wait_frac": 0.4}
    console = Console(record=True, force_terminal=True, width=80)
    print_tables({"variants": [{"spec": "bounded_lag:eta=2", "status": "ok", "figures": figures},
                               {"spec": "colocated", "status": "ok", "figures": figures}]}, console)
    text = console.export_text()
    assert "…" not in text and "bounded_lag:eta=2" in text and "1234" in text
    assert all(len(line) <= 80 for line in text.splitlines())
